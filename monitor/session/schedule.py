"""Which steps are collected: start_step, step_interval, collect_times and module_ranks.

The decision for a step is made once, before its forward pass, so hooks only read a flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from monitor.config.schema import MonitorConfig


@dataclass
class Schedule:
    """Counts collected steps and answers ``wants(step)``.

    A step N is collected iff N >= start_step, (N - start_step) % step_interval == 0 and fewer
    than collect_times steps were collected so far, as in msprobe. A collection that begins later
    (attached at ``start_iteration``, ``start()`` after ``stop()``, a live edit) takes no step
    before ``first_step`` and keeps the interval's phase: with start_step 0 and step_interval 10
    a run resumed at step 1005 collects 1010, 1020, ... as the original run did.
    """

    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 100_000_000
    collected: int = 0
    #: the first step this collection may take (where it began)
    first_step: int = 0

    @classmethod
    def from_config(cls, config: MonitorConfig) -> Schedule:
        return cls(config.start_step, config.step_interval, config.collect_times)

    def wants(self, step: int) -> bool:
        return (
            not self.finished
            and step >= max(self.start_step, self.first_step)
            and (step - self.start_step) % self.step_interval == 0
        )

    @property
    def first_wanted(self) -> int:
        """The first step this collection would take."""
        earliest = max(self.start_step, self.first_step)
        return earliest + (self.start_step - earliest) % self.step_interval

    def mark_collected(self) -> None:
        self.collected += 1

    @property
    def finished(self) -> bool:
        return self.collected >= self.collect_times


def rank_enabled(config: MonitorConfig, rank: int) -> bool:
    """True when this rank monitors (``module_ranks`` empty or containing it)."""
    return not config.module_ranks or rank in config.module_ranks
