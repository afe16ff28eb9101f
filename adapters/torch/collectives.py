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

Each call belongs to the step in which it was issued. A call issued in a step that is not
collected is not measured at all; an asynchronous call of a collected step that completes only
after that step was written is dropped and counted (one warning), never folded into a later step.

Rows: ``{op}.{pre|post}_{k}`` (k: index of the tensor-like argument; a list of tensors or of
P2POps is one argument, its statistics taken over all its tensors together), with
``@{file}[{line}]`` of the matching call site appended when ``cc_codeline`` is set; the merge
rules are in ``monitor.cc_totals``. Each call costs one stat_matrix and one host copy of its result.

``cc_log_only`` measures nothing: every distinct (op, call stack) is logged once with dtypes,
shapes and group size, and the first optimizer step raises ``CollectivesLogged``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adapters.torch.cc_callsite import CallSites
from adapters.torch.cc_wrap import REGISTRY, CallInfo
from adapters.torch.stats import stat_matrix
from monitor.cc_totals import StepTotals, row_name, stat_ops_for, summarise
from monitor.config import MonitorConfig
from monitor.errors import CollectivesLogged
from monitor.record import RowSet

logger = logging.getLogger("trainmon")

#: asynchronous calls followed at once per monitor; further ones are dropped (and counted).
MAX_PENDING = 1024
#: what the rows of this monitor are submitted as.
TASK = "comm"

Groups = list[tuple[int, list[torch.Tensor]]]


class _Call:
    """A measured call in flight: its step, row key parts and tensors."""

    __slots__ = ("groups", "name", "site", "step")

    def __init__(self, step: int, name: str, site: str | None, groups: Groups) -> None:
        self.step, self.name, self.site, self.groups = step, name, site, groups


def _works(result: Any) -> list | None:
    """The Work handles of an asynchronous call's result, or None for a synchronous call."""
    if isinstance(result, dist.Work):
        return [result]
    if isinstance(result, list) and result and all(isinstance(w, dist.Work) for w in result):
        return result
    return None


def _describe(groups: Groups) -> str:
    parts = []
    for k, tensors in groups:
        shapes = ", ".join(f"{t.dtype}{list(t.shape)}".replace("torch.", "") for t in tensors[:4])
        more = f", ... ({len(tensors)} tensors)" if len(tensors) > 4 else ""
        parts.append(f"arg {k}: {shapes}{more}")
    return "; ".join(parts) or "no tensors"


class CollectiveMonitor:
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
        cc = config.cc_distribution
        self.config = config
        self.on_error = on_error
        self.out_ops: tuple[str, ...] = (*config.ops, "calls")
        self._ops = tuple(config.ops)
        self._stat_ops = stat_ops_for(self._ops)
        self._eps = config.eps
        self._pre = cc.cc_pre_hook
        self._log_only = cc.cc_log_only
        self._sites = CallSites(cc.cc_codeline) if (cc.cc_codeline or cc.cc_log_only) else None
        self._filtered = bool(cc.cc_codeline)
        #: read by the wrappers on every call: False makes a call cost one attribute check.
        self.listening = False
        self._installed = False
        self._failed = False
        self._collect = False
        self._step = 0
        self._first_step: int | None = None
        self._lock = threading.Lock()
        self._totals: dict[int, StepTotals] = {}
        self._closed_below = 0  # completions of steps below this are late
        self._pending = 0
        self._polled: list[tuple[_Call, list]] = []
        self._counts = {"late": 0, "dropped": 0}
        self._logged: set[tuple[str, str]] = set()
        self._skipped: set[torch.dtype] = set()
        self._names: dict[tuple, str] = {}
        self._rows: tuple[tuple, int, RowSet] | None = None

    # -- the contract with the session -------------------------------------------------------

    def install(self) -> list[str]:
        """Subscribe to the wrappers (the first subscriber in the process wraps); idempotent."""
        if not self._installed:
            self._installed = True
            self._first_step = None
            REGISTRY.subscribe(self)
            self._update_listening()
        return REGISTRY.wrapped

    def remove(self) -> None:
        """Unsubscribe (the last subscriber restores the original functions); idempotent."""
        if self._installed:
            self._installed = False
            self.listening = False
            REGISTRY.unsubscribe(self)
            with self._lock:
                self._totals.clear()
                self._polled.clear()

    def begin_step(self, step: int, collect: bool) -> None:
        """Before a step's forward: attribute calls to ``step``; measure them only when ``collect``.

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
        with self._lock:
            self._step, self._collect = step, collect
            self._closed_below = max(self._closed_below, step)
            for old in [s for s in self._totals if s < step]:
                del self._totals[old]
        self._update_listening()

    def take(self, step: int, rank: int) -> list[tuple[RowSet, tuple[str, ...], np.ndarray]]:
        """The aggregated rows of ``step`` (rows, ops incl. "calls", values rows x ops); clears them."""
        self._poll(finish=step)
        with self._lock:
            totals = self._totals.pop(step, None)
            self._closed_below = max(self._closed_below, step + 1)
        if not totals:
            return []
        values = totals.values(self._ops)
        return [(self._rowset(totals.keys(), rank), self.out_ops, values)]

    # -- called by the wrappers (never raise) ------------------------------------------------

    def before(self, call: CallInfo) -> _Call | None:
        """Before the original runs: filter, log or measure the inputs; a token for ``after``."""
        try:
            if self._polled:
                self._poll()
            site = None
            if self._sites is not None:
                frames = self._sites.frames()
                if self._log_only:
                    self._log_call(call, frames)
                    return None
                site = self._sites.site(frames) if self._filtered else None
                if self._filtered and site is None:
                    return None
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
            token = _Call(self._step, call.name, site, groups)
            if self._pre:
                self._measure(token, "pre")
            return token
        except Exception as exc:
            self._fail(exc)
            return None

    def after(self, token: _Call, result: Any) -> None:
        """After the original returned: measure now (synchronous) or when the work completes."""
        try:
            works = _works(result)
            if works is None:
                self._measure(token, "post")
            else:
                self._follow(token, works)
        except Exception as exc:
            self._fail(exc)

    # -- measuring ---------------------------------------------------------------------------

    def _measure(self, token: _Call, phase: str) -> None:
        """Statistics of every tensor of the call (one host copy), merged into the step's rows."""
        flat = [t for _, tensors in token.groups for t in tensors]
        stats = stat_matrix(flat, self._stat_ops, self._eps).cpu().numpy() if flat else None
        numel = np.fromiter((t.numel() for t in flat), dtype=np.float64, count=len(flat))
        parts, start = [], 0
        for k, tensors in token.groups:
            end = start + len(tensors)
            if end > start:
                key = (token.name, phase, k, token.site)
                parts.append((key, summarise(stats[start:end], numel[start:end], self._stat_ops)))
            start = end
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

    # -- rows, logging, failures -------------------------------------------------------------

    def _rowset(self, keys: tuple, rank: int) -> RowSet:
        """Row labels for the step's keys, reused while the keys stay the same."""
        if self._rows is not None and self._rows[0] == keys and self._rows[1] == rank:
            return self._rows[2]
        names = [self._name(key) for key in keys]
        rows = RowSet.build([0] * len(names), names, rank, TASK)
        self._rows = (keys, rank, rows)
        return rows

    def _name(self, key: tuple) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = row_name(*key)
        return name

    def _log_call(self, call: CallInfo, frames: tuple) -> None:
        stack = self._sites.stack(frames)
        if (call.name, stack) in self._logged:
            return
        self._logged.add((call.name, stack))
        logger.info(
            "trainmon: collective %s (group size %d; %s) called from:\n  %s",
            call.name,
            call.group_size(),
            _describe(call.tensor_groups()),
            "\n  ".join(self._sites.render(f) for f in frames) or "?",
        )

    def _update_listening(self) -> None:
        self.listening = self._installed and not self._failed and (self._collect or self._log_only)

    def _fail(self, exc: BaseException) -> None:
        """Stop measuring after a failure of our own code; report it once."""
        with self._lock:
            if self._failed:
                return
            self._failed = True
        self.listening = False
        if self.on_error is not None:
            self.on_error(TASK, exc)
        else:
            logger.error(
                "trainmon: collective statistics failed and are switched off (%r); training continues",
                exc,
                exc_info=exc,
            )
