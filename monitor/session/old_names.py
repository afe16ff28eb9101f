"""msprobe's older TrainerMon methods, kept so that code written for them runs unchanged: each
says that it is deprecated (a DeprecationWarning and the log) and does what its successor does."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monitor.session.trainer import TrainerMon

logger = logging.getLogger("trainmon")


class MsprobeOldNames:
    """Mixed into TrainerMon, whose ``_restart_with``, ``set_monitor`` and ``_wrapped_optimizer``
    these use."""

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """Deprecated (msprobe): switch activation monitoring; use DYNAMIC_MONITOR or start()/stop()."""
        _deprecated("reload_xy", "DYNAMIC_MONITOR or start()/stop()")
        self._restart_with(xy_distribution=xy_distribution)

    def monitor_gnorm_with_ad(self, *args: Any, **kwargs: Any) -> TrainerMon:
        """Deprecated name of set_monitor (older msprobe), with its arguments; forwards to it."""
        _deprecated("monitor_gnorm_with_ad", "set_monitor")
        return self.set_monitor(*args, **kwargs)

    def set_wrapped_optimizer(self, optimizer: Any) -> None:
        """Deprecated (older msprobe): remember the optimizer for a later set_monitor call."""
        _deprecated("set_wrapped_optimizer", "set_monitor(..., optimizer=...)")
        self._wrapped_optimizer = optimizer


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"TrainerMon.{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)
    logger.warning("trainmon: TrainerMon.%s is deprecated; use %s", old, new)
