"""FSDP2's unreduced gradients: each rank's own gradient of the whole parameter.

FSDP2 (``fully_shard``) hands the optimizer sharded DTensor parameters whose gradient is already
reduce-scattered and averaged; a hook on them sees the reduced shard. During forward, though,
FSDP2 puts a plain unsharded parameter on each module (the same object every step), and autograd
accumulates this rank's local gradient of the whole tensor into it before FSDP2 reduces it. A
forward pre-hook on each FSDP2 module (running after FSDP2's own, which all-gathers) finds those
parameters once and hooks them with the usual per-parameter hooks; only public module and
tensor hooks are used for that. Each pre-hook looks at the parameters its module holds outside
nested FSDP2 modules (listed at attach), not at its whole subtree: the root's would otherwise
walk every parameter of the model at each collected step.

One detail has no public seam: with a ``reduce_dtype`` other than the parameters' dtype (mixed
precision) and ``set_requires_gradient_sync(False)``, FSDP2 moves the gradients of the skipped
micro-batches into its own fp32 accumulator, so the unsharded parameter's ``.grad`` holds only
the last micro-batch's. That accumulator is read through FSDP2's private state
(adapters.torch.sharded.fsdp_internals); where it is missing, a warning says that such rows are the last
micro-batch's gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from adapters.torch.compiled import traced
from adapters.torch.grads import UnreducedGrads
from adapters.torch.params import ParamRegistry
from adapters.torch.sharded.fsdp_internals import (
    FsdpInternalsChanged,
    check_version,
    fsdp2_group,
    fsdp2_module_type,
    fsdp2_pending_gradient,
    fsdp2_records,
    fsdp2_reduces_gradients,
)
from adapters.torch.sharded.fsdp_sync import ReducedEarly
from monitor.naming import unwrapped_name

logger = logging.getLogger("trainmon")


def own_parameters(module: torch.nn.Module, nested: set[int]) -> list[tuple[str, torch.nn.Module, str]]:
    """``(name under module, owning submodule, attribute)`` of the parameters ``module`` holds
    outside the submodules whose id is in ``nested`` (other FSDP2 modules), as
    ``named_parameters`` names them."""
    found, stack, seen = [], [("", module)], set()
    while stack:
        prefix, current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found += [(f"{prefix}{attr}", current, attr) for attr in current._parameters]
        stack += [
            (f"{prefix}{name}.", child)
            for name, child in reversed(current._modules.items())
            if child is not None and id(child) not in nested
        ]
    return found


def fsdp2_modules(chunks: Sequence[torch.nn.Module]) -> list[tuple[int, str, torch.nn.Module]]:
    """``(vpp_stage, qualified name, module)`` of every FSDP2 module of the chunks (none without FSDP2)."""
    module_type = fsdp2_module_type()
    if module_type is None:
        return []
    return [
        (vpp, name, module)
        for vpp, chunk in enumerate(chunks)
        for name, module in chunk.named_modules()
        if isinstance(module, module_type)
    ]


class _Removable:
    """Removes the hooks put on unsharded parameters so far."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class UnshardedGrads(ReducedEarly, UnreducedGrads):
    """UnreducedGrads whose hooks sit on FSDP2's unsharded parameters."""

    #: the unsharded parameters are found by forward pre-hooks on FSDP2's modules
    uses_module_hooks = True

    def __init__(
        self, modules: list[tuple[int, str, torch.nn.Module]], registry: ParamRegistry, *args: Any
    ) -> None:
        """``modules``: the FSDP2 modules (``fsdp2_modules``); the rest as UnreducedGrads takes it."""
        super().__init__(registry, *args)
        self._modules = modules
        #: by name without wrapper segments (checkpoint_wrapper names its parameters without its own)
        self._index = {(p.vpp_stage, unwrapped_name(p.raw_name)): i for i, p in enumerate(registry.params)}
        #: id(unsharded parameter) -> (the parameter, FSDP2's record of it or None, its FSDP2 module)
        self._hooked: dict[int, tuple[torch.Tensor, Any, torch.nn.Module]] = {}
        nested = {id(module) for _, _, module in modules}
        #: id(FSDP2 module) -> the parameters it holds outside nested FSDP2 modules
        self._owned = {id(module): own_parameters(module, nested - {id(module)}) for _, _, module in modules}
        #: id(FSDP2 parameter group) -> its records (modules grouped by one fully_shard call share one)
        self._records: dict[int, dict[int, Any]] = {}
        self._param_handles = _Removable([])
        self._private_state_missing = False
        check_version()

    def register(self) -> list:
        handles: list = [
            module.register_forward_pre_hook(self._finder(vpp, name, module))
            for vpp, name, module in self._modules
        ]
        return [*handles, self._param_handles]

    def _finder(self, vpp: int, prefix: str, module: torch.nn.Module) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, args: Any) -> None:
            if not traced() and self.collect:
                self._find_unsharded(vpp, prefix, module)

        return hook

    def _find_unsharded(self, vpp: int, prefix: str, module: torch.nn.Module) -> None:
        try:
            self._hook_unsharded(vpp, prefix, module)
        except Exception as exc:
            self.collect = False
            self.on_error("grad_unreduced", exc)

    def _hook_unsharded(self, vpp: int, prefix: str, module: torch.nn.Module) -> None:
        """Hook the unsharded monitored parameters the module holds now, once each (plain tensors,
        or DTensors of the tensor-parallel mesh where FSDP2 runs over a 2-D mesh's dp dimension)."""
        records = None
        for name, owner, attr in self._owned[id(module)]:
            param = owner._parameters.get(attr)
            if param is None or id(param) in self._hooked:
                continue
            index = self._index.get((vpp, unwrapped_name(f"{prefix}.{name}" if prefix else name)))
            if index is None or param is self.registry.params[index].param:  # still the sharded one
                continue
            if records is None:
                records = self._fsdp_records(module)
            self._hooked[id(param)] = (param, records.get(id(param)), module)
            if self.per_micro_batch:
                self._param_handles.handles.append(param.register_hook(self._micro_batch_hook(index)))
            else:
                self._param_handles.handles.append(
                    param.register_post_accumulate_grad_hook(self._accumulated_hook(index))
                )

    def _fsdp_records(self, module: torch.nn.Module) -> dict[int, Any]:
        try:
            group = fsdp2_group(module)
            if id(group) not in self._records:
                self._records[id(group)] = fsdp2_records(group)
            return self._records[id(group)]
        except FsdpInternalsChanged:
            if not self._private_state_missing:
                self._private_state_missing = True
                logger.warning(
                    "trainmon: grad_unreduced: this torch's FSDP2 keeps its gradient accumulator "
                    "elsewhere; with mixed precision and set_requires_gradient_sync(False), rows are "
                    "the last micro-batch's gradient, not the step's sum"
                )
            return {}

    def accumulated(self, index: int, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter's ``.grad``, plus what FSDP2 accumulated in fp32 from micro-batches
        without gradient sync."""
        grad = param.grad
        record = self._hooked.get(id(param), (None, None, None))[1]
        pending = None if record is None else fsdp2_pending_gradient(record)
        if pending is None or grad is None:
            return grad if pending is None else pending
        return pending + grad.to(pending.dtype)

    def _reduces_now(self, index: int, param: torch.Tensor) -> bool:
        module = self._hooked.get(id(param), (None, None, None))[2]
        return module is not None and fsdp2_reduces_gradients(module)
