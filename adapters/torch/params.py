"""The monitored parameters: selection by targets, display names, where their gradient lives.

Built once at attach time. Nothing is written onto the user's parameters (msprobe sets
attributes on them); the registry keeps its own side tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from monitor.config.schema import MonitorConfig
from monitor.naming import select_objects

logger = logging.getLogger("trainmon")


@dataclass(frozen=True)
class MonitoredParam:
    """One selected parameter: its chunk, its display name and the tensor itself."""

    vpp_stage: int
    name: str
    raw_name: str
    param: torch.nn.Parameter


class ParamRegistry:
    """Selected trainable parameters of every model chunk, in model order."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        config: MonitorConfig,
        main_grad: bool | None,
        named: Callable[[torch.nn.Module], Iterable[tuple[str, Any]]] | None = None,
    ) -> None:
        """``named``: a chunk's parameters by name (default ``named_parameters``; a back-end
        whose framework flattened the parameters away names stand-ins for them)."""
        self.main_grad = main_grad
        named = named or (lambda chunk: chunk.named_parameters())
        every = [(vpp, raw, param) for vpp, chunk in enumerate(chunks) for raw, param in named(chunk)]
        #: ``(vpp_stage, raw_name)`` of every parameter, trainable or not (what targets may name)
        self.names = [(vpp, raw) for vpp, raw, _ in every]
        trainable = [found for found in every if found[2].requires_grad]
        # a parameter shared by several chunks is registered once, in the first
        self.params = [
            MonitoredParam(*found) for found in select_objects(trainable, config.targets, config.squash_name)
        ]
        #: frozen parameters the targets name: told where they are all that was named
        frozen = [found for found in every if not found[2].requires_grad]
        self.frozen_named = len(select_objects(frozen, config.targets, config.squash_name)) if frozen else 0
        self._warned_main_grad = False

    def __len__(self) -> int:
        return len(self.params)

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient the monitor reads: ``main_grad`` (Megatron style) where used, else ``.grad``."""
        if self.main_grad is not False:
            main = getattr(param, "main_grad", None)
            if main is not None:
                return main
            if self.main_grad is True and not self._warned_main_grad:
                self._warned_main_grad = True
                logger.warning(
                    "trainmon: params_have_main_grad=True but a parameter has no main_grad; reading .grad"
                )
        return param.grad
