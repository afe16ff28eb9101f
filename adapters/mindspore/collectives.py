"""Statistics of MindSpore collective primitives (cc_distribution), per step, as the torch adapter's.

A CollectiveMonitor subscribes to the per-instance wrappers of ``cc_wrap`` (AllReduce, AllGather
and Broadcast: the collectives with CPU kernels; MindSpore has no CPU ReduceScatter) and, on
collected steps, reduces the tensors of every call to a few float64 numbers right away: the
inputs before the call (``cc_pre_hook``) and the outputs after it. A PyNative primitive call
returns its result, so every call is measured when it returns; calls of steps that are not
collected are not measured at all.

Rows and values are the torch adapter's (``monitor.collectives.totals``): ``{op}.{pre|post}_{k}`` under
the prefix ``comm``, where k counts the tensor-like arguments (pre) or outputs (post) and a
tuple of tensors (Broadcast's) is one of them, merged exactly over the step's calls, with a
``calls`` column, and with ``cc_codeline`` ``@{file}[{line}]`` of the call site. Op names are
the primitives' (``AllReduce``). Each call costs one batched StatEngine call and one host copy
of its result.

``cc_log_only`` measures nothing: every distinct (op, call stack) is logged once with dtypes,
shapes and group size, and the first optimizer call raises ``CollectivesLogged`` after its update.
What both adapters share (listening, cc_log_only, cc_codeline, row labels) is ``monitor.collectives.base``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np
from mindspore.communication import get_group_size

import adapters
import monitor
from adapters.mindspore.cc_wrap import REGISTRY, PrimitiveCall
from adapters.mindspore.stats import StatEngine
from monitor.collectives.base import CollectiveMonitorBase
from monitor.collectives.callsites import CallSites
from monitor.collectives.totals import StepTotals
from monitor.config.schema import MonitorConfig
from monitor.record import RowSet

logger = logging.getLogger("trainmon")

#: dtypes whose statistics are taken; tensors of other dtypes are left out of a call.
MEASURABLE = frozenset(
    {ms.float16, ms.bfloat16, ms.float32, ms.float64, ms.uint8, ms.int8, ms.int16, ms.int32, ms.int64}
)

Groups = list[tuple[int, list[ms.Tensor]]]

#: frames left out of call stacks: trainmon's own, MindSpore's Cell call chain, process helpers.
_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(p.__file__)) + os.sep for p in (adapters, monitor))
_SKIP_PATTERN = r"mindspore[/\\]nn[/\\]cell\.py$|[/\\](multiprocessing|debugpy)[/\\]"


def tensor_groups(values: tuple, skipped: set) -> Groups:
    """``(k, tensors)`` per tensor-like value (a Tensor, or a tuple/list of Tensors); k counts them.

    Tensors of dtypes outside MEASURABLE are left out (their dtypes are added to ``skipped``).
    """
    groups = []
    for value in values:
        if isinstance(value, ms.Tensor):
            tensors = [value]
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, ms.Tensor) for v in value):
            tensors = list(value)
        else:
            continue
        usable = [t for t in tensors if t.dtype in MEASURABLE]
        if len(usable) < len(tensors):
            skipped.update(t.dtype for t in tensors if t.dtype not in MEASURABLE)
        groups.append((len(groups), usable))
    return groups


class CollectiveMonitor(CollectiveMonitorBase):
    """Per-step statistics of the collective primitives of one TrainerMon.

    Args:
        config: the validated config (``cc_distribution``, ``ops``, ``eps``).
        on_error: called once as ``on_error("comm", exc)`` when measuring fails; measuring then
            stops while the collectives go on.
    """

    def __init__(self, config: MonitorConfig, on_error: Callable[[str, BaseException], None]) -> None:
        sites = functools.partial(CallSites, skip_dirs=_SKIP_DIRS, skip_pattern=_SKIP_PATTERN)
        super().__init__(config, REGISTRY, sites, on_error)
        self._engine = StatEngine(self._stat_ops, config.eps)
        self._steps_begun = 0
        self._totals = StepTotals()
        self._skipped: set = set()

    # -- the contract with the collection ----------------------------------------------------

    def renumber(self, step: int, collect: bool) -> None:
        self._steps_begun -= 1  # the same step begun again: the rescan still waits for the second
        super().renumber(step, collect)

    def begin_step(self, step: int, collect: bool) -> None:
        """Before a step's forward: measure its calls only when ``collect``.

        At the second step after install, primitives the training loop created since are wrapped.

        Raises:
            CollectivesLogged: with cc_log_only, at the first step after the one it started in.
        """
        self._check_log_only(step)
        if self._installed and self._steps_begun == 1:
            try:
                REGISTRY.rescan()
            except Exception as exc:
                self._fail(exc)
        self._steps_begun += 1
        self._collect = collect
        self._totals = StepTotals()
        self._update_listening()

    def take(self, rank: int) -> list[tuple[RowSet, tuple[str, ...], np.ndarray]]:
        """The step's aggregated rows (rows, ops incl. "calls", values rows x ops); clears them."""
        totals, self._totals = self._totals, StepTotals()
        if not len(totals):
            return []
        return [(self._rowset(totals.keys(), rank), self.out_ops, totals.values(self._ops))]

    # -- called by the wrappers (never raise) ------------------------------------------------

    def _start(self, call: PrimitiveCall, site: str | None) -> tuple[str, str | None]:
        if self._pre:
            self._measure(call.name, site, "pre", call.args)
        return call.name, site

    def after(self, token: tuple[str, str | None], result: Any) -> None:
        """After the original returned: measure its outputs."""
        try:
            self._measure(*token, "post", (result,))
        except Exception as exc:
            self._fail(exc)

    def _forget_steps(self) -> None:
        self._totals = StepTotals()

    # -- measuring ---------------------------------------------------------------------------

    def _measure(self, name: str, site: str | None, phase: str, values: tuple) -> None:
        """Statistics of every tensor of the call (one host copy), merged into the step's rows."""
        known = len(self._skipped)
        groups = tensor_groups(values, self._skipped)
        if len(self._skipped) > known:
            logger.info(
                "trainmon: %s: tensors of dtype %s are not measured",
                name,
                ", ".join(sorted(str(d) for d in self._skipped)),
            )
        if not groups:
            return
        flat = [t for _, tensors in groups for t in tensors]
        stats = self._engine.matrix(flat).asnumpy() if flat else np.empty((0, len(self._stat_ops)))
        numel = np.array([float(np.prod(t.shape)) for t in flat], dtype=np.float64)
        for k, part in self._summaries(groups, stats, numel):
            self._totals.add((name, phase, k, site), part)

    # -- cc_log_only -------------------------------------------------------------------------

    def _describe(self, call: PrimitiveCall) -> tuple[int, str]:
        try:
            size = get_group_size(call.primitive.group)
        except Exception:
            size = -1
        tensors = [t for _, group in tensor_groups(call.args, set()) for t in group]
        return size, ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors) or "no tensors"
