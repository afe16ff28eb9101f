"""Exceptions that trainmon raises on purpose (framework-free)."""

from __future__ import annotations


class CollectivesLogged(Exception):
    """Raised at the first optimizer step when ``cc_distribution.cc_log_only`` is set.

    With ``cc_log_only`` the monitor measures nothing: it logs every distinct collective call
    (op, call stack, dtypes, shapes, group size) once and then stops the run on purpose by
    raising this exception from ``optimizer.step()`` (after the update), so that a short run
    lists the collectives a job uses. Catch it to end the run quietly::

        try:
            train()
        except monitor.CollectivesLogged:
            pass

    Unlike msprobe (which raises a bare ``Exception``), it can be told apart from real
    failures.
    """


class StructurePrinted(Exception):
    """Raised when ``print_struct`` has written the model structure: the run stops as asked.

    ``args[0]`` is the path of the structure file.
    """


class TrainingStopped(Exception):
    """Raised from ``optimizer.step()`` (after the update) when ``alert.actions`` holds ``stop``.

    An incident asked the run to stop: every rank raises it at the same step, agreed through the
    process group, so no rank is left waiting in a collective. ``step`` is the step counter at
    the stop (the next step that would have run), ``reason`` the incident's one-line summary.
    The monitor's outputs are complete and closed when it is raised. Catch it to save a
    checkpoint or exit with a status of your choice::

        try:
            train()
        except monitor.TrainingStopped as stop:
            save_checkpoint()
            sys.exit(3)
    """

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"trainmon stopped the run at step {step}: {reason}")
        self.step = step
        self.reason = reason


def of_the_training(exc: BaseException) -> BaseException:
    """Mark ``exc``, raised by the framework when the monitor read a tensor the training computed,
    as the training's own error: a framework that runs operations asynchronously (MindSpore)
    reports a failing kernel of the training at the first read of its result, which may be the
    monitor's. It is raised on to the training as it would have been without the monitor, never
    taken for a fault of the monitor's and swallowed: MindSpore reports it once, and later reads
    give wrong values."""
    exc.trainmon_of_the_training = True  # type: ignore[attr-defined]
    return exc


def is_of_the_training(exc: BaseException) -> bool:
    """Whether ``of_the_training`` marked ``exc``."""
    return bool(getattr(exc, "trainmon_of_the_training", False))


def raise_if_of_the_training(exc: BaseException) -> None:
    """Raise ``exc`` on where ``of_the_training`` marked it: a catch site of the monitor's that
    would otherwise take it for its own fault calls this first."""
    if is_of_the_training(exc):
        raise exc
