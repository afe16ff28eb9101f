"""The modules whose activations are recorded, and the tensors of one direction of a call."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from monitor.config.schema import MonitorConfig
from monitor.datatypes.modules import direction_tensors, forward_mask_positions, mask_ids
from monitor.datatypes.modules import select_modules as select_module_names

logger = logging.getLogger("trainmon")


#: the child a wrapper holds the model in: DDP's, DeepSpeed's and Megatron's ``module``, FSDP1's
#: and torch.compile's
_WRAPPED_CHILDREN = ("module", "_fsdp_wrapped_module", "_orig_mod")


def shown_class(chunk: torch.nn.Module) -> str:
    """The class name a model chunk's own rows (``.input``, ``.output``) are shown by: the model's
    inside its wrappers (a module whose one child has a wrapper's name), as the rows' names drop
    what wrappers add; ``DistributedDataParallel.input`` would say nothing of the model."""
    module = chunk
    while True:
        children = list(module.named_children())
        if len(children) != 1 or children[0][0] not in _WRAPPED_CHILDREN:
            return _unsharded_name(type(module))
        module = children[0][1]


def _unsharded_name(cls: type) -> str:
    """A class's name, without the ``FSDP`` that ``fully_shard`` puts before it (it makes the
    module an instance of a subclass ``FSDP<Model>`` of its own class)."""
    for base in cls.__mro__[1:]:
        if cls.__name__ == f"FSDP{base.__name__}":
            return base.__name__
    return cls.__name__


def mask_arguments(entry: HookedModule, args: tuple, kwargs: dict) -> set[int]:
    """Ids of the tensors a call passes as a mask (``monitor.datatypes.modules.mask_ids``)."""
    return mask_ids(args, kwargs, entry.mask_positions, _is_tensor)


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


@dataclasses.dataclass
class HookedModule:
    """A monitored module: its chunk, display name, and 1.2.2 per-direction formats (if any)."""

    vpp_stage: int
    name: str
    module: torch.nn.Module
    formats: Mapping[str, str]
    warned: set[str] = dataclasses.field(default_factory=set)
    #: where ``forward`` takes a mask positionally (``mask_arguments``)
    mask_positions: tuple[int, ...] = ()


def direction_tensors_of(entry: HookedModule, direction: str, obj: Any) -> list[torch.Tensor]:
    """The tensors of one direction: per the 1.2.2 format string if given and it fits, else all of them."""
    return direction_tensors(entry.name, entry.formats, entry.warned, direction, obj, _is_tensor)


def select_modules(
    chunks: Sequence[torch.nn.Module], config: MonitorConfig, every: bool
) -> list[HookedModule]:
    """Modules to hook: every submodule with all_xy (or ``every``), else those named exactly in targets."""
    named = [(vpp, raw, module) for vpp, chunk in enumerate(chunks) for raw, module in chunk.named_modules()]
    selected = [
        HookedModule(
            m.vpp_stage,
            m.name,
            named[m.position][2],
            m.formats,
            mask_positions=forward_mask_positions(type(named[m.position][2]).forward),
        )
        for m in select_module_names([(vpp, raw) for vpp, raw, _ in named], config, every)
    ]
    containers = [m.name for m in selected if type(m.module).forward is torch.nn.Module.forward]
    if containers and config.targets and not (every or config.all_xy):  # named ones only: the
        # whole model (all_xy, empty targets) takes every module, containers too
        logger.warning(
            "trainmon: targets %s: never called (a container such as ModuleList, whose modules are "
            "called one by one), so no inputs or outputs to record; name the modules inside",
            ", ".join(containers),
        )
    return selected
