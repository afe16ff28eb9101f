"""Optimizer back-ends: where a training step ends, and where each parameter's numbers live.

A back-end answers, for one monitored parameter: its reduced gradient as the optimizer sees it,
its (master) values, and its ``exp_avg`` / ``exp_avg_sq``; and it registers the hooks that run
before and after each optimizer step. One back-end per optimizer family, chosen by class name
along the wrapper chain (``BACKENDS``); maps are built once in ``prepare``, never per step.

A sharded back-end (ZeRO, Megatron's distributed optimizer) returns each rank's own piece of a
tensor (or None where the rank holds none) and sets ``sharded``; the collection then records each
piece with its element count, or merges the pieces across ``shard_group`` (``shard_reduce``).

The generic back-end serves every torch.optim optimizer whose state uses the keys ``exp_avg`` /
``exp_avg_sq`` (Adam, AdamW, NAdam, RAdam, ...); others report no moments.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

#: wrappers that hold the optimizer that really steps and only forward to it, by class name ->
#: the attribute holding it. accelerate's AcceleratedOptimizer subclasses torch.optim.Optimizer
#: without running its ``__init__`` (so it has no hook dicts of its own); Lightning's
#: LightningOptimizer is no torch optimizer at all. Both are unwrapped by what they are.
FORWARDING_WRAPPERS = {"AcceleratedOptimizer": "optimizer", "LightningOptimizer": "_optimizer"}


def _wrapped(obj: Any) -> Any:
    """The object ``obj`` wraps (``.optimizer``, or a known wrapper's own attribute), else None."""
    attribute = FORWARDING_WRAPPERS.get(type(obj).__name__, "optimizer")
    try:
        return getattr(obj, attribute, None)
    except Exception:  # a property that refuses, e.g. Megatron's ChainedOptimizer over several
        return None


def unwrap_chain(optimizer: Any, depth: int = 4) -> list[Any]:
    """The optimizer and the objects it wraps (outermost first)."""
    chain, current = [], optimizer
    while current is not None and len(chain) < depth and all(current is not c for c in chain):
        chain.append(current)
        current = _wrapped(current)
    return chain


def _steps_itself(obj: Any) -> bool:
    """A torch optimizer whose own ``__init__`` ran, so that its step hooks exist and fire."""
    return (
        isinstance(obj, torch.optim.Optimizer)
        and type(obj).__name__ not in FORWARDING_WRAPPERS
        and "_optimizer_step_pre_hooks" in vars(obj)
    )


def hookable_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch.optim.Optimizer to hook: the object itself or the one it wraps.

    Raises:
        TypeError: nothing in the wrapper chain is a torch optimizer that steps itself; the
            message names every class of the chain.
    """
    chain = unwrap_chain(optimizer)
    for current in chain:
        if _steps_itself(current):
            return current
    names = " -> ".join(type(c).__name__ for c in chain)
    raise TypeError(
        f"set_monitor: optimizer: expected a torch.optim.Optimizer or a wrapper holding one in .optimizer, "
        f"got {names}, where none is a torch optimizer that runs its own step"
    )


def accumulation_boundary(optimizer: Any) -> Callable[[], bool] | None:
    """A wrapper's own word on whether the running micro-batch is the last of its step, if any.

    accelerate keeps it in ``GradientState.sync_gradients`` (the Hugging Face Trainer sets it for
    every micro-batch, True on the last one, also on a shorter last step of an epoch).
    """
    for current in unwrap_chain(optimizer):
        if type(current).__name__ == "AcceleratedOptimizer":
            state = getattr(current, "gradient_state", None)
            if state is not None and hasattr(state, "sync_gradients"):
                return lambda: bool(state.sync_gradients)
    return None


def scaler_verdict(optimizer: Any) -> Callable[[], bool] | None:
    """Whether a step's gradients are to be judged, where a loss scaler leaves skipping the update
    to the optimizer itself (torch's fused Adam, AdamW and SGD: ``GradScaler`` hands it
    ``found_inf`` for the duration of the step, and the optimizer's hooks run either way). Asked
    on the writer thread, so that the training thread never waits for the device; None without one."""
    found_inf = getattr(optimizer, "found_inf", None)
    if not isinstance(found_inf, torch.Tensor):
        return None
    return lambda: not bool(found_inf.item())


class LateVerdict:
    """Whether a step's gradients are to be judged, where the loss scaler decides inside the
    optimizer's step (DeepSpeed's fp16). The writer holds the records that carry it until their
    step ends, by when the step has returned and ``settle`` said; never settled (the step raised)
    means judged."""

    def __init__(self) -> None:
        self.settled = False
        self._judged = True

    def settle(self, judged: bool) -> None:
        """The step returned; ``judged``: its gradients are to be judged (no overflow)."""
        self._judged, self.settled = judged, True

    def __call__(self) -> bool:
        return self._judged


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int | None:
    """The optimizer's own count of updates (``state[p]["step"]`` of Adam-like optimizers), if any."""
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:
            return int(step)
    return None


class TorchBackend:
    """Any torch.optim optimizer: hooks on it, moments in ``optimizer.state[param]``."""

    #: ranks hold different pieces of the same tensor (set by sharded back-ends).
    sharded = False
    #: the group whose ranks hold the pieces (shard_reduce merges over it).
    shard_group: Any = None
    #: parameters are DTensors (FSDP2, tensor parallelism): with shard_reduce the activations of
    #: tensor-parallel modules merge over their mesh too.
    dtensors = False
    #: the optimizer takes each micro-batch's gradient away after its backward (reduced into its
    #: own buffers and freed), so that ``.grad`` never holds the step's sum.
    frees_micro_batch_grads = False
    #: what the optimizer's own collectives carry besides the model's values, said with cc_distribution.
    collectives_caveat: str | None = None

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = hookable_optimizer(optimizer)
        self._local_grad: Callable[[torch.nn.Parameter], torch.Tensor | None] = lambda p: p.grad

    def named_parameters(self, chunk: torch.nn.Module) -> Iterable[tuple[str, Any]]:
        """The chunk's parameters by name, as the monitor selects and names them."""
        return chunk.named_parameters()

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        """Attach-time set-up for the monitored parameters; ``local_grad`` reads main_grad/.grad."""
        self._local_grad = local_grad

    def register_step_hooks(self, before: Callable, after: Callable) -> list:
        """Hooks around each optimizer step, called as ``fn(optimizer, args, kwargs)``."""
        return [self.optimizer.register_step_pre_hook(before), self.optimizer.register_step_post_hook(after)]

    #: a dynamic loss scale decides inside this back-end's own step whether the update is skipped
    #: (DeepSpeed's and Megatron's fp16); torch's own scaler is read by the session instead.
    loss_scaled = False
    _verdict: LateVerdict | None = None

    def late_verdict(self) -> LateVerdict | None:
        """For a step about to run: the judgement of its gradients that its loss scaler gives
        inside the step, or None (judged as always). Without a loss scale a skipped update (bf16
        with a NaN gradient) is a fault."""
        self._verdict = LateVerdict() if self.loss_scaled else None
        return self._verdict

    def settle_verdict(self) -> None:
        """The step has returned: settle what ``late_verdict`` handed out."""
        if self._verdict is not None:
            self._verdict.settle(not self.overflowed())
            self._verdict = None

    def overflowed(self) -> bool:
        """Whether the step that just returned found an overflow and skipped its update."""
        return False

    def step_count(self) -> int | None:
        return optimizer_step_count(self.optimizer)

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The reduced gradient the optimizer uses (this rank's piece when sharded)."""
        return self._local_grad(param)

    def numel(self, param: torch.nn.Parameter) -> int:
        """Elements of the whole parameter (a sharded back-end knows it when the param is empty)."""
        return param.numel()

    def value(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The values the optimizer updates (the fp32 master copy where there is one); read only,
        by statistics that run without autograd (no detached copy per parameter)."""
        return param

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        """``exp_avg`` / ``exp_avg_sq`` of a parameter, or None before its first update."""
        state = self.optimizer.state.get(param)
        if not state:
            return None
        value = state.get(key)
        return value if isinstance(value, torch.Tensor) else None

    def state_owner(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
        """The torch optimizer that updates ``param`` and the tensor it keeps state for (a
        master copy, a flat partition...), or None where this rank updates none of it."""
        return self.optimizer, param

    def adam_hyper(self, param: Any) -> tuple[float | torch.Tensor, float, float, float, bool] | None:
        """``(step, beta1, beta2, eps, bias_correction)`` of the Adam state behind ``param``'s
        moments, from the param group of the tensor the optimizer updates (DeepSpeed's and apex's
        Adams keep ``bias_correction`` there); None before its first update. The step
        stays a float64 tensor where the optimizer keeps it on an accelerator (fused or
        capturable Adam): reading it would make the host wait for the device."""
        owner = self.state_owner(param)
        if owner is None:
            return None
        optimizer, key = owner
        state = optimizer.state.get(key)
        if not state or "step" not in state:
            return None
        group = self._param_group(optimizer, key)
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        step = state["step"]
        if isinstance(step, torch.Tensor) and step.device.type != "cpu":
            step = step.to(torch.float64)
        else:
            step = float(step)
        correction = bool(group.get("bias_correction", True))
        return step, float(beta1), float(beta2), float(group.get("eps", 1e-8)), correction

    def _param_group(self, optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> dict:
        """The param group holding ``tensor`` (the defaults when none does), from a map built
        once per optimizer and rebuilt when it lacks the tensor (groups added later)."""
        maps = self.__dict__.setdefault("_group_maps", {})
        groups = maps.get(id(optimizer))
        if groups is None or id(tensor) not in groups:
            groups = maps[id(optimizer)] = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        return groups.get(id(tensor), optimizer.defaults)


#: optimizer class name (anywhere in the wrapper chain, outermost first) -> back-end class.
BACKENDS: dict[str, type] = {}


#: top-level package of an optimizer class -> the module that registers its back-ends (lazily imported).
BACKEND_MODULES = {
    "megatron": "adapters.torch.sharded.megatron",
    "deepspeed": "adapters.torch.sharded.deepspeed",
}


def optimizer_backend(optimizer: Any, chunks: Sequence[torch.nn.Module] = ()) -> TorchBackend:
    """The back-end registered for a class name in the optimizer's wrapper chain, else FSDP1's for
    model ``chunks`` wrapped in FullyShardedDataParallel, else the DTensor one where parameters
    are DTensors (FSDP2, tensor parallelism), else the generic one.

    Once the application has imported DeepSpeed, a torch optimizer inside a DeepSpeed wrapper
    (``engine.optimizer.optimizer``) stands for that wrapper.
    """
    if "deepspeed" in sys.modules:
        optimizer = importlib.import_module("adapters.torch.sharded.deepspeed").deepspeed_owner(optimizer)
    chain = unwrap_chain(optimizer)
    for current in chain:
        module = BACKEND_MODULES.get(type(current).__module__.split(".", 1)[0])
        if module is not None:
            importlib.import_module(module)
    for current in chain:
        for cls in type(current).__mro__:
            backend = BACKENDS.get(cls.__name__)
            if backend is not None:
                return backend(current)
    backend = TorchBackend(optimizer)
    if not torch.distributed.is_available():
        return backend
    from adapters.torch.sharded.dtensor import DTensorBackend, holds_dtensors
    from adapters.torch.sharded.fsdp_flat import FlatParamBackend, flat_units

    units = flat_units(chunks)
    if units:
        return FlatParamBackend(optimizer, units)
    if holds_dtensors(backend.optimizer, chunks):
        return DTensorBackend(optimizer)
    return backend
