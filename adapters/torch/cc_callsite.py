"""Which frames of a collective call's stack are torch's own (cc_codeline, cc_log_only).

Frames of trainmon itself, of ``torch/distributed`` (the functions calling each other) and of
``torch/nn/modules/module.py``, ``multiprocessing`` and ``debugpy`` are left out; the stack
rendering and matching are ``monitor.collectives.callsites``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch.distributed

import adapters
import monitor
from monitor.collectives import callsites

_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(package.__file__)) + os.sep
    for package in (adapters, monitor, torch.distributed)
)
_SKIP_PATTERN = r"torch[/\\]nn[/\\]modules[/\\]module\.py$|[/\\](multiprocessing|debugpy)[/\\]"


class CallSites(callsites.CallSites):
    """The framework-free ``CallSites``, leaving out the frames of trainmon and torch's internals."""

    def __init__(self, patterns: Sequence[str] = ()) -> None:
        super().__init__(patterns, _SKIP_DIRS, _SKIP_PATTERN)
