"""msprobe's l2 features on MindSpore (see ``monitor.datatypes.l2``): attention probabilities and linear
spectral norms, with the torch adapter's names and values.

msprobe's MindSpore monitor writes the attention metric as ``softmax`` and the spectral norm
under another name than its PyTorch monitor; here both frameworks write ``softmax_max``,
``entropy``, ``kernel_norm`` and ``sr``, so runs compare. PyNative runs each operation
separately, so the work is done on the host with numpy on small copies: batch 0's Q and K of
each attention call, and each linear weight once per collected step (Lanczos from the last
step's top singular vector and a random one, as on torch).

A call is recorded as the activations are: inside a call of its chunk's root Cell, in training
mode or under ``value_and_grad`` (which leaves out MindSpore's recompute pass).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np

from adapters.mindspore.activations import RootCalls
from adapters.mindspore.jit_guard import LeftOutOfJit
from adapters.mindspore.stats import training_values
from monitor.config.schema import MonitorConfig
from monitor.datatypes.l2 import FIRST_ITERATIONS, WARM_ITERATIONS, L2Steps, attention_rows, lanczos_top
from monitor.record import RowSet

logger = logging.getLogger("trainmon")


def is_linear(cell: ms.nn.Cell) -> bool:
    """A Cell with a 2-D ``weight`` (or ``wg``, as msprobe also reads) tensor that is not an
    embedding table."""
    embedding_like = ("vocab_size", "num_embeddings", "vocab_start_index")
    if isinstance(cell, ms.nn.Embedding) or any(hasattr(cell, key) for key in embedding_like):
        return False
    weight = linear_weight(cell)
    return weight is not None and len(weight.shape) == 2


def linear_weight(cell: ms.nn.Cell) -> ms.Tensor | None:
    """The Cell's ``weight`` tensor, else its ``wg`` tensor; None without either."""
    for key in ("weight", "wg"):
        weight = getattr(cell, key, None)
        if isinstance(weight, ms.Tensor):
            return weight
    return None


class L2Features(L2Steps):
    """The hooks and per-step values of the l2 features of one MindSpore collection."""

    def __init__(
        self,
        chunks: Sequence[ms.nn.Cell],
        config: MonitorConfig,
        on_error: Callable[[str, BaseException], None],
        jit: LeftOutOfJit,
    ) -> None:
        named = [
            (vpp, raw, cell) for vpp, chunk in enumerate(chunks) for raw, cell in chunk.cells_and_names()
        ]
        super().__init__(named, config, is_linear, on_error, linear_weight)
        self.roots = RootCalls(chunks, lambda: self.collect, jit)
        #: this monitor's own random numbers (the training's generators are never drawn from)
        self._random = np.random.default_rng(0)

    def register(self) -> list:
        if not self.attention:
            return []
        jit = self.roots.jit

        def hooks() -> list:
            handles = self.roots.register_starts()
            for index, (_, _, cell) in enumerate(self.attention):
                handles.append(cell.register_forward_hook(jit.cell_hook(self._hook(index))))
            return handles + self.roots.register_ends()

        return jit.keep(hooks)

    def _hook(self, index: int) -> Callable:
        def hook(cell: ms.nn.Cell, args: tuple, output: Any) -> None:
            if self.collect and self.roots.training(self.attention[index][0]):
                self._measure(index, args)

        return hook

    def _measure(self, index: int, args: tuple) -> None:
        try:
            tensors = [a for a in args if isinstance(a, ms.Tensor)][:2]
            if not self.usable_qk(index, [t.shape for t in tensors]):
                return
            q, k = (t[:, 0] if self.order == "s,b,h,d" else t[0] for t in tensors)  # batch 0: (s, h, d)
            if self.heads == "first":
                q, k = q[:, :1], k[:, :1]
            rows = attention_rows(training_values(q), training_values(k), self.heads)
            self.add_attention(index, self.roots.micro_of(self.attention[index][0]), rows, rows.shape[0])
        except Exception as exc:
            self.attention_failed(index, exc)

    def reset(self) -> None:
        super().reset()
        self.roots.reset()

    def take_attention(self, rank: int) -> tuple[RowSet, np.ndarray] | None:
        """This step's attention rows and values; None without any. Resets the step."""
        return self.take_rows(rank, np.concatenate)

    def linear_values(self, rank: int) -> tuple[RowSet, np.ndarray] | None:
        """``[kernel_norm, sr]`` of every linear Cell's weight now; None without any."""
        if not self.linear:
            return None
        values = []
        for index, (_, _, cell) in enumerate(self.linear):
            weight = linear_weight(cell)
            if weight.dtype == ms.bfloat16:  # NumPy has no bfloat16
                weight = weight.astype(ms.float32)
            weight = training_values(weight).astype(np.float64)
            frobenius = float(np.linalg.norm(weight))
            if not np.isfinite(frobenius):  # NaN gives NaN, Inf inf, as on torch; no Lanczos on them
                values.append((frobenius, float("nan")))
                continue
            sigma = self._spectral_norm(index, weight)
            values.append((sigma, frobenius / sigma if sigma > 0 else 0.0))  # a zero weight: 0
        return self.linear_rows(rank), np.array(values)

    def _spectral_norm(self, index: int, weight: np.ndarray) -> float:
        tall = weight.shape[0] >= weight.shape[1]
        size = min(weight.shape)

        def gram(v: np.ndarray) -> np.ndarray:
            return weight.T @ (weight @ v) if tall else weight @ (weight.T @ v)

        fresh = self._random.standard_normal(size)
        start = self.vectors.get(index)
        steps = WARM_ITERATIONS
        if start is None or start.shape[0] != size:
            start, steps = fresh, FIRST_ITERATIONS
        else:  # half the last top vector, half a random one (see monitor.datatypes.l2)
            start = start / max(float(np.linalg.norm(start)), 1e-30) + fresh / np.sqrt(size)
        theta, vector = lanczos_top(gram, start, min(steps, size))
        self.vectors[index] = np.nan_to_num(vector, nan=1.0, posinf=1.0, neginf=-1.0)
        return float(np.sqrt(max(theta, 0.0))) if np.isfinite(theta) else float("nan")
