"""Statistics of torch.distributed collectives (cc_distribution), per step and call site.

A CollectiveMonitor subscribes to the process-wide wrappers of ``cc_wrap`` and, on collected
steps, reduces the tensors of every collective call to a few float64 numbers right away: the
inputs before the call (``cc_pre_hook``) and the outputs after it. Synchronous calls are
measured when they return; asynchronous ones (``async_op=True``, ``isend``/``irecv``,
``batch_isend_irecv``) when their work completes, through ``work.get_future().then(...)``.
Works without a future (gloo's point-to-point works) are measured as soon as ``is_completed()``
says so, checked at the next collective call and at the end of the step. At most
``MAX_PENDING`` asynchronous calls are followed at once; beyond that they are counted and
dropped with one warning.

A functional collective (DTensor's: ``functional_{name}`` rows) leaves its input alone and
returns its result as a tensor waited for at its first use; on a collected step that result is
waited for when the call returns and measured as ``post_0``.

Each call belongs to the step in which it was issued. A call issued in a step that is not
collected is not measured at all; an asynchronous call of a collected step that completes only
after that step was written is dropped and counted (one warning), never folded into a later step.

Rows: ``{op}.{pre|post}_{k}`` (k: index of the tensor-like argument; a list of tensors or of
P2POps is one argument, its statistics taken over all its tensors together), with
``@{file}[{line}]`` of the matching call site appended when ``cc_codeline`` is set; the merge
rules are in ``monitor.collectives.totals``. Each call costs one stat_matrix and one host copy of its
result; on an accelerator that copy is started without a wait and its rows are merged at the end of
the step, so that measuring never makes the training thread wait for the device.

``cc_log_only`` measures nothing: every distinct (op, call stack) is logged once with dtypes,
shapes and group size, and the first optimizer step raises ``CollectivesLogged``.
What both adapters share (listening, cc_log_only, cc_codeline, row labels) is ``monitor.collectives.base``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adapters.torch.cc_callsite import CallSites
from adapters.torch.cc_wrap import REGISTRY, CallInfo, measurable
from adapters.torch.stats import stat_matrix, to_host
from monitor.collectives.base import CollectiveMonitorBase
from monitor.collectives.totals import StepTotals
from monitor.config.schema import MonitorConfig
from monitor.record import RowSet

logger = logging.getLogger("trainmon")

#: asynchronous calls followed at once per monitor; further ones are dropped (and counted).
MAX_PENDING = 1024

Groups = list[tuple[int, list[torch.Tensor]]]


class _Call:
    """A measured call in flight: its step, row key parts and tensors."""

    __slots__ = ("functional", "groups", "name", "site", "step")

    def __init__(self, step: int, name: str, site: str | None, groups: Groups, functional: bool) -> None:
        self.step, self.name, self.site, self.groups = step, name, site, groups
        self.functional = functional


def _result_groups(result: Any) -> Groups:
    """A functional collective's result as the one tensor-like argument ``post_0`` measures; a
    result still in flight (an AsyncCollectiveTensor) is waited for as its first use would."""
    tensors = list(result) if isinstance(result, (list, tuple)) else [result]
    waited = [t.trigger_wait() if hasattr(t, "trigger_wait") else t for t in tensors]
    usable = [measurable(t) for t in waited if isinstance(t, torch.Tensor)]
    return [(0, [t for t in usable if t is not None])]


def _works(result: Any) -> list | None:
    """The Work handles of an asynchronous call's result, or None for a synchronous call."""
    if isinstance(result, dist.Work):
        return [result]
    if isinstance(result, list) and result and all(isinstance(w, dist.Work) for w in result):
        return result
    return None


def _describe_groups(groups: Groups) -> str:
    """Dtypes and shapes of a call's tensors, per argument (the first four of each)."""
    parts = []
    for k, tensors in groups:
        shapes = ", ".join(f"{t.dtype}{list(t.shape)}".replace("torch.", "") for t in tensors[:4])
        more = f", ... ({len(tensors)} tensors)" if len(tensors) > 4 else ""
        parts.append(f"arg {k}: {shapes}{more}")
    return "; ".join(parts) or "no tensors"


class CollectiveMonitor(CollectiveMonitorBase):
    """Per-step statistics of the collectives of one TrainerMon.

    Args:
        config: the validated config (``cc_distribution``, ``ops``, ``eps``).
        on_error: called once as ``on_error("comm", exc)`` when measuring fails; measuring then
            stops while the collectives go on. Without it the failure is logged. The session
            may set the attribute later.
    """

    def __init__(
        self, config: MonitorConfig, on_error: Callable[[str, BaseException], None] | None = None
    ) -> None:
        super().__init__(config, REGISTRY, CallSites, on_error)
        self._eps = config.eps
        self._step = 0
        self._totals: dict[int, StepTotals] = {}
        #: step -> accelerator calls whose statistics are on their way to the host, in call order
        self._copying: dict[int, list[tuple]] = {}
        self._closed_below = 0  # completions of steps below this are late
        self._pending = 0
        self._polled: list[tuple[_Call, list]] = []
        self._counts = {"late": 0, "dropped": 0}
        self._skipped: set[torch.dtype] = set()

    # -- the contract with the session -------------------------------------------------------

    def begin_step(self, step: int, collect: bool) -> None:
        """Before a step's forward: attribute calls to ``step``; measure them only when ``collect``.

        Raises:
            CollectivesLogged: with cc_log_only, at the first step after the one it started in.
        """
        self._check_log_only(step)
        with self._lock:
            self._step, self._collect = step, collect
            self._closed_below = max(self._closed_below, step)
            for old in [s for s in self._totals if s < step]:
                del self._totals[old]
            for old in [s for s in self._copying if s < step]:
                del self._copying[old]
        self._update_listening()

    def take(self, step: int, rank: int) -> list[tuple[RowSet, tuple[str, ...], np.ndarray]]:
        """The aggregated rows of ``step`` (rows, ops incl. "calls", values rows x ops); clears them."""
        self._poll(finish=step)
        with self._lock:
            totals = self._totals.pop(step, None)
            copying = self._copying.pop(step, [])
            self._closed_below = max(self._closed_below, step + 1)
        for (name, phase, site), sizes, numel, fetch in copying:  # started long before: seldom a wait
            totals = totals if totals is not None else StepTotals()
            for k, part in self._summaries(sizes, fetch(), numel):
                totals.add((name, phase, k, site), part)
        if not totals:
            return []
        values = totals.values(self._ops)
        return [(self._rowset(totals.keys(), rank), self.out_ops, values)]

    # -- called by the wrappers (never raise) ------------------------------------------------

    def _catch_up(self) -> None:
        if self._polled:
            self._poll()

    def _start(self, call: CallInfo, site: str | None) -> _Call | None:
        groups = call.tensor_groups()
        if call.skipped - self._skipped:
            self._skipped |= call.skipped
            logger.info(
                "trainmon: %s: tensors of dtype %s are not measured",
                call.name,
                ", ".join(sorted(str(d) for d in call.skipped)),
            )
        if not groups:
            return None
        token = _Call(self._step, call.name, site, groups, call.functional)
        if self._pre:
            self._measure(token, "pre")
        return token

    def after(self, token: _Call, result: Any) -> None:
        """After the original returned: measure now (synchronous) or when the work completes."""
        try:
            if token.functional:  # what it produced is its result, waited for now
                token.groups = _result_groups(result)
                if token.groups[0][1]:
                    self._measure(token, "post")
                return
            works = _works(result)
            if works is None:
                self._measure(token, "post")
            else:
                self._follow(token, works)
        except Exception as exc:
            self._fail(exc)

    def _forget_steps(self) -> None:
        with self._lock:
            self._totals.clear()
            self._copying.clear()
            self._polled.clear()

    # -- measuring ---------------------------------------------------------------------------

    def _measure(self, token: _Call, phase: str) -> None:
        """Statistics of every tensor of the call (one host copy), merged into the step's rows;
        on an accelerator the copy is started and the merge waits for the step's end (``take``)."""
        flat = [t for _, tensors in token.groups for t in tensors]
        stats, fetch = to_host(stat_matrix(flat, self._stat_ops, self._eps)) if flat else (None, None)
        numel = np.fromiter((t.numel() for t in flat), dtype=np.float64, count=len(flat))
        if fetch is not None:
            sizes = [(k, [None] * len(tensors)) for k, tensors in token.groups]  # counts are what is used
            with self._lock:
                if token.step < self._closed_below:
                    self._late(1)
                else:
                    key = (token.name, phase, token.site)  # not the token: its tensors go now
                    self._copying.setdefault(token.step, []).append((key, sizes, numel, fetch))
            return
        parts = [
            ((token.name, phase, k, token.site), part)
            for k, part in self._summaries(token.groups, stats, numel)
        ]
        with self._lock:
            if token.step < self._closed_below:
                self._late(1)
                return
            totals = self._totals.setdefault(token.step, StepTotals())
            for key, part in parts:
                totals.add(key, part)

    def _follow(self, token: _Call, works: list) -> None:
        """Measure an asynchronous call's outputs when its works complete."""
        with self._lock:
            if self._pending + len(self._polled) >= MAX_PENDING:
                self._counts["dropped"] += 1
                if self._counts["dropped"] == 1:
                    logger.warning(
                        "trainmon: more than %d asynchronous collectives are pending; statistics of further "
                        "ones are dropped until some complete",
                        MAX_PENDING,
                    )
                return
        try:
            futures = [w.get_future() for w in works]
        except RuntimeError:  # gloo's point-to-point works have no future: poll them
            with self._lock:
                self._polled.append((token, works))
            return
        future = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
        with self._lock:
            self._pending += 1
        future.then(lambda done: self._completed(token, done))

    def _completed(self, token: _Call, future: Any) -> None:
        """Future callback (any thread): measure unless the collective failed."""
        try:
            with self._lock:
                self._pending -= 1
            future.value()  # raises if the collective failed: then there is nothing to measure
        except Exception:
            return
        if self._installed and not self._failed:
            try:
                self._measure(token, "post")
            except Exception as exc:
                self._fail(exc)

    def _poll(self, finish: int | None = None) -> None:
        """Measure polled works that completed; at the end of step ``finish`` drop its unfinished ones."""
        with self._lock:
            polled, self._polled = self._polled, []
        keep = []
        for token, works in polled:
            if all(w.is_completed() for w in works):
                self._measure(token, "post")
            elif finish is not None and token.step <= finish:
                with self._lock:
                    self._late(1)
            else:
                keep.append((token, works))
        if keep:
            with self._lock:
                self._polled = keep + self._polled

    def _late(self, n: int) -> None:
        self._counts["late"] += n
        if self._counts["late"] == n:
            logger.warning(
                "trainmon: a collective of a collected step completed after that step was written; its "
                "statistics are dropped (never counted in a later step)"
            )

    # -- cc_log_only -------------------------------------------------------------------------

    def _describe(self, call: CallInfo) -> tuple[int, str]:
        return call.group_size(), _describe_groups(call.tensor_groups())
