"""The ``trainmon`` logger: quiet by default, visible without any logging set-up by the user."""

from __future__ import annotations

import logging
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (so redirection and test capture work)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging() -> None:
    """Give the ``trainmon`` logger a stderr handler at INFO unless the application set one up."""
    logger = logging.getLogger("trainmon")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[trainmon] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
