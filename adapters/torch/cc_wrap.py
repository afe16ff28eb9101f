"""Reversible wrapping of the public torch.distributed collectives, shared by every monitor.

One process-wide ``REGISTRY`` owns the wrappers. The first subscriber wraps, the last one to
leave restores the original functions (the very same objects); monitors in between only
subscribe, so two monitors never wrap each other's wrappers. Only module attributes are
replaced: the public collectives on ``torch.distributed`` and on
``torch.distributed.distributed_c10d`` (the module whose functions call each other by global
name), and the functional collectives on ``torch.distributed._functional_collectives``, through
which DTensor (tensor parallelism) communicates; ``Work.wait`` and every other part of
torch.distributed are left alone.

A wrapper (built by ``monitor.collectives.registry``) always calls the original with the caller's
arguments and returns its result unchanged. A call made while another wrapped call runs on the
same thread (``send`` calls ``isend``, ``all_gather_into_tensor`` calls ``all_gather_single``,
``batch_isend_irecv`` calls ``isend``/``irecv``) goes straight to the original, so each user
call is seen once, under the name the user called.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from monitor.collectives.registry import WrapperRegistry

logger = logging.getLogger("trainmon")

#: the collectives msprobe wraps, plus the newer single-tensor names of torch >= 2.13;
#: missing names are skipped.
COLLECTIVES = (
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "broadcast",
    "all_reduce",
    "reduce",
    "scatter",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather",
    "gather",
    "_all_gather_base",
    "all_gather_into_tensor",
    "all_gather_single",
)

#: torch's functional collectives, which DTensor (tensor parallelism, redistributions) calls:
#: they leave their input alone and return the result, a tensor waited for at its first use.
#: Recorded as ``functional_{name}``, the result as ``post_0``.
FUNCTIONAL = (
    "broadcast",
    "all_reduce",
    "all_gather_single",
    "all_gather_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
)
FUNCTIONAL_PREFIX = "functional_"

_MISSING = object()


def _tensors_of(value: Any) -> list[torch.Tensor] | None:
    """The tensors of a tensor-like argument (tensor, list of tensors, list of P2POp), else None."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, torch.Tensor) for v in value):
            return list(value)
        if all(isinstance(v, dist.P2POp) for v in value):
            return [op.tensor for op in value]
    return None


#: dtypes whose statistics are taken (complex ones as real pairs); others are left out of a call.
MEASURABLE = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    | {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.complex64, torch.complex128}
)


def measurable(t: torch.Tensor) -> torch.Tensor | None:
    """A detached view whose statistics can be taken, or None (float8, bool, unsigned > 8 bit, meta)."""
    if t.dtype not in MEASURABLE or t.device.type == "meta":
        return None
    t = t.detach()
    return torch.view_as_real(t) if t.is_complex() else t


class CallInfo:
    """One call of a wrapped collective; argument views are computed on first use."""

    __slots__ = ("_groups", "args", "kwargs", "name", "params", "skipped")

    def __init__(self, name: str, params: tuple[str, ...], args: tuple, kwargs: dict) -> None:
        self.name, self.params, self.args, self.kwargs = name, params, args, kwargs
        self._groups: list[tuple[int, list[torch.Tensor]]] | None = None
        #: dtypes of tensors left out because their statistics cannot be taken.
        self.skipped: set[torch.dtype] = set()

    def values(self) -> list[Any]:
        """Arguments in the function's parameter order (however they were passed)."""
        out = list(self.args[: len(self.params)])
        out += [self.kwargs.get(p, _MISSING) for p in self.params[len(out) :]]
        out += self.args[len(self.params) :]
        out += [v for k, v in self.kwargs.items() if k not in self.params]
        return [v for v in out if v is not _MISSING]

    def tensor_groups(self) -> list[tuple[int, list[torch.Tensor]]]:
        """``(k, tensors)`` per tensor-like argument; k counts tensor-like arguments in order.

        Tensors whose statistics cannot be taken are left out (an argument may end up empty).
        """
        if self._groups is None:
            groups = []
            for value in self.values():
                tensors = _tensors_of(value)
                if tensors is not None:
                    usable = [m for m in map(measurable, tensors) if m is not None]
                    if len(usable) < len(tensors):
                        self.skipped.update(t.dtype for t in tensors if t.dtype not in MEASURABLE)
                    groups.append((len(groups), usable))
            self._groups = groups
        return self._groups

    @property
    def functional(self) -> bool:
        """A functional collective: its result, not its arguments, holds what it produced."""
        return self.name.startswith(FUNCTIONAL_PREFIX)

    def group_size(self) -> int:
        """Size of the process group the call runs on (-1 when it cannot be told)."""
        try:
            values = dict(zip(self.params, self.args))
            values.update(self.kwargs)
            group = values.get("group")
            ops = values.get("p2p_op_list")
            if group is None and ops:
                group = ops[0].group
            return dist.get_world_size(group)
        except Exception:
            return -1


class WrapRegistry(WrapperRegistry):
    """The wrappers of the torch.distributed collectives: subscribe wraps, the last unsubscribe restores."""

    def __init__(self) -> None:
        super().__init__()
        #: (module, name, original, wrapper) of every replaced attribute.
        self._patched: list[tuple[Any, str, Callable, Callable]] = []

    @property
    def wrapped(self) -> list[str]:
        """Names of the wrapped functions (empty when nothing is wrapped)."""
        functional = _functional_module()
        return list(
            dict.fromkeys(
                FUNCTIONAL_PREFIX + name if module is functional else name
                for module, name, _, _ in self._patched
            )
        )

    def _wrap(self) -> None:
        if not dist.is_available():
            logger.warning("trainmon: torch.distributed is not available; collectives are not monitored")
            return
        c10d = dist.distributed_c10d
        wrappers: dict[int, Callable] = {}
        for name in COLLECTIVES:
            for module in (c10d, dist):
                original = getattr(module, name, None)
                if not callable(original):
                    continue
                wrapper = wrappers.get(id(original))
                if wrapper is None:
                    wrapper = wrappers[id(original)] = self._wrapper(name, original)
                setattr(module, name, wrapper)
                self._patched.append((module, name, original, wrapper))
        functional = _functional_module()
        for name in FUNCTIONAL if functional is not None else ():
            original = getattr(functional, name, None)
            if callable(original):
                wrapper = self._functional_wrapper(name, original)
                setattr(functional, name, wrapper)
                self._patched.append((functional, name, original, wrapper))
        logger.info(
            "trainmon: wrapped %d torch.distributed collectives: %s",
            len(self.wrapped),
            ", ".join(self.wrapped),
        )

    def _restore(self) -> None:
        kept = []
        for module, name, original, wrapper in self._patched:
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
            else:
                kept.append(f"{module.__name__}.{name}")
        if kept:
            logger.warning(
                "trainmon: %s were replaced again by other code after trainmon wrapped them; they are left "
                "as they are (trainmon's wrappers inside them only pass calls through)",
                ", ".join(kept),
            )
        self._patched = []

    def _wrapper(self, name: str, original: Callable) -> Callable:
        try:
            params = tuple(inspect.signature(original).parameters)
        except (TypeError, ValueError):
            params = ()
        return functools.wraps(original)(self.observed(original, functools.partial(CallInfo, name, params)))

    def _functional_wrapper(self, name: str, original: Callable) -> Callable:
        """A functional collective's wrapper; while torch.compile traces, the original alone (the
        compiled graph holds the collective; nothing of ours is traced into it)."""
        observed = self._wrapper(FUNCTIONAL_PREFIX + name, original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return original(*args, **kwargs)
            return observed(*args, **kwargs)

        return wrapper


def _functional_module() -> Any:
    """torch's functional collectives module, or None where this torch has none."""
    try:
        return importlib.import_module("torch.distributed._functional_collectives")
    except ImportError:
        return None


#: the one registry of this process.
REGISTRY = WrapRegistry()
