"""msprobe's later "l2" features, framework-free: which modules, what is written, row names.

With ``recording_l2_features: true``:

* ``attention_hook`` modules (``l2_targets.attention_hook``, names as in ``targets``): from the
  first two positional tensors of each call, which must be 4-D (as msprobe requires), taken as Q
  and K in the layout ``sa_order`` (``s,b,h,d`` or ``b,s,h,d``), the causal attention
  probabilities P = softmax(QK^T / sqrt(d)); ``softmax_max`` is the mean over query rows of the
  row's largest probability and ``entropy`` the mean over rows of -sum p log p. A collapsing head
  drives ``softmax_max`` to 1 and ``entropy`` to 0. Like msprobe, batch 0 and head 0 by default
  (``l2_heads: "first"``); ``"all"`` takes every head of batch 0 and writes the mean over heads
  plus the most collapsed head (``softmax_max_top``: the largest, ``entropy_low``: the smallest);
  ``"each"`` writes one row per head. One row per micro-step, none in eval mode or in a
  checkpoint's recomputation. Data type ``attention_hook``, rows ``{module}.attention``
  (``.head{h}`` with ``each``), task ``qkt``.
* ``linear_hook`` modules (listed, or with an empty list every module with a 2-D ``weight`` but
  embeddings): ``kernel_norm``, the spectral norm (largest singular value) of the weight, and
  ``sr`` = Frobenius norm / spectral norm, msprobe's "stable rank" (the textbook stable rank is
  its square; 0 for an all-zero weight, such as a freshly initialised LoRA B). msprobe runs 3
  power iterations from a random start at every step, which can be far below the true value
  when the largest singular values lie close together, as they do in trained weights; ours runs
  Lanczos (which converges on close values far faster), 24 steps from each module's top
  singular vector of the last collected step mixed half and half with a random vector: the
  random half catches a new top direction the last vector barely holds (early in a run from
  scratch, where 6 steps from the last vector alone came out up to 5% low), and 24 steps reach
  within 1% even on a Gaussian matrix's crowded top (``benchmarks/spectral_norm.py``). Measured on
  the weights the optimizer is about to update (those of the step's last micro-batch). Data type
  ``linear_hook``, rows ``{module}.linear``, task ``sr``.

Both follow the collection schedule (``start_step``, ``step_interval``) like every other data
type; msprobe computes them at every step whatever the schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from monitor.config.schema import MonitorConfig
from monitor.datatypes.modules import call_name
from monitor.errors import raise_if_of_the_training
from monitor.naming import distinct_names, is_selected_exactly, name_candidates, squash_name, without_wrapper
from monitor.record import RowSet

ATTENTION_PREFIX, ATTENTION_TASK = "attention_hook", "qkt"
LINEAR_PREFIX, LINEAR_TASK = "linear_hook", "sr"
LINEAR_OPS = ("kernel_norm", "sr")
#: Lanczos steps from a random start, and at each later collected step from the last step's top
#: vector mixed with a random one.
FIRST_ITERATIONS, WARM_ITERATIONS = 32, 24
#: a Lanczos residual this much smaller than the operator's first product is a breakdown: the
#: Krylov space is invariant (more steps than the operator's rank) and the iteration ends there
BREAKDOWN = 1e-4

logger = logging.getLogger("trainmon")


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
    weight_of: Callable[[Any], Any] | None = None,
) -> tuple[list[tuple[int, str, Any]], list[tuple[int, str, Any]]]:
    """The (chunk, display name, module) of the attention and linear modules among ``named``
    ``(chunk, raw name, module)`` triples; none unless ``recording_l2_features``. With an empty
    ``linear_hook`` list and ``weight_of`` (a linear module's weight, or None), only modules whose
    weight trains, each weight once (``_trained_once``)."""
    if not config.recording_l2_features:
        return [], []
    raw_names = [raw for _, raw, _ in named]
    attention_keys = without_wrapper(config.l2_targets.get("attention_hook", ()), raw_names)
    linear_keys = without_wrapper(config.l2_targets.get("linear_hook", ()), raw_names)

    def listed(keys: Sequence[str], vpp: int, raw: str) -> bool:
        return is_selected_exactly(keys, name_candidates(vpp, raw, squash_name(raw)))

    attention = [item for item in named if attention_keys and listed(attention_keys, item[0], item[1])]
    if not linear_keys:
        linear = [item for item in named if is_linear(item[2])]
        linear = linear if weight_of is None else _trained_once(linear, weight_of)
    else:
        linear = [item for item in named if listed(linear_keys, item[0], item[1])]
        not_linear = [item for item in linear if not is_linear(item[2])]
        if not_linear:  # skipped, the others measured: a spectral norm needs one 2-D weight
            logger.warning(
                "trainmon: linear_hook %s: no 2-D weight (not a linear layer, or an embedding "
                "table); skipped, the other listed modules are measured",
                ", ".join(raw for _, raw, _ in not_linear),
            )
            linear = [item for item in linear if is_linear(item[2])]
    return _named(attention, config.squash_name), _named(linear, config.squash_name)


def _trained_once(
    found: list[tuple[int, str, Any]], weight_of: Callable[[Any], Any]
) -> list[tuple[int, str, Any]]:
    """The modules whose weight trains, each weight once: a frozen weight (a LoRA model's base
    layers) never changes, so its spectral norm says nothing new at any step, and a wrapper that
    hands on its inner layer's weight (PEFT's LoRA layer) or a tied weight would repeat a row."""
    seen: set[int] = set()
    kept = []
    for item in found:
        weight = weight_of(item[2])
        if weight is not None:
            if getattr(weight, "requires_grad", True) is False or id(weight) in seen:
                continue
            seen.add(id(weight))
        kept.append(item)
    return kept


def _named(found: list[tuple[int, str, Any]], squash: bool) -> list[tuple[int, str, Any]]:
    names = distinct_names([(vpp, raw) for vpp, raw, _ in found], squash)
    return [(vpp, name, module) for (vpp, _, module), name in zip(found, names)]


def qk_problem(shapes: Sequence[Sequence[int]], order: str, heads: str) -> str | None:
    """Why the first two positional tensors of a call (their ``shapes``) cannot be Q and K in
    the layout ``order``, or None where they can: two 4-D tensors of the same batch, sequence
    and head size, with as many query heads as key heads or a multiple (grouped-query attention,
    needed only where ``heads`` takes more than the first)."""
    if len(shapes) < 2 or any(len(shape) != 4 for shape in shapes[:2]):
        got = ", ".join(f"{len(shape)}-D" for shape in shapes[:2]) or "no tensor"
        return f"its first two positional tensors are not two 4-D ones (Q and K, {order}): got {got}"
    q, k = (dict(zip(order.split(","), shape)) for shape in shapes[:2])
    if (q["b"], q["s"], q["d"]) != (k["b"], k["s"], k["d"]):
        return (
            f"Q and K ({order}) differ in batch, sequence or head size: {list(shapes[0])} and "
            f"{list(shapes[1])}"
        )
    if heads != "first" and (k["h"] == 0 or q["h"] % k["h"]):
        return f"Q's {q['h']} heads are not a multiple of K's {k['h']} (grouped-query attention)"
    return None


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
    # 0 - x, not -x: one key alone has entropy 0, not -0
    entropy = 0.0 - (p * np.log(np.maximum(p, np.finfo(np.float32).tiny))).sum(axis=-1).mean()
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
        weight_of: Callable[[Any], Any] | None = None,
    ) -> None:
        self.attention, self.linear = select_l2_modules(named, config, is_linear, weight_of)
        self.order, self.heads = config.sa_order, config.l2_heads
        self.attention_ops = attention_ops(self.heads)
        self.on_error = on_error
        #: set by the collection before each step's forward: the hooks do nothing when False.
        self.collect = False
        self._rows: list[tuple[int, str, int]] = []
        self._values: list[Any] = []
        #: attention modules already said to be unusable, and those whose measurement failed
        self._said: set[int] = set()
        self._broken: set[int] = set()
        #: (attention module, micro-step) -> its calls so far this step (``name[1]`` for the second)
        self._calls: dict[tuple[int, int], int] = {}
        #: attention modules called in a training forward so far; None once the first collected
        #: step has said which were not (a name of a module that is never called has no rows)
        self._called: set[int] | None = set()
        #: per linear module: the top singular vector of the last collected step
        self.vectors: dict[int, Any] = {}

    def usable_qk(self, index: int, shapes: Sequence[Sequence[int]]) -> bool:
        """Whether a call's first two positional tensors (their ``shapes``) can be Q and K in the
        layout ``sa_order``; a module whose calls cannot is said once and has no rows, while the
        other attention modules go on."""
        if self._called is not None:
            self._called.add(index)
        problem = qk_problem(shapes, self.order, self.heads)
        if problem is None and index not in self._broken:
            return True
        if problem is not None and index not in self._said:
            self._said.add(index)
            logger.warning(
                "trainmon: attention_hook %s: %s; no rows for it", self.attention[index][1], problem
            )
        return False

    def attention_failed(self, index: int, exc: BaseException) -> None:
        """A module whose measurement raised: said once, then left out; the others go on. The
        training's own error that the measurement's read surfaced is raised on."""
        raise_if_of_the_training(exc)
        self._broken.add(index)
        if index not in self._said:
            self._said.add(index)
            logger.warning(
                "trainmon: attention_hook %s failed (%r); no rows for it from now on",
                self.attention[index][1],
                exc,
            )

    def add_attention(self, index: int, micro: int, values: Any, count: int) -> None:
        """One call's ``count`` rows (one, or one per head with ``each``) of attention module
        ``index`` at micro-step ``micro``; a second call in the micro-step is ``{module}[1]``, as
        activation rows name it."""
        vpp, name, _ = self.attention[index]
        calls = self._calls.get((index, micro), 0)  # a module called again in one micro-step
        self._calls[index, micro] = calls + 1
        name = call_name(name, calls)
        if self.heads == "each":
            self._rows += [(vpp, f"{name}.attention.head{h}", micro) for h in range(count)]
        else:
            self._rows.append((vpp, f"{name}.attention", micro))
        self._values.append(values)

    def take_rows(self, rank: int, concat: Callable[[list[Any]], Any]) -> tuple[RowSet, Any] | None:
        """This step's attention rows and their values joined by ``concat``; None without any. The
        first time, the attention modules that no training forward called so far are said."""
        rows, values = self._rows, self._values
        self.reset()
        if self._called is not None:
            silent = [name for index, (_, name, _) in enumerate(self.attention) if index not in self._called]
            self._called = None
            if silent:
                logger.warning(
                    "trainmon: attention_hook %s: not called in a training forward of the first collected "
                    "step, so no rows (name the module whose forward takes Q and K as its first two "
                    "positional tensors; a container's name, such as a ModuleList's, is never called)",
                    ", ".join(silent),
                )
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
        self._calls.clear()
