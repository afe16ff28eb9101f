"""Which modules' inputs and outputs are monitored, which tensors of a call count, and their row names.

Framework-free: the adapters (torch modules, MindSpore Cells) hand in names and a predicate that
tells their tensors apart, and get back the same selection and the same row names, so that the
``actv`` / ``actv_grad`` rows of every framework are spelled alike:

* ``{module}.input`` / ``{module}.output`` (``_grad`` for the gradients), with ``_0``, ``_1``, ...
  when a direction holds several tensors;
* ``{module}[k]`` for the k-th extra call of a module within one micro-step.

A call's mask arguments (``forward_mask_positions``, ``mask_ids``) are recorded but never judged: an
additive attention mask holds -inf by design.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from monitor.config.schema import MonitorConfig
from monitor.naming import (
    distinct_names,
    is_selected_exactly,
    name_candidates,
    squash_name,
    without_wrapper,
    wrapped_twins,
)

logger = logging.getLogger("trainmon")

_TUPLE_FORMAT = re.compile(r"^tuple\[(\d+)\](?::(\d+))?$")
_MAX_DEPTH = 4
_MASK_NAME = re.compile(r"(^|_)masks?$")

IsTensor = Callable[[Any], bool]


@dataclasses.dataclass(frozen=True)
class SelectedModule:
    """One module to hook: its position in the input, chunk, display name and 1.2.2 formats (if any)."""

    position: int
    vpp_stage: int
    name: str
    formats: Mapping[str, str]


def select_modules(
    named: Iterable[tuple[int, str]], config: MonitorConfig, every: bool = False
) -> list[SelectedModule]:
    """The modules among ``(vpp_stage, raw_name)`` pairs whose inputs/outputs are monitored.

    Every module with ``all_xy`` (or ``every``) or without targets, else those a targets key
    names exactly (raw, squashed or ``N:``-prefixed); a wrapper's only child, whose tensors are
    the wrapper's (``wrapped_twins``), only where a targets key names it and not the wrapper too
    (``layers.1`` names a checkpoint wrapper and, without its segment, the block inside). Names
    are made distinct within a chunk (``distinct_names``).
    """
    named = list(named)
    keys = without_wrapper(config.targets, (raw for _, raw in named))
    key_formats = dict(zip(keys, config.targets.values(), strict=True))
    twins = wrapped_twins(named)
    selected = []
    for position, (vpp, raw) in enumerate(named):
        candidates = name_candidates(vpp, raw, squash_name(raw))
        if (vpp, raw) in twins and not is_selected_exactly(keys, candidates):  # named: the user's choice
            continue
        formats: Mapping[str, str] = {}
        for key in keys:
            if key in candidates:
                formats = key_formats[key]
        if every or config.all_xy or not keys or is_selected_exactly(keys, candidates):
            selected.append(SelectedModule(position, vpp, raw, formats))
    chosen = {(module.vpp_stage, module.name) for module in selected}  # a key naming both: the wrapper's
    selected = [
        module
        for module in selected
        if (module.vpp_stage, module.name) not in twins
        or (module.vpp_stage, module.name.rpartition(".")[0]) not in chosen
    ]
    names = distinct_names([(module.vpp_stage, module.name) for module in selected], config.squash_name)
    return [dataclasses.replace(module, name=name) for module, name in zip(selected, names)]


def flatten(obj: Any, is_tensor: IsTensor, depth: int = 0) -> Iterator[Any]:
    """Every tensor in an argument or output: tuples, lists, dicts, ModelOutput-like and dataclass objects."""
    if is_tensor(obj):
        yield obj
    elif depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from flatten(item, is_tensor, depth + 1)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from flatten(item, is_tensor, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for item in dataclasses.fields(obj):
            yield from flatten(getattr(obj, item.name), is_tensor, depth + 1)


def _by_format(fmt: str, obj: Any, is_tensor: IsTensor) -> list[Any] | None:
    """The tensor a 1.2.2 format (``tensor``, ``tuple[N]``, ``tuple[N]:i``) picks; None if it does not fit."""
    if fmt.startswith("tensor"):
        if is_tensor(obj):
            return [obj]
        if isinstance(obj, tuple) and len(obj) == 1 and is_tensor(obj[0]):
            return [obj[0]]
        return None
    match = _TUPLE_FORMAT.match(fmt)
    if match and isinstance(obj, (tuple, list)) and len(obj) == int(match.group(1)):
        item = obj[int(match.group(2) or 0)]
        if is_tensor(item):
            return [item]
    return None


def direction_tensors(
    name: str,
    formats: Mapping[str, str],
    warned: set[str],
    direction: str,
    obj: Any,
    is_tensor: IsTensor,
) -> list[Any]:
    """The tensors of one direction of a call: per the module's format string if given and it fits, else all.

    A structure that does not fit its format (it changed between calls) is handled, never an
    IndexError: all tensors are taken and a warning says so once per module and direction
    (``warned`` keeps track).
    """
    fmt = formats.get(direction)
    if fmt:
        picked = _by_format(fmt, obj, is_tensor)
        if picked is not None:
            return picked
        if direction not in warned:
            warned.add(direction)
            logger.warning(
                "trainmon: %s.%s does not match its format %r; monitoring all its tensors instead",
                name,
                direction,
                fmt,
            )
    return list(flatten(obj, is_tensor))


def call_name(name: str, call: int) -> str:
    """The module name of its ``call``-th call within a micro-step: ``name``, then ``name[1]``, ..."""
    return name if call == 0 else f"{name}[{call}]"


def row_names(name: str, count: int) -> list[str]:
    """Row names of the ``count`` tensors of one direction: ``name``, or ``name_0``, ``name_1``, ..."""
    return [name] if count == 1 else [f"{name}_{i}" for i in range(count)]


def forward_mask_positions(forward: Callable) -> tuple[int, ...]:
    """Where a module's ``forward`` (a Cell's ``construct``), taken from its class, receives a
    mask positionally: a parameter named as one (``is_mask_name``). Read once at attach; () where
    the signature is unreadable."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in positional]
    return tuple(position for position, name in enumerate(names) if is_mask_name(name))


def is_mask_name(name: str) -> bool:
    """An argument named as a mask: ``mask``, ``masks`` or ending in ``_mask(s)``
    (``attention_mask``, ``src_key_padding_mask``), not ``masked_input``, which holds values."""
    return _MASK_NAME.search(name) is not None


def mask_ids(args: tuple, kwargs: dict, positions: tuple[int, ...], is_tensor: IsTensor) -> set[int]:
    """Ids of the tensors a call passes as a mask: by a keyword named as one or at one of the
    module's ``positions`` (``forward_mask_positions``). An additive attention mask holds -inf by design
    (torch's ``nn.Transformer.generate_square_subsequent_mask``), so its rows are not judged."""
    masks = {id(v) for k, v in kwargs.items() if is_mask_name(k) and is_tensor(v)} if kwargs else set()
    for position in positions:
        if position < len(args) and is_tensor(args[position]):
            masks.add(id(args[position]))
    return masks
