"""Statistics of MindSpore collective primitives (cc_distribution), per step, as the torch adapter's.

A CollectiveMonitor subscribes to the per-instance wrappers of ``cc_wrap`` (AllReduce, AllGather
and Broadcast: the collectives with CPU kernels; MindSpore has no CPU ReduceScatter) and, on
collected steps, reduces the tensors of every call to a few float64 numbers right away: the
inputs before the call (``cc_pre_hook``) and the outputs after it. A PyNative primitive call
returns its result, so every call is measured when it returns; calls of steps that are not
collected are not measured at all.

Rows and values are the torch adapter's (``monitor.cc_totals``): ``{op}.{pre|post}_{k}`` under
the prefix ``comm``, where k counts the tensor-like arguments (pre) or outputs (post) and a
tuple of tensors (Broadcast's) is one of them, merged exactly over the step's calls, with a
``calls`` column, and with ``cc_codeline`` ``@{file}[{line}]`` of the call site. Op names are
the primitives' (``AllReduce``). Each call costs one batched StatEngine call and one host copy
of its result.

``cc_log_only`` measures nothing: every distinct (op, call stack) is logged once with dtypes,
shapes and group size, and the first optimizer call raises ``CollectivesLogged`` after its update.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np
from mindspore.communication import get_group_size

import adapters
import monitor
from adapters.mindspore.cc_wrap import REGISTRY
from adapters.mindspore.stats import StatEngine
from monitor.callsites import CallSites
from monitor.cc_totals import StepTotals, row_name, stat_ops_for, summarise
from monitor.config import MonitorConfig
from monitor.errors import CollectivesLogged
from monitor.record import RowSet

logger = logging.getLogger("trainmon")

#: what the rows of this monitor are submitted as.
TASK = "comm"
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


class CollectiveMonitor:
    """Per-step statistics of the collective primitives of one TrainerMon.

    Args:
        config: the validated config (``cc_distribution``, ``ops``, ``eps``).
        on_error: called once as ``on_error("comm", exc)`` when measuring fails; measuring then
            stops while the collectives go on.
    """

    def __init__(self, config: MonitorConfig, on_error: Callable[[str, BaseException], None]) -> None:
        cc = config.cc_distribution
        self.on_error = on_error
        self.out_ops: tuple[str, ...] = (*config.ops, "calls")
        self._ops = tuple(config.ops)
        self._stat_ops = stat_ops_for(self._ops)
        self._engine = StatEngine(self._stat_ops, config.eps)
        self._pre = cc.cc_pre_hook
        self._log_only = cc.cc_log_only
        self._filtered = bool(cc.cc_codeline)
        self._sites = None
        if self._filtered or self._log_only:
            self._sites = CallSites(cc.cc_codeline, _SKIP_DIRS, _SKIP_PATTERN)
        #: read by the wrappers on every call: False makes a call cost one attribute check.
        self.listening = False
        self._installed = False
        self._failed = False
        self._collect = False
        self._steps_begun = 0
        self._first_step: int | None = None
        self._logged: set[tuple[str, str]] = set()
        self._totals = StepTotals()
        self._skipped: set = set()
        self._rows: tuple[tuple, int, RowSet] | None = None

    # -- the contract with the collection ----------------------------------------------------

    def install(self) -> None:
        """Subscribe to the wrappers (the first subscriber in the process wraps); idempotent."""
        if not self._installed:
            self._installed = True
            REGISTRY.subscribe(self)
            self._update_listening()

    def remove(self) -> None:
        """Unsubscribe (the last subscriber gives the primitives their own class back); idempotent."""
        if self._installed:
            self._installed = False
            self.listening = False
            REGISTRY.unsubscribe(self)
            self._totals = StepTotals()

    def begin_step(self, step: int, collect: bool) -> None:
        """Before a step's forward: measure its calls only when ``collect``.

        At the second step after install, primitives the training loop created since are wrapped.

        Raises:
            CollectivesLogged: with cc_log_only, at the first step after the one it started in.
        """
        if self._log_only and self._installed:
            if self._first_step is None:
                self._first_step = step
            elif step != self._first_step:
                raise CollectivesLogged(
                    f"cc_log_only: {len(self._logged)} distinct collective calls were logged during step "
                    f"{self._first_step}; the run stops here as configured"
                )
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

    def before(self, primitive: Any, name: str, args: tuple) -> tuple[str, str | None] | None:
        """Before the original runs: filter, log or measure the inputs; a token for ``after``."""
        try:
            site = None
            if self._sites is not None:
                frames = self._sites.frames()
                if self._log_only:
                    self._log_call(primitive, name, args, frames)
                    return None
                site = self._sites.site(frames) if self._filtered else None
                if self._filtered and site is None:
                    return None
            if self._pre:
                self._measure(name, site, "pre", args)
            return name, site
        except Exception as exc:
            self._fail(exc)
            return None

    def after(self, token: tuple[str, str | None], result: Any) -> None:
        """After the original returned: measure its outputs."""
        try:
            self._measure(*token, "post", (result,))
        except Exception as exc:
            self._fail(exc)

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
        start = 0
        for k, tensors in groups:
            end = start + len(tensors)
            if end > start:
                part = summarise(stats[start:end], numel[start:end], self._stat_ops)
                self._totals.add((name, phase, k, site), part)
            start = end

    def _rowset(self, keys: tuple, rank: int) -> RowSet:
        """Row labels for the step's keys, reused while the keys stay the same."""
        if self._rows is None or self._rows[0] != keys or self._rows[1] != rank:
            names = [row_name(*key) for key in keys]
            self._rows = (keys, rank, RowSet.build([0] * len(names), names, rank, TASK))
        return self._rows[2]

    def _log_call(self, primitive: Any, name: str, args: tuple, frames: tuple) -> None:
        stack = self._sites.stack(frames)
        if (name, stack) in self._logged:
            return
        self._logged.add((name, stack))
        try:
            size = get_group_size(primitive.group)
        except Exception:
            size = -1
        tensors = [t for _, group in tensor_groups(args, set()) for t in group]
        logger.info(
            "trainmon: collective %s (group size %d; %s) called from:\n  %s",
            name,
            size,
            ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors) or "no tensors",
            "\n  ".join(self._sites.render(f) for f in frames) or "?",
        )

    def _update_listening(self) -> None:
        self.listening = self._installed and not self._failed and (self._collect or self._log_only)

    def _fail(self, exc: BaseException) -> None:
        """Stop measuring after a failure of our own code; report it once."""
        if not self._failed:
            self._failed = True
            self.listening = False
            self.on_error(TASK, exc)
