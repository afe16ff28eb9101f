"""The framework-free half of a collective monitor (cc_distribution), shared by the adapters.

Each adapter's CollectiveMonitor subscribes to its ``cc_wrap`` registry (see ``monitor.collectives.registry``)
and knows how to read and measure its framework's tensors. What is the same for both lives
here: the listening switch (installed, not failed, and a collected step or cc_log_only), the
cc_log_only stop at the first step after the one it started in, the choice per call (log it
once with its call stack, drop it when cc_codeline filters its stack out, else measure it under
its call site), the per-argument summaries and row labels of a step, and stopping after a
failure of trainmon's own code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from monitor.collectives.callsites import CallSites, Frame
from monitor.collectives.registry import WrapperRegistry
from monitor.collectives.totals import row_name, stat_ops_for, summarise
from monitor.config.schema import MonitorConfig
from monitor.errors import CollectivesLogged, raise_if_of_the_training
from monitor.record import RowSet

logger = logging.getLogger("trainmon")

#: what the rows of a collective monitor are submitted as.
TASK = "comm"


class CollectiveMonitorBase:
    """Per-step statistics of the collectives of one TrainerMon, less the framework's part.

    A subclass measures: ``_start(call, site)`` (a token for ``after``, or None), ``after``,
    ``_describe(call)`` (for cc_log_only) and ``_forget_steps()``. A call is whatever the
    registry's wrappers hand to ``before``; it has a ``name``.

    Args:
        config: the validated config (``cc_distribution``, ``ops``).
        registry: the adapter's process-wide wrapper registry.
        make_sites: builds the CallSites of cc_codeline patterns, leaving out the adapter's frames.
        on_error: called once as ``on_error("comm", exc)`` when measuring fails; measuring then
            stops while the collectives go on. Without it the failure is logged.
    """

    def __init__(
        self,
        config: MonitorConfig,
        registry: WrapperRegistry,
        make_sites: Callable[[Sequence[str]], CallSites],
        on_error: Callable[[str, BaseException], None] | None,
    ) -> None:
        cc = config.cc_distribution
        self.config = config
        self.on_error = on_error
        self.out_ops: tuple[str, ...] = (*config.ops, "calls")
        self._ops = tuple(config.ops)
        self._stat_ops = stat_ops_for(self._ops)
        self._pre = cc.cc_pre_hook
        self._log_only = cc.cc_log_only
        self._filtered = bool(cc.cc_codeline)
        self._sites = make_sites(cc.cc_codeline) if (self._filtered or self._log_only) else None
        self._registry = registry
        #: read by the wrappers on every call: False makes a call cost one attribute check.
        self.listening = False
        self._installed = False
        self._failed = False
        self._collect = False
        self._first_step: int | None = None
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()
        self._names: dict[tuple, str] = {}
        self._rows: tuple[tuple, int, RowSet] | None = None

    # -- the contract with the session -------------------------------------------------------

    def install(self) -> list[str]:
        """Subscribe to the wrappers (the first subscriber in the process wraps); idempotent."""
        if not self._installed:
            self._installed = True
            self._first_step = None
            self._registry.subscribe(self)
            self._update_listening()
        return self._registry.wrapped

    def remove(self) -> None:
        """Unsubscribe (the last subscriber restores the originals); idempotent."""
        if self._installed:
            self._installed = False
            self.listening = False
            self._registry.unsubscribe(self)
            self._forget_steps()

    def renumber(self, step: int, collect: bool) -> None:
        """The step begun at attach gets another number before it ends (a resumed run's saved
        state says where it is): begun again under it, cc_log_only's first step with it."""
        if self._first_step is not None:
            self._first_step = step
        self.begin_step(step, collect)

    def _check_log_only(self, step: int) -> None:
        """With cc_log_only, note the first step and stop the run at the next one.

        Raises:
            CollectivesLogged: at the first step after the one it started in.
        """
        if self._log_only and self._installed:
            if self._first_step is None:
                self._first_step = step
            elif step != self._first_step:
                raise CollectivesLogged(
                    f"cc_log_only: {len(self._logged)} distinct collective calls were logged during step "
                    f"{self._first_step}; the run stops here as configured"
                )

    # -- called by the wrappers (never raise) ------------------------------------------------

    def before(self, call: Any) -> Any:
        """Before the original runs: filter, log or measure the inputs; a token for ``after``."""
        try:
            self._catch_up()
            site = None
            if self._sites is not None:
                frames = self._sites.frames()
                if self._log_only:
                    self._log_call(call, frames)
                    return None
                site = self._sites.site(frames) if self._filtered else None
                if self._filtered and site is None:
                    return None
            return self._start(call, site)
        except Exception as exc:
            self._fail(exc)
            return None

    def after(self, token: Any, result: Any) -> None:
        """After the original returned: measure its outputs (never raises)."""
        raise NotImplementedError

    # -- the framework's part ----------------------------------------------------------------

    def _catch_up(self) -> None:
        """Work left over from earlier calls, done at the start of each call (none here)."""

    def _start(self, call: Any, site: str | None) -> Any:
        """Measure the inputs of a kept call if asked; the token for ``after``, or None."""
        raise NotImplementedError

    def _describe(self, call: Any) -> tuple[int, str]:
        """Group size (-1 when unknown) and the tensors' dtypes and shapes, for cc_log_only."""
        raise NotImplementedError

    def _forget_steps(self) -> None:
        """Drop what was gathered for steps not yet taken (on remove)."""
        raise NotImplementedError

    # -- rows, logging, failures -------------------------------------------------------------

    def _summaries(self, groups: Sequence[tuple[int, Sequence]], stats: Any, numel: np.ndarray) -> list:
        """``(k, running fields)`` of each non-empty argument of ``groups``.

        ``stats`` and ``numel`` hold a row per tensor of ``groups``, in order.
        """
        parts, start = [], 0
        for k, tensors in groups:
            end = start + len(tensors)
            if end > start:
                parts.append((k, summarise(stats[start:end], numel[start:end], self._stat_ops)))
            start = end
        return parts

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

    def _log_call(self, call: Any, frames: tuple[Frame, ...]) -> None:
        stack = self._sites.stack(frames)
        if (call.name, stack) in self._logged:
            return
        self._logged.add((call.name, stack))
        size, tensors = self._describe(call)
        logger.info(
            "trainmon: collective %s (group size %d; %s) called from:\n  %s",
            call.name,
            size,
            tensors,
            "\n  ".join(self._sites.render(f) for f in frames) or "?",
        )

    def _update_listening(self) -> None:
        self.listening = self._installed and not self._failed and (self._collect or self._log_only)

    def _fail(self, exc: BaseException) -> None:
        """Stop measuring after a failure of our own code; report it once. The training's own
        error that a read of ours surfaced is raised on."""
        raise_if_of_the_training(exc)
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
