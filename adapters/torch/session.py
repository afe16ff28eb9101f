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
from collections.abc import Callable
from typing import Any

import torch

from adapters.torch.collection import Collection
from adapters.torch.dist import global_rank, pipeline_info
from adapters.torch.optim import optimizer_backend
from monitor.config import MonitorConfig
from monitor.errors import CollectivesLogged, StructurePrinted
from monitor.schedule import rank_enabled

logger = logging.getLogger("trainmon")


def _uncompiled(chunk: torch.nn.Module) -> torch.nn.Module:
    """The module that torch.compile wrapped (OptimizedModule keeps it as ``_orig_mod``), so that
    names and hooks are those of the eager model."""
    inner = getattr(chunk, "_orig_mod", None)
    if type(chunk).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module):
        return inner
    return chunk


class TorchSession:
    """Hooks of one TrainerMon on one PyTorch model and optimizer."""

    def __init__(
        self,
        *,
        config: MonitorConfig,
        model: Any,
        grad_acc_steps: int,
        optimizer: Any,
        process_group: Any,
        params_have_main_grad: bool | None,
        tp_group: Any,
        dp_group: Any,
        start_iteration: int,
        early_collectives: Any = None,
        dormant: bool = False,
        on_step_end: Callable[[int], None] | None = None,
    ) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, torch.nn.Module):
                raise TypeError(
                    f"set_monitor: model[{i}]: expected a torch.nn.Module, got {type(chunk).__name__}"
                )
        if optimizer is None:
            raise ValueError("set_monitor: optimizer: required (its step marks the end of a training step)")
        self.config = config
        self.chunks = [_uncompiled(chunk) for chunk in chunks]
        self.compiled = any(a is not b for a, b in zip(chunks, self.chunks))
        self.backend = optimizer_backend(optimizer)
        self.optimizer = self.backend.optimizer
        self.rank = global_rank()
        self.pp_stage, self.group_mates = pipeline_info(process_group)
        self.grad_acc_steps = grad_acc_steps
        self.main_grad = params_have_main_grad
        self.groups = (tp_group, dp_group)
        self.step = start_iteration
        self.collectives = early_collectives
        self.on_step_end = on_step_end
        self.collection: Collection | None = None
        self._output_dir: str | None = None
        self._core: Any = None
        self._hooks: list = []
        self._cleanup: list = []
        self._in_post_hook = False
        self._steps_at_stop: int | None = None
        if not rank_enabled(config, self.rank):
            logger.info("trainmon: rank %d is not in module_ranks; nothing is monitored here", self.rank)
            return
        self._attach_optimizer_hooks()
        if not dormant:
            self.start(config)

    # -- public control ----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.collection is not None

    @property
    def core(self) -> Any:
        """The outputs of the current (or last) collection; None when nothing was ever collected."""
        return self.collection.core if self.collection is not None else self._core

    def start(self, config: MonitorConfig | None = None) -> None:
        """Collect with ``config`` (default: the current one) from the current step on."""
        if not rank_enabled(config or self.config, self.rank):
            return
        if self.collection is not None:
            self._end_collection()
        self.config = config or self.config
        if not self._hooks:
            self._attach_optimizer_hooks()
        if self.config.cc_distribution.enable and (
            self.collectives is None or self._collectives_config_changed()
        ):
            from adapters.torch.collectives import CollectiveMonitor

            if self.collectives is not None:
                self.collectives.remove()  # the registry keeps the wrappers while others subscribe
            self.collectives = CollectiveMonitor(self.config)
        self.collection = Collection(
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
        )
        self._output_dir = self.collection.core.output_dir
        if self.compiled and self.config.xy_distribution:
            logger.warning(
                "trainmon: xy_distribution: the model is compiled with torch.compile; its activations are "
                "recorded only if set_monitor ran before the compiled model's first call (module hooks "
                "added later are never run by compiled code). Gradients, parameters, moments, mg_direction "
                "and collectives are recorded as in eager mode."
            )
        kinds = [
            k
            for k in (
                "wg_distribution",
                "mv_distribution",
                "param_distribution",
                "mg_direction",
                "xy_distribution",
            )
            if getattr(self.config, k)
        ]
        logger.info(
            "trainmon: monitoring %d parameters (%s) on rank %d from step %d, output %s",
            len(self.collection.registry),
            ", ".join(kinds) or "nothing selected",
            self.rank,
            self.step,
            self.collection.core.output_dir or "in memory (format api)",
        )

    def _collectives_config_changed(self) -> bool:
        old = self.collectives.config
        return (old.cc_distribution, old.ops, old.eps) != (
            self.config.cc_distribution,
            self.config.ops,
            self.config.eps,
        )

    def stop(self) -> None:
        """Remove every hook and close the outputs (idempotent)."""
        self._end_collection()
        if self._hooks:
            self._steps_at_stop = self.backend.step_count()
        self._detach_optimizer_hooks()

    def resume_step_count(self, step: int | None) -> None:
        """After stop() no hook counts steps: continue from ``step``, else from the optimizer's own count."""
        if step is not None:
            self.step = step
            return
        now = self.backend.step_count()
        if now is not None and self._steps_at_stop is not None:
            self.step += now - self._steps_at_stop
        self._steps_at_stop = None

    # -- optimizer hooks ---------------------------------------------------------------------

    def _attach_optimizer_hooks(self) -> None:
        self._hooks = self.backend.register_step_hooks(self._before_update, self._after_update)

    def _detach_optimizer_hooks(self) -> None:
        for handle in self._hooks + self._cleanup:
            handle.remove()
        self._hooks, self._cleanup = [], []

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.collection is not None:
            try:
                self.collection.before_update()
            except StructurePrinted:  # the only exception that leaves a hook: the user asked for it
                self._end_collection()
                self._detach_after_this_step()
                raise

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_post_hook = True
        try:
            if self.collection is not None:
                try:
                    self.collection.after_update()
                except Exception as exc:
                    self.collection.fail("step end", exc)
        finally:
            self.step += 1
            if self.collection is not None:
                if self.collection.finished:
                    logger.info(
                        "trainmon: collect_times reached (%d steps); monitoring stopped",
                        self.collection.schedule.collected,
                    )
                    self._end_collection()
                else:
                    try:
                        self.collection.set_step(self.step)
                    except CollectivesLogged:  # cc_log_only: the user asked the run to stop here
                        self._end_collection()
                        self._detach_after_this_step()
                        self._in_post_hook = False
                        raise
            if self.on_step_end is not None:
                try:
                    self.on_step_end(self.step)
                except Exception as exc:  # live control must never stop the training
                    logger.error("trainmon: live control failed (%r); monitoring state unchanged", exc)
            if self.collection is None and self.on_step_end is None:
                self._detach_after_this_step()
            self._in_post_hook = False

    def _end_collection(self) -> None:
        if self.collection is not None:
            self._core = self.collection.core
            self.collection.remove()
            self.collection = None

    def _detach_after_this_step(self) -> None:
        """Monitoring ended inside the optimizer's post-hook loop.

        Torch iterates its hook dicts while we run, so our hooks cannot be removed here; they are
        inert now and removed at the next forward of the model (or by stop()).
        """
        if not self._hooks or self._cleanup:
            return

        def cleanup(module: Any, args: Any) -> None:
            self._detach_optimizer_hooks()

        self._cleanup = [chunk.register_forward_pre_hook(cleanup) for chunk in self.chunks]
