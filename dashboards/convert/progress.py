"""Running the converters' jobs on N processes with a progress bar (tqdm when installed).

Without tqdm, a single stderr line is rewritten in place (``csv2tb: 3/8 rank0/grad_reduced``), or
printed once per job when stderr is not a terminal.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class _Line:
    """A minimal progress line on stderr. On a terminal, a message logged while the line is
    drawn goes on a line of its own (the line is ended first, and drawn again at the next job)."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done = total, desc, 0
        self.tty = sys.stderr.isatty()
        self.drawn = False
        if self.tty:
            logging.getLogger("trainmon").addFilter(self._before_message)

    def _before_message(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:  # what the console shows
            self._end_line()
        return True

    def _end_line(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            self.drawn = False

    def update(self, label: str) -> None:
        self.done += 1
        text = f"{self.desc}: {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r" + text.ljust(79)[:200])
            self.drawn = self.done < self.total
            if not self.drawn:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        self._end_line()
        logging.getLogger("trainmon").removeFilter(self._before_message)


class _Tqdm:
    """tqdm's bar, cleared before a message is logged (it is drawn again at the next job)."""

    def __init__(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="job")
        logging.getLogger("trainmon").addFilter(self._before_message)

    def _before_message(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:  # what the console shows
            self.bar.clear()
        return True

    def update(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        logging.getLogger("trainmon").removeFilter(self._before_message)
        self.bar.close()


def progress_bar(total: int, desc: str, enabled: bool = True) -> _Tqdm | _Line | None:
    """tqdm's bar when tqdm is installed, else the stderr line; None when disabled."""
    if not enabled or total == 0:
        return None
    try:
        return _Tqdm(total, desc)
    except ImportError:
        return _Line(total, desc)


def run_jobs(
    work: Callable[[Any], T],
    jobs: Sequence[Any],
    processes: int,
    desc: str,
    label: Callable[[Any], str] = str,
    show: bool = True,
) -> Iterator[tuple[Any, T]]:
    """``(job, work(job))`` for every job, in completion order, on ``processes`` processes
    (in this process when 1). ``work`` must be a module-level function (it is pickled)."""
    bar = progress_bar(len(jobs), desc, show)
    try:
        if processes <= 1 or len(jobs) <= 1:
            for job in jobs:
                result = work(job)
                if bar:
                    bar.update(label(job))
                yield job, result
            return
        with multiprocessing.get_context().Pool(min(processes, len(jobs))) as pool:
            for job, result in pool.imap_unordered(_Call(work), jobs):
                if bar:
                    bar.update(label(job))
                yield job, result
    finally:
        if bar:
            bar.close()


class _Call:
    """Picklable ``job -> (job, work(job))``."""

    def __init__(self, work: Callable[[Any], T]) -> None:
        self.work = work

    def __call__(self, job: Any) -> tuple[Any, T]:
        return job, self.work(job)
