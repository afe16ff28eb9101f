"""msprobe's later "l2" features, framework-free: which modules, what is written, row names.

With ``recording_l2_features: true``:

* ``attention_hook`` modules (``l2_targets.attention_hook``, names as in ``targets``): from the
  first two positional 4-D tensors of each call, taken as Q and K in the layout ``sa_order``
  (``s,b,h,d`` or ``b,s,h,d``), the causal attention probabilities P = softmax(QK^T / sqrt(d));
  ``softmax_max`` is the mean over query rows of the row's largest probability and ``entropy``
  the mean over rows of -sum p log p. A collapsing head drives ``softmax_max`` to 1 and
  ``entropy`` to 0. Like msprobe, batch 0 and head 0 by default (``l2_heads: "first"``);
  ``"all"`` takes every head of batch 0 and writes the mean over heads plus the most collapsed
  head (``softmax_max_top``: the largest, ``entropy_low``: the smallest); ``"each"`` writes one
  row per head. One row per micro-step, none in eval mode or in a checkpoint's recomputation.
  Data type ``attention_hook``, rows ``{module}.attention`` (``.head{h}`` with ``each``), task
  ``qkt``.
* ``linear_hook`` modules (listed, or with an empty list every module with a 2-D ``weight`` but
  embeddings): ``kernel_norm``, the spectral norm (largest singular value) of the weight, and
  ``sr`` = Frobenius norm / spectral norm, msprobe's "stable rank" (the textbook stable rank is
  its square; 0 for an all-zero weight, such as a freshly initialised LoRA B). msprobe runs 3
  power iterations from a random start at every step, which can be far below the true value
  when the largest singular values lie close together, as they do in trained weights; ours runs
  Lanczos (which converges on close values far faster), 16 steps from each module's top
  singular vector of the last collected step mixed half and half with a random vector: the
  random half catches a new top direction the last vector barely holds (early in a run from
  scratch, where 6 steps from the last vector alone came out up to 5% low), and 16 steps reach
  within 1% even on a Gaussian matrix's crowded top (``benchmarks/spectral_norm.py``). Measured on
  the weights the optimizer is about to update (those of the step's last micro-batch). Data type
  ``linear_hook``, rows ``{module}.linear``, task ``sr``.

Both follow the collection schedule (``start_step``, ``step_interval``) like every other data
type; msprobe computes them at every step whatever the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from monitor.config.schema import MonitorConfig
from monitor.naming import distinct_names, is_selected_exactly, name_candidates, squash_name, without_wrapper
from monitor.record import RowSet

ATTENTION_PREFIX, ATTENTION_TASK = "attention_hook", "qkt"
LINEAR_PREFIX, LINEAR_TASK = "linear_hook", "sr"
LINEAR_OPS = ("kernel_norm", "sr")
#: Lanczos steps from a random start, and at each later collected step from the last step's top
#: vector mixed with a random one.
FIRST_ITERATIONS, WARM_ITERATIONS = 32, 16
#: a Lanczos residual this much smaller than the operator's first product is a breakdown: the
#: Krylov space is invariant (more steps than the operator's rank) and the iteration ends there
BREAKDOWN = 1e-4


def attention_ops(heads: str) -> tuple[str, ...]:
    """The columns of the attention rows for an ``l2_heads`` choice."""
    return (
        ("softmax_max", "entropy", "softmax_max_top", "entropy_low")
        if heads == "all"
        else ("softmax_max", "entropy")
    )


def select_l2_modules(
    named: Sequence[tuple[int, str, Any]],
    config: MonitorConfig,
    is_linear: Callable[[Any], bool],
) -> tuple[list[tuple[int, str, Any]], list[tuple[int, str, Any]]]:
    """The (chunk, display name, module) of the attention and linear modules among ``named``
    ``(chunk, raw name, module)`` triples; none unless ``recording_l2_features``."""
    if not config.recording_l2_features:
        return [], []
    raw_names = [raw for _, raw, _ in named]
    attention_keys = without_wrapper(config.l2_targets.get("attention_hook", ()), raw_names)
    linear_keys = without_wrapper(config.l2_targets.get("linear_hook", ()), raw_names)

    def listed(keys: Sequence[str], vpp: int, raw: str) -> bool:
        return is_selected_exactly(keys, name_candidates(vpp, raw, squash_name(raw)))

    attention = [item for item in named if attention_keys and listed(attention_keys, item[0], item[1])]
    linear = [
        item
        for item in named
        if (listed(linear_keys, item[0], item[1]) if linear_keys else is_linear(item[2]))
    ]
    return _named(attention, config.squash_name), _named(linear, config.squash_name)


def _named(found: list[tuple[int, str, Any]], squash: bool) -> list[tuple[int, str, Any]]:
    names = distinct_names([(vpp, raw) for vpp, raw, _ in found], squash)
    return [(vpp, name, module) for (vpp, _, module), name in zip(found, names)]


def attention_rows(q: np.ndarray, k: np.ndarray, heads: str) -> np.ndarray:
    """The rows of one attention call on the host (adapters without device kernels for it):
    ``q``, ``k`` are batch 0's (sequence, heads, head size) arrays; see ``attention_ops``. With
    fewer key than query heads (grouped-query attention) query head h reads key head
    h // (query heads / key heads); one head's (s, s) scores exist at a time."""
    q, k = np.asarray(q, dtype=np.float32), np.asarray(k, dtype=np.float32)
    if heads == "first":
        q, k = q[:, :1], k[:, :1]
    elif k.shape[1] != q.shape[1]:
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    per_head = np.array([_head_scores(q[:, h], k[:, h]) for h in range(q.shape[1])])
    if heads == "all":
        mean = per_head.mean(axis=0)
        return np.array([[mean[0], mean[1], per_head[:, 0].max(), per_head[:, 1].min()]])
    return per_head


def _head_scores(q: np.ndarray, k: np.ndarray) -> tuple[float, float]:
    scores = q @ k.T / np.float32(np.sqrt(q.shape[-1]))
    scores = np.where(np.tril(np.ones(scores.shape, dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    entropy = -(p * np.log(np.maximum(p, np.finfo(np.float32).tiny))).sum(axis=-1).mean()
    return float(p.max(axis=-1).mean()), float(entropy)


def lanczos_top(
    apply: Callable[[np.ndarray], np.ndarray], start: np.ndarray, steps: int
) -> tuple[float, np.ndarray]:
    """The largest eigenvalue of a symmetric positive semi-definite operator and its Ritz vector
    after ``steps`` Lanczos steps with full reorthogonalisation, on the host. The torch adapter
    runs the same algorithm on the device (``adapters.torch.l2.lanczos`` and ``top_eigenpairs``)."""
    basis = np.zeros((steps, start.shape[0]))
    alpha, beta = np.zeros(steps), np.zeros(steps)
    q = start / max(float(np.linalg.norm(start)), 1e-300)
    scale = None
    for j in range(steps):
        basis[j] = q
        w = apply(q)
        scale = float(np.linalg.norm(w)) if scale is None else scale
        alpha[j] = q @ w
        w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)
        w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)
        beta[j] = np.linalg.norm(w)
        if beta[j] <= BREAKDOWN * scale:  # an invariant space: see BREAKDOWN
            beta[j] = 0.0
            break
        q = w / beta[j]
    values, vectors = np.linalg.eigh(np.diag(alpha) + np.diag(beta[:-1], 1) + np.diag(beta[:-1], -1))
    return float(values[-1]), basis.T @ vectors[:, -1]


class L2Steps:
    """What both adapters' l2 parts keep per step: the attention rows and values of the step so
    far, and each linear module's singular vector across steps.
    Adapters add the hooks and the arithmetic of their framework."""

    def __init__(
        self,
        named: Sequence[tuple[int, str, Any]],
        config: MonitorConfig,
        is_linear: Callable[[Any], bool],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.attention, self.linear = select_l2_modules(named, config, is_linear)
        self.order, self.heads = config.sa_order, config.l2_heads
        self.attention_ops = attention_ops(self.heads)
        self.on_error = on_error
        #: set by the collection before each step's forward: the hooks do nothing when False.
        self.collect = False
        self._rows: list[tuple[int, str, int]] = []
        self._values: list[Any] = []
        #: per linear module: the top singular vector of the last collected step
        self.vectors: dict[int, Any] = {}

    def add_attention(self, index: int, micro: int, values: Any, count: int) -> None:
        """One call's ``count`` rows (one, or one per head with ``each``) of attention module
        ``index`` at micro-step ``micro``."""
        vpp, name, _ = self.attention[index]
        if self.heads == "each":
            self._rows += [(vpp, f"{name}.attention.head{h}", micro) for h in range(count)]
        else:
            self._rows.append((vpp, f"{name}.attention", micro))
        self._values.append(values)

    def take_rows(self, rank: int, concat: Callable[[list[Any]], Any]) -> tuple[RowSet, Any] | None:
        """This step's attention rows and their values joined by ``concat``; None without any."""
        rows, values = self._rows, self._values
        self.reset()
        if not rows:
            return None
        vpp, names, micro = zip(*rows)
        return RowSet.build(vpp, names, rank, ATTENTION_TASK, micro), concat(values)

    def linear_rows(self, rank: int) -> RowSet:
        """The rows of the linear modules, in selection order."""
        return RowSet.build(
            [vpp for vpp, _, _ in self.linear],
            [f"{name}.linear" for _, name, _ in self.linear],
            rank,
            LINEAR_TASK,
        )

    def reset(self) -> None:
        """Forget the step's rows (the singular vectors stay)."""
        self._rows, self._values = [], []
