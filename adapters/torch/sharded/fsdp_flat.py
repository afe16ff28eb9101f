"""FSDP1 (``FullyShardedDataParallel``): every original parameter's rows, read from FSDP's flat
parameters.

FSDP1 flattens each unit's parameters into one FlatParameter and gives each rank a contiguous
shard of it. With ``use_orig_params=True`` the original parameters are 1-D views of that shard
(possibly empty); with ``use_orig_params=False`` (the default) they do not exist outside forward,
and the optimizer sees only FlatParameters. Either way, rows here are per original parameter,
under its original name: this rank's piece of it (with its element count), or with
``shard_reduce`` the whole tensor merged over the unit's process group.

- reduced gradient, values, moments: this rank's piece of the flat shard, its gradient and the
  optimizer state (of the original parameter, or the matching piece of the FlatParameter's);
- unreduced gradient: a hook on each FlatParameter sees the unsharded flat gradient of this rank
  before FSDP reduce-scatters it (accumulated over ``no_sync`` micro-batches), and each original
  parameter's part of it is measured whole.

Where each parameter lies in the flat tensors comes from adapters.torch.sharded.fsdp_internals.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from adapters.torch.dist import live_wrappers
from adapters.torch.grads import UnreducedGrads
from adapters.torch.optim import TorchBackend
from adapters.torch.sharded.fsdp_internals import (
    FlatSlot,
    FsdpInternalsChanged,
    check_version,
    flat_layout,
    fsdp1_reduces_gradients,
    fsdp1_units,
)
from adapters.torch.sharded.fsdp_sync import ReducedEarly

logger = logging.getLogger("trainmon")

#: the name FSDP1 registers each unit's FlatParameter under
FLAT_PARAM = "_flat_param"


class FlattenedParam:
    """Stands in the registry for an original parameter that ``use_orig_params=False`` flattened
    away (its rows come from its slot in the FlatParameter)."""

    requires_grad = True
    grad = None

    def __init__(self, slot: FlatSlot) -> None:
        self.slot = slot


class FlatParamBackend(TorchBackend):
    """A torch optimizer over FSDP1's parameters: pieces of each original parameter."""

    sharded = True

    def __init__(self, optimizer: Any, units: Sequence[Any]) -> None:
        super().__init__(optimizer)
        check_version()
        self.shard_group = units[0].process_group
        #: id(registry object) -> its slot
        self.slots: dict[int, FlatSlot] = {}

    def named_parameters(self, chunk: torch.nn.Module) -> list[tuple[str, Any]]:
        """The chunk's parameters by original name: FlatParameters are replaced by a stand-in per
        original parameter they hold."""
        by_flat: dict[int, list[FlatSlot]] = {}
        by_original: dict[int, FlatSlot] = {}
        try:
            layouts = [flat_layout(unit) for unit in fsdp1_units(chunk)]
        except FsdpInternalsChanged as exc:
            logger.warning(
                "trainmon: FSDP1: this torch keeps its flat-parameter layout elsewhere (%s); rows are "
                "each rank's pieces as the optimizer sees them (flat parameters where use_orig_params "
                "is False), shard_reduce still merges them exactly, and grad_unreduced is not recorded",
                exc,
            )
            return list(chunk.named_parameters())
        for slot in (slot for layout in layouts for slot in layout):
            by_flat.setdefault(id(slot.flat), []).append(slot)
            if slot.original is not None:
                by_original[id(slot.original)] = slot
        named: list[tuple[str, Any]] = []
        for name, param in chunk.named_parameters():
            slot = by_original.get(id(param))
            if slot is not None:
                self.slots[id(param)] = slot
            if id(param) not in by_flat:  # an original parameter, or not FSDP's
                named.append((name, param))
                continue
            prefix = name[: -len(FLAT_PARAM)]
            for slot in by_flat[id(param)]:
                stand_in = FlattenedParam(slot)
                self.slots[id(stand_in)] = slot
                named.append((prefix + slot.fqn, stand_in))
        return named

    def prepare(self, params: Sequence[Any], local_grad: Callable) -> None:
        """Keep the slots of the monitored parameters only (stand-ins of an earlier collection
        are gone, and their ids may be reused)."""
        super().prepare(params, local_grad)
        self.slots = {id(p): self.slots[id(p)] for p in params if id(p) in self.slots}

    def grad(self, param: Any) -> torch.Tensor | None:
        slot = self.slots.get(id(param))
        if slot is None:
            return super().grad(param)
        grad = slot.flat.grad
        if grad is None or not slot.shard_numel or grad.numel() != slot.flat.numel():
            return None  # no reduced gradient now (or a no_sync micro-batch's unsharded one)
        return grad.narrow(0, slot.shard_offset, slot.shard_numel)

    def numel(self, param: Any) -> int:
        slot = self.slots.get(id(param))
        return param.numel() if slot is None else slot.numel

    def value(self, param: Any) -> torch.Tensor | None:
        slot = self.slots.get(id(param))
        if slot is None:
            return param
        if not slot.shard_numel:
            return None
        return slot.flat.detach().narrow(0, slot.shard_offset, slot.shard_numel)

    def moment(self, param: Any, key: str) -> torch.Tensor | None:
        slot = self.slots.get(id(param))
        if slot is None:
            return super().moment(param, key)
        if slot.original is not None:
            return super().moment(slot.original, key) if slot.shard_numel else None
        flat_moment = super().moment(slot.flat, key)
        if flat_moment is None or not slot.shard_numel:
            return None
        return flat_moment.narrow(0, slot.shard_offset, slot.shard_numel)

    def state_owner(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
        slot = self.slots.get(id(param))
        if slot is None:
            return super().state_owner(param)
        return self.optimizer, slot.original if slot.original is not None else slot.flat


class FlatGrads(ReducedEarly, UnreducedGrads):
    """UnreducedGrads from one hook per FlatParameter: each original parameter's part of the
    unsharded flat gradient."""

    def __init__(self, slots: dict[int, FlatSlot], *args: Any) -> None:
        """``slots``: registry index -> slot; the rest as UnreducedGrads takes it."""
        super().__init__(*args)
        #: registry index -> slot
        self._slots = slots

    def register(self) -> list:
        units: dict[int, tuple[torch.nn.Parameter, list[int]]] = {}
        for index, slot in self._slots.items():
            units.setdefault(id(slot.flat), (slot.flat, []))[1].append(index)
        handles = []
        for flat, indices in units.values():
            if self.per_micro_batch:
                handles.append(flat.register_hook(self._micro_batch_parts(indices)))
            else:
                handles.append(flat.register_post_accumulate_grad_hook(self._accumulated_parts(indices)))
        return handles

    def _accumulated_parts(self, indices: list[int]) -> Callable[[torch.Tensor], None]:
        def hook(flat: torch.Tensor) -> None:
            if self.collect:
                for index in indices:
                    self.on_accumulated(index, flat)

        return hook

    def _micro_batch_parts(self, indices: list[int]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.collect:
                try:
                    parts = [(index, self._part(index, grad)) for index in indices]
                except Exception as exc:
                    self.collect = False
                    self.on_error("grad_unreduced", exc)
                    return
                for index, part in parts:
                    self.on_micro_batch(index, part)

        return hook

    def _part(self, index: int, flat_grad: torch.Tensor) -> torch.Tensor:
        slot = self._slots[index]
        return flat_grad.narrow(0, slot.unsharded_offset, slot.numel)

    def accumulated(self, index: int, param: torch.Tensor) -> torch.Tensor | None:
        grad = param.grad
        return None if grad is None else self._part(index, grad)

    def _reduces_now(self, index: int, param: torch.Tensor) -> bool:
        unit = self._slots[index].unit
        return unit is not None and fsdp1_reduces_gradients(unit)


def flat_units(chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """The FSDP1 units of the chunks (none where torch has no distributed support)."""
    if not torch.distributed.is_available():
        return []
    return [unit for chunk in chunks for unit in fsdp1_units(chunk)]


def fsdp1_wrapper_of(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The FullyShardedDataParallel module whose ``.module`` is ``chunk`` (a trainer, or the user,
    handed over the inner module), found among the process's live objects once at attach where
    FSDP1 is in use; None otherwise. Through the inner module the root unit's parameters are
    views of this rank's shard (empty on some ranks), which only the wrapper maps."""
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    cls = getattr(fsdp, "FullyShardedDataParallel", None)
    if cls is None or isinstance(chunk, cls) or not torch.distributed.is_initialized():
        return None
    try:
        return next((w for w, inner in live_wrappers(cls, "_fsdp_wrapped_module") if inner is chunk), None)
    except Exception:
        return None
