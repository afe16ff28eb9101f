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
  its square). msprobe runs 3 power iterations from a random start at every step, which can be
  far below the true value when the largest singular values lie close together, as they do in
  trained weights; ours runs Lanczos (which converges on close values far faster) from each
  module's top singular vector of the last collected step, and stays within 1% of the exact
  value. Measured on the weights the optimizer is about to update (those of the
  step's last micro-batch). Data type ``linear_hook``, rows ``{module}.linear``, task ``sr``.

Both follow the collection schedule (``start_step``, ``step_interval``) like every other data
type; msprobe computes them at every step whatever the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from monitor.config import MonitorConfig
from monitor.naming import distinct_names, is_selected_exactly, name_candidates, squash_name

ATTENTION_PREFIX, ATTENTION_TASK = "attention_hook", "qkt"
LINEAR_PREFIX, LINEAR_TASK = "linear_hook", "sr"
LINEAR_OPS = ("kernel_norm", "sr")


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
    attention_keys = config.l2_targets.get("attention_hook", ())
    linear_keys = config.l2_targets.get("linear_hook", ())

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
