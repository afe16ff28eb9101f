"""One attached TrainerMon on a PyTorch model: the optimizer hooks and the step counter.

Only instance-level hooks are used (optimizer step pre/post hooks here; parameter and module
hooks in the Collection). Nothing is patched on a class or set on the user's objects. The
session owns the step counter and the two optimizer hooks for its whole life; what is collected
under a given config lives in a Collection, which can be started, stopped and replaced while the
run goes on (``start()``, ``stop()``, dynamic mode) without touching the optimizer's hook dicts
while torch iterates them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from adapters.torch.bundle import facts as bundle_facts
from adapters.torch.bundle import record_tensors
from adapters.torch.collection import Collection
from adapters.torch.compiled import traced, uncompiled
from adapters.torch.dist import (
    StoreChannel,
    any_rank,
    ddp_wrappers,
    global_rank,
    pipeline_info,
    same_on_every_rank,
    schedule_channel,
    world_size,
)
from adapters.torch.optim import TorchBackend, accumulation_boundary, optimizer_backend, scaler_verdict
from adapters.torch.optimizer_checks import stale_parameters
from adapters.torch.sharded.dtensor import DTensorBackend, holds_replicated_dtensors
from monitor.session.lifecycle import Attachment, SessionLifecycle, model_chunks

logger = logging.getLogger("trainmon")


class TorchSession(SessionLifecycle):
    """Hooks of one TrainerMon on one PyTorch model and optimizer."""

    collection: Collection | None

    def __init__(self, attachment: Attachment) -> None:
        a = attachment
        chunks = model_chunks(a.model, torch.nn.Module, "torch.nn.Module")
        if a.optimizer is None:
            raise ValueError("set_monitor: optimizer: required (its step marks the end of a training step)")
        self.chunks = [_outer_fsdp1(uncompiled(chunk)) for chunk in chunks]
        #: the model was given compiled as a whole, or said to run so (its compiled code runs the
        #: chunks' roots)
        self.given_compiled = a.compiled or any(
            given is not plain for given, plain in zip(chunks, self.chunks)
        )
        #: the gradients skip_step dropped this step, by parameter id, until its bundles are written
        self.skipped_grads: dict[int, torch.Tensor] = {}
        self.backend = optimizer_backend(a.optimizer, self.chunks)
        self.optimizer = self.backend.optimizer
        groups = getattr(self.optimizer, "param_groups", None)
        holds_none = groups is not None and not any(group.get("params") for group in groups)
        if type(self.backend) is TorchBackend and holds_none:
            raise ValueError(
                f"set_monitor: optimizer: expected the optimizer that updates the model, got "
                f"{type(self.optimizer).__name__} holding no parameters (such as Lightning's "
                "placeholder where configure_optimizers returns None): its step, which marks a "
                "training step's end, never comes"
            )
        if a.config.module_ranks and holds_replicated_dtensors(self.optimizer, self.chunks):
            raise ValueError(
                "module_ranks: expected empty with tensor parallelism (the gradients of parameters "
                "replicated over a device mesh dimension can be partial sums, completed by a collective "
                f"every rank of the mesh takes part in), got {list(a.config.module_ranks)}"
            )
        device = next((p.device for chunk in self.chunks for p in chunk.parameters()), torch.device("cpu"))
        sharded = a.config.shard_reduce and self.backend.sharded
        if sharded and not same_on_every_rank(a.config.fingerprint(), device):
            raise ValueError(
                "shard_reduce: expected the same config on every rank (its merges are collectives "
                "that every rank takes at the same steps for the same data types), got configs that "
                "differ between ranks"
            )
        super().__init__(a.config, global_rank(), a.start_iteration, a.on_step_end)
        self.world_size = world_size()
        self.pp_stage, self.group_mates = pipeline_info(a.process_group)
        self.grad_acc_steps = a.grad_acc_steps
        self.main_grad = a.params_have_main_grad
        self.groups = (a.tp_group, a.dp_group)
        self.collectives = a.early_collectives
        #: the back-end's caveat about its collectives, once said
        self._said_caveat: str | None = None
        self._cleanup: list = []
        #: the optimizer step's closure is running (Lightning, LBFGS-style steps).
        self._in_closure = False
        #: the optimizer was called with a closure whose end has not been seen yet.
        self._closure_pending = False
        # the DDP modules that reduce the model's gradients: the chunks that are one, or those
        # found around the chunks (None where a chunk has none); looked for with torch's own
        # optimizers only (DeepSpeed, Megatron and FSDP reduce without torch's DDP)
        found = ddp_wrappers(self.chunks, look_around=type(self.backend) is TorchBackend)
        watched = found if found is not None else [c for c in self.chunks if isinstance(c, DDP)]
        #: those DDP modules, held weakly (a wrapper found around the model is the trainer's to
        #: free), each with whether it was given as a chunk; and whether they cover every chunk
        self._ddp = [(weakref.ref(m), any(m is c for c in self.chunks)) for m in watched]
        self._ddp_cover_all = found is not None
        #: per DDP chunk: whether its latest training forward will have its backward reduced; and
        #: the chunks that ran a forward since the last optimizer step
        self._ddp_syncing: dict[int, bool] = {}
        self._ddp_forwarded: set[int] = set()
        self._told_ddp_sync = False
        #: the training loop's word that the running micro-batch is its step's last
        self._told_last = False
        self._boundaries = self._micro_batch_boundaries(a.optimizer)
        self._attach(a.dormant)

    def _micro_batch_boundaries(self, optimizer: Any) -> list[Callable[[], bool]]:
        """What can tell, while a backward pass runs, that its micro-batch is the step's last."""
        boundaries: list[Callable[[], bool]] = [lambda: self._in_closure, lambda: self._told_last]
        wrapper = accumulation_boundary(optimizer)
        if wrapper is not None:
            boundaries.append(wrapper)
        for ref, given in self._ddp:  # DDP synchronises the last micro-batch only, when no_sync is used
            boundaries.append(lambda ref=ref, given=given: self._ddp_syncs(ref(), given))
        return boundaries

    def _ddp_modules(self) -> list[torch.nn.Module]:
        """The DDP modules watched that are still alive."""
        return [module for ref, _ in self._ddp if (module := ref()) is not None]

    def _ddp_wrappers(self) -> list[torch.nn.Module] | None:
        """The DDP modules that reduce every chunk's gradients, or None (a chunk has none, or a
        wrapper found was freed since)."""
        modules = self._ddp_modules()
        return modules if self._ddp_cover_all and len(modules) == len(self._ddp) else None

    def _note_ddp_sync(self, chunk: torch.nn.Module, args: tuple) -> None:
        """DDP forward pre-hook: whether this micro-batch's backward will be reduced, as DDP decides
        it, at the forward (under ``no_sync()`` or not); a micro-batch after a reduced one in the
        same step is said once, since its gradients then hold other ranks' too."""
        if not (torch.is_grad_enabled() and chunk.training):
            return
        key = id(chunk)
        reduced_before = key in self._ddp_forwarded and self._ddp_syncing.get(key, False)
        if reduced_before and self.config.wg_distribution and not self._told_ddp_sync:
            self._told_ddp_sync = True
            remedy = (
                "the per-micro-batch rows (monitor_mbs_grad) hold each micro-batch's own"
                if self.config.monitor_mbs_grad
                else "or set monitor_mbs_grad for each micro-batch's own"
            )
            logger.warning(
                "trainmon: wg_distribution: DDP reduced a micro-batch before the step's last "
                "(outside model.no_sync()), so grad_unreduced holds other ranks' gradients too; "
                "accumulate under no_sync(), as torch recommends; %s",
                remedy,
            )
        self._ddp_syncing[key] = bool(chunk.require_backward_grad_sync)
        self._ddp_forwarded.add(key)

    def _ddp_syncs(self, chunk: torch.nn.Module | None, given: bool) -> bool:
        """Whether DDP reduces the backward of ``chunk``'s latest forward. A wrapper found around
        the model (not ``given``) counts only once its forward was seen: one left by an earlier
        run never runs one."""
        if chunk is None:
            return False
        return self._ddp_syncing.get(id(chunk), given and bool(chunk.require_backward_grad_sync))

    def _last_micro_batch(self) -> bool:
        return any(boundary() for boundary in self._boundaries)

    def set_last_micro_batch(self, last: bool) -> None:
        """The loop says whether the micro-batch about to run backward is its step's last."""
        self._told_last = last

    def micro_batch_begins(self) -> None:
        """A trainer says a micro-batch's forward begins (see ``TrainerMon.micro_batch_begins``)."""
        if self.collection is not None:
            try:
                self.collection.micro_batch_begins()
            except Exception as exc:  # never the trainer's problem
                self.collection.fail("actv", exc)

    # -- public control ----------------------------------------------------------------------

    # -- the collection of one config --------------------------------------------------------

    def _new_collection(self) -> Collection:
        if self.config.cc_distribution.enable and (
            self.collectives is None or self._collectives_config_changed()
        ):
            from adapters.torch.collectives import CollectiveMonitor

            if self.collectives is not None:
                self.collectives.remove()  # the registry keeps the wrappers while others subscribe
            self.collectives = CollectiveMonitor(self.config)
        caveat = self.backend.collectives_caveat if self.config.cc_distribution.enable else None
        if caveat and caveat != self._said_caveat:
            self._said_caveat = caveat
            logger.warning("trainmon: cc_distribution: %s", caveat)
        collection = Collection(
            config=self.config,
            chunks=self.chunks,
            backend=self.backend,
            rank=self.rank,
            pp_stage=self.pp_stage,
            group_mates=self.group_mates,
            grad_acc_steps=self.grad_acc_steps,
            main_grad=self.main_grad,
            tp_group=self.groups[0],
            dp_group=self.groups[1],
            first_step=self.step,
            output_dir=self._output_dir,
            collectives=self.collectives if self.config.cc_distribution.enable else None,
            last_micro_batch=self._last_micro_batch,
            ddp_wrappers=self._ddp_wrappers(),
            given_compiled=self.given_compiled,
        )
        return collection

    def _collectives_config_changed(self) -> bool:
        old = self.collectives.config
        return (old.cc_distribution, old.ops, old.eps) != (
            self.config.cc_distribution,
            self.config.ops,
            self.config.eps,
        )

    # -- optimizer hooks ---------------------------------------------------------------------

    def _attach_optimizer_hooks(self) -> None:
        self._hooks = self.backend.register_step_hooks(self._before_update, self._after_step)
        self._hooks += [ddp.register_forward_pre_hook(self._note_ddp_sync) for ddp in self._ddp_modules()]

    def _optimizer_step_count(self) -> int | None:
        return self.backend.step_count()

    def _monitored_not_the_models(self) -> int:
        params = [entry.param for entry in self.collection.registry.params]
        return len(stale_parameters(self.backend, params, [p for c in self.chunks for p in c.parameters()]))

    def _detach_optimizer_hooks(self) -> None:
        for handle in self._hooks + self._cleanup:
            handle.remove()
        self._hooks, self._cleanup = [], []

    def _before_update(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Optimizer pre-hook. A step called with a closure (Lightning, LBFGS) runs the last
        micro-batch's forward and backward, and the clipping, inside the closure: the closure is
        wrapped so that the step is collected when it returns; its result passes through unchanged."""
        torch_hook = bool(args) and args[0] is optimizer  # not a back-end's wrapped step: args replaceable
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if self.collection is not None and self.collection.collect:  # a loss scaler's say on its gradients
            verdict = scaler_verdict(optimizer) if torch_hook else self.backend.late_verdict()
            if verdict is not None:
                self.collection.gradients_judged = verdict
        if closure is None or not torch_hook or self.collection is None:
            self._begin_update()
            return None
        self._closure_pending = True
        wrapped = self._collect_after(closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _collect_after(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        def run_closure(*args: Any, **kwargs: Any) -> Any:
            if not self._closure_pending:  # a later evaluation (LBFGS's line search)
                return closure(*args, **kwargs)
            self._in_closure = True
            try:
                result = closure(*args, **kwargs)
            finally:
                self._in_closure = False
            self._closure_pending = False
            with torch.no_grad():
                self._begin_update()
            return result

        return run_closure

    def _after_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Optimizer post-hook; an optimizer that never called its closure is collected here."""
        try:
            self.backend.settle_verdict()
        except Exception as exc:  # left unsettled, the step's gradients are judged as ever
            logger.error("trainmon: reading the loss scaler's verdict failed (%r)", exc)
        if self._closure_pending:
            self._closure_pending = False
            self._begin_update()
        self._forget_step_signals()
        self._after_update()

    def update_skipped(self) -> None:
        """As the base's; nothing for an optimizer that skips the update itself (fused ones): the
        scaler always calls its step, whose hooks ended the step already."""
        if getattr(self.backend.optimizer, "_step_supports_amp_scaling", False):
            return
        self._closure_pending = False
        self._forget_step_signals()
        super().update_skipped()

    def _forget_step_signals(self) -> None:
        """The step ended: what DDP's forwards and ``set_last_micro_batch`` said of it is spent."""
        self._ddp_forwarded.clear()
        self._told_last = False

    def _bundle_contents(
        self, incident: dict[str, Any], budget: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        info, generators = bundle_facts(self)
        inputs, tensors = record_tensors(self, incident, budget)
        return {**info, **inputs}, {**tensors, **generators}

    def _keep_module_inputs(self, budget: int) -> None:
        self.skipped_grads = {}  # the step's bundles are written: the dropped gradients may go
        activations = self.collection.activations if self.collection is not None else None
        if activations is not None:
            activations.kept.start(budget)

    def _skip_update(self) -> None:
        """torch.optim optimizers leave a parameter without a gradient alone: its value, moments
        and step count stay. Back-ends that keep gradients elsewhere (DeepSpeed, Megatron, FSDP's
        flat parameters) are not skipped."""
        if type(self.backend) not in (TorchBackend, DTensorBackend):
            super()._skip_update()
            return
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:  # kept for the step's evidence bundle, the key evidence
                    self.skipped_grads[id(param)] = param.grad
                param.grad = None

    def schedule_channel(self) -> StoreChannel | None:
        return schedule_channel()

    def _agree_on_stop(self, asked_here: bool) -> bool:
        device = next((p.device for chunk in self.chunks for p in chunk.parameters()), torch.device("cpu"))
        return any_rank(asked_here, device)

    def _detach_after_this_step(self) -> None:
        """Monitoring ended inside the optimizer's post-hook loop.

        Torch iterates its hook dicts while we run, so our hooks cannot be removed here; they are
        inert now and removed at the next forward of the model (or by stop()). A model compiled
        as a whole runs this cleanup inside its compiled code, where removing hooks cannot be
        traced: there they stay, inert, until stop().
        """
        if not self._hooks or self._cleanup:
            return

        def cleanup(module: Any, args: Any) -> None:
            if not traced():
                self._detach_optimizer_hooks()

        self._cleanup = [chunk.register_forward_pre_hook(cleanup) for chunk in self.chunks]


def _outer_fsdp1(chunk: torch.nn.Module) -> torch.nn.Module:
    """The FSDP1 wrapper of a chunk given as the wrapper's inner module (said), else the chunk."""
    if not torch.distributed.is_available():
        return chunk
    from adapters.torch.sharded.fsdp_flat import fsdp1_wrapper_of

    wrapper = fsdp1_wrapper_of(chunk)
    if wrapper is None:
        return chunk
    logger.info(
        "trainmon: the model given is the inner module of a FullyShardedDataParallel wrapper; the "
        "wrapper is monitored, which maps the parameters of its root unit"
    )
    return wrapper
