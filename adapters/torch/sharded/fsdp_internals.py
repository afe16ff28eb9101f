"""The only reads of FSDP's private state, in one place, checked against the torch versions they
were written for.

- FSDP2's module class lives where torch 2.5 kept it before making it public: ``fsdp2_module_type``.
- FSDP2 keeps the fp32 gradient sum of micro-batches run without gradient sync (mixed
  precision) in its own per-parameter record, not in ``.grad``: ``fsdp2_records``,
  ``fsdp2_pending_gradient``.
- Whether a backward's gradients are reduce-scattered now (gradient sync on) is FSDP2's
  parameter group's ``reduce_grads`` and FSDP1's ``_sync_gradients``: ``fsdp2_reduces_gradients``,
  ``fsdp1_reduces_gradients``.
- FSDP1 (``FullyShardedDataParallel``) flattens each unit's parameters into one FlatParameter
  and shards that; where each original parameter lies in it, in the unsharded flat gradient and
  in this rank's shard, is only in the FlatParameter's metadata: ``flat_layout``. (With
  ``use_orig_params=False`` the original parameters do not exist at all.)

Each reader raises ``FsdpInternalsChanged`` when torch changed what it reads; the callers warn
once and leave the affected rows out. ``check_version`` warns once on a torch outside the tested
range.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("trainmon")

#: torch versions these readers are tested on (inclusive): 2.13; older versions warn once, since
#: the private state they read may differ there (each reader still checks what it finds).
TESTED = ((2, 13), (2, 13))

_warned_version = False


class FsdpInternalsChanged(RuntimeError):
    """The installed torch keeps FSDP's state elsewhere than these readers expect."""


def check_version() -> None:
    """Warn once where torch is outside the versions these readers are tested on."""
    global _warned_version
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if TESTED[0] <= (major, minor) <= TESTED[1] or _warned_version:
        return
    _warned_version = True
    logger.warning(
        "trainmon: FSDP: torch %s is outside the versions trainmon's FSDP support is tested on "
        "(%d.%d to %d.%d); if FSDP's internals changed, the affected rows are left out and said so",
        torch.__version__,
        *TESTED[0],
        *TESTED[1],
    )


def fsdp2_module_type() -> type | None:
    """FSDP2's module class: public from torch 2.6, under ``_composable.fsdp`` in 2.5; None in a
    torch built without distributed support."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def fsdp2_group(module: torch.nn.Module) -> Any:
    """FSDP2's parameter group of ``module`` (shared by the modules of one ``fully_shard`` call),
    or None for a module without parameters of its own."""
    try:
        return module._get_fsdp_state()._fsdp_param_group
    except AttributeError as exc:
        raise FsdpInternalsChanged(str(exc)) from exc


def fsdp2_records(group: Any) -> dict[int, Any]:
    """id(unsharded parameter) -> FSDP2's record of it (``unsharded_accumulated_grad``), for the
    parameter group ``fsdp2_group`` gave."""
    if group is None:
        return {}
    try:
        records = {id(p.unsharded_param): p for p in group.fsdp_params if hasattr(p, "_unsharded_param")}
    except AttributeError as exc:
        raise FsdpInternalsChanged(str(exc)) from exc
    if any(not hasattr(record, "unsharded_accumulated_grad") for record in records.values()):
        raise FsdpInternalsChanged("FSDPParam has no unsharded_accumulated_grad")
    return records


def fsdp2_pending_gradient(record: Any) -> torch.Tensor | None:
    """What FSDP2 accumulated in fp32 for one parameter (its ``fsdp2_records`` entry) over the
    micro-batches run without gradient sync under mixed precision; None when nothing is pending."""
    return record.unsharded_accumulated_grad


def fsdp2_reduces_gradients(module: torch.nn.Module) -> bool:
    """Whether FSDP2 reduce-scatters (and frees) the unsharded gradients of ``module``'s backward
    now running: gradient sync on (``set_requires_gradient_sync``)."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        return True if group is None else bool(group.reduce_grads)
    except AttributeError as exc:
        raise FsdpInternalsChanged(str(exc)) from exc


def fsdp1_reduces_gradients(unit: Any) -> bool:
    """Whether FSDP1 reduce-scatters the unit's flat gradient after this backward: not inside
    ``no_sync()``."""
    try:
        return bool(unit._sync_gradients)
    except AttributeError as exc:
        raise FsdpInternalsChanged(str(exc)) from exc


@dataclass(frozen=True)
class FlatSlot:
    """Where one original parameter of an FSDP1 unit lies."""

    flat: torch.nn.Parameter  # the unit's FlatParameter
    fqn: str  # the parameter's name inside the unit
    numel: int  # elements of the whole parameter
    unsharded_offset: int  # offset in the unsharded flat parameter (and its gradient)
    shard_offset: int  # offset of this rank's piece in the local shard
    shard_numel: int  # elements of this rank's piece (0: none here)
    original: torch.nn.Parameter | None  # the parameter object (use_orig_params=True), else None
    unit: Any = None  # the FSDP1 instance whose FlatParameter holds it
    shape: tuple[int, ...] = ()  # the whole parameter's shape
    piece_start: int = 0  # where this rank's piece starts in the parameter, row-major


def fsdp1_units(chunk: torch.nn.Module) -> list[Any]:
    """The FSDP1 instances in ``chunk`` that hold a FlatParameter."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [
        module
        for module in chunk.modules()
        if isinstance(module, FullyShardedDataParallel) and getattr(module, "_handle", None) is not None
    ]


def flat_layout(unit: Any) -> list[FlatSlot]:
    """The original parameters of one FSDP1 unit, in flattening order."""
    try:
        flat = unit._handle.flat_param
        originals = list(flat._params or ())
        starts, offset = [], 0
        for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
            if not padding:
                starts.append(offset)
            offset += numel
        slots = []
        shapes = list(flat._shapes)
        for i, (fqn, numel, info) in enumerate(zip(flat._fqns, flat._numels, flat._shard_param_infos)):
            slots.append(
                FlatSlot(
                    flat=flat,
                    fqn=fqn,
                    numel=int(numel),
                    unsharded_offset=starts[i],
                    shard_offset=int(info.offset_in_shard) if info.in_shard else 0,
                    shard_numel=int(info.numel_in_shard) if info.in_shard else 0,
                    original=originals[i] if originals else None,
                    unit=unit,
                    shape=tuple(int(n) for n in shapes[i]),
                    piece_start=int(info.intra_param_start_idx) if info.in_shard else 0,
                )
            )
        return slots
    except (AttributeError, IndexError, TypeError) as exc:
        raise FsdpInternalsChanged(str(exc)) from exc
