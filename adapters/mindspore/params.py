"""The monitored parameters of MindSpore Cells: selection by targets, display names.

Built once per collection. Names are the Cells' ``parameters_and_names()`` names (relative to
each model chunk, as torch's ``named_parameters()``); nothing is written onto the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mindspore as ms

from monitor.config.schema import MonitorConfig
from monitor.naming import select_objects


@dataclass(frozen=True)
class MonitoredParam:
    """One selected parameter: its chunk, its display name and the Parameter itself."""

    vpp_stage: int
    name: str
    raw_name: str
    param: ms.Parameter


def _optimizer_state(chunk: ms.nn.Cell) -> set[int]:
    """Ids of the Parameters that optimizer Cells inside ``chunk`` keep as their own state (Adam's
    moments, step counts, learning rates): a train network that calls its optimizer holds it, and
    MindSpore makes that state trainable Parameters of the network."""
    state: set[int] = set()
    for _, cell in chunk.cells_and_names():
        if isinstance(cell, ms.nn.Optimizer):
            optimized = {id(p) for p in cell.parameters}
            state |= {id(p) for p in cell.get_parameters()} - optimized
    return state


class ParamRegistry:
    """Selected trainable parameters (``requires_grad``) of every model chunk, in model order,
    not the state of an optimizer a chunk holds.

    A parameter shared by several chunks is monitored once, in the first chunk that selects it.
    """

    def __init__(self, chunks: Sequence[ms.nn.Cell], config: MonitorConfig) -> None:
        every = [
            (vpp, raw, param)
            for vpp, chunk in enumerate(chunks)
            for state in (_optimizer_state(chunk),)
            for raw, param in chunk.parameters_and_names()
            if id(param) not in state
        ]
        #: ``(vpp_stage, raw_name)`` of every parameter, trainable or not (what targets may name)
        self.names = [(vpp, raw) for vpp, raw, _ in every]
        trainable = [found for found in every if found[2].requires_grad]
        self.params = [
            MonitoredParam(*found) for found in select_objects(trainable, config.targets, config.squash_name)
        ]

    def __len__(self) -> int:
        return len(self.params)
