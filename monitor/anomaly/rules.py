"""Anomaly rules: small objects that turn a step's values and their history into a mask.

A rule holds its parameters; its history lives in arrays (rows = tags, columns = ops) that the
detector keeps per data type and hands back each step:

* ``fields``: the state arrays the rule needs, with their initial fill value;
* ``apply(values, state, op_names) -> (mask, baseline)`` evaluates a whole step at once;
* ``update(values, state) -> state`` folds the step into the history (pure: new arrays).

NaN/Inf policy: NaN and Inf never enter a history (``skip_nonfinite``, default true), so one bad
step never poisons a baseline. msprobe 1.2.2's exact behaviour, where one NaN leaves a
baseline NaN forever, is kept only for ``AnomalyTurbulence`` with ``semantics: "1.2.2"`` (its
default) or ``skip_nonfinite: false``, for configs that must behave exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from monitor.anomaly.rule_cells import State, above_rounding_noise, op_columns
from monitor.anomaly.zscore import AnomalyZScore

#: ops whose value is a count of NaN elements: any count above zero is a NaN signal.
COUNT_OPS = ("nans",)
#: ops whose NaN means "no value" rather than a NaN in the tensor: ``id`` is the value of a
#: one-element tensor only (msprobe writes nothing for others), so the non-finite check leaves its
#: NaN to the tensor's other statistics (a NaN in it shows in ``nans``, ``min``, ``norm``...).
NAN_IS_ABSENT_OPS = ("id",)
#: the verdicts the detector adds to the rules' own: a NaN/Inf statistic, and a tensor that moved
#: against the common move of its data type while that common move was flagged.
NONFINITE = "NonFinite"
MOVED_ALONE = "MovedAlone"
#: ops that are signed and may hover around zero, unlike norms, shares and counts.
SIGNED_OPS = ("mean", "min", "max")


def non_finite_cells(values: np.ndarray, op_names: tuple[str, ...]) -> np.ndarray:
    """The cells that signal a NaN/Inf in their tensor: a non-finite statistic (but not an absent
    ``id``) or a NaN count above zero."""
    counts = op_columns(COUNT_OPS, op_names)
    with np.errstate(invalid="ignore"):
        cells = ~np.isfinite(values) | (counts & (values > 0))
    if any(op in NAN_IS_ABSENT_OPS for op in op_names):
        cells &= ~(op_columns(NAN_IS_ABSENT_OPS, op_names) & np.isnan(values))
    return cells


def _folded(values: np.ndarray, skip_nonfinite: bool) -> np.ndarray:
    """Which cells enter the history this step."""
    return np.isfinite(values) if skip_nonfinite else np.ones(values.shape, dtype=bool)


class AnomalyTurbulence:
    """``|value| > ema * (1 + threshold)``, where ema is the EMA (beta 0.99) of past |values|.

    msprobe's later rule (``semantics: "later"``, the default), initialised by the first value;
    the rule sees the EMA before this step's update. On training signals it floods: the EMA lags
    every trend (learning-rate warm-up, Adam's moments growing from zero), gradient norms jump
    by 50% from step to step in small batches, and means hover around zero where any change is
    large relative to the mean itself. So by default a value must also

    * come after ``warmup`` values (default 20; msprobe: 1);
    * leave the tag's own noise: ``|value| - ema > noise * spread`` where spread is the EMA
      (beta 0.9) of ``||value| - ema|`` (default 6; 0 turns it off), so a steady trend or a
      noisy signal is judged against its own variability and a spike is still a spike;
    * for signed statistics (mean, min, max), reach ``floor`` times the tensor's element scale
      ``max(|min|, |max|)`` of the same step (default 0.1; needs min and max among the ops),
      so a mean that hovers near zero relative to the values around it is not judged.

    Whatever the arguments, a ``norm`` that drops to exactly zero after a non-zero history is
    flagged (a layer whose gradients died; not where its level was rounding noise,
    ``above_rounding_noise``); otherwise ``warmup: 1, noise: 0, floor: 0`` is
    msprobe's later rule exactly. ``two_sided`` also flags drops below ``ema * (1 - threshold)``.

    Other arguments: ``ops`` (default norm and mean, as msprobe); ``skip_nonfinite``
    (default true): NaN/Inf do not enter the history (false is msprobe 1.2.2's: one NaN silences
    the cell forever). Unlike msprobe, a value this rule does not judge (an op outside
    ``ops``) is still offered to the rules after it.
    """

    name = "AnomalyTurbulence"
    fields: ClassVar[dict[str, float]] = {"ema": 0.0, "spread": 0.0, "count": 0.0}
    beta = 0.99
    spread_beta = 0.9
    #: the detector passes each row's element scale, max(|min|, |max|), as ``scale``.
    uses_scale = True

    def __init__(
        self,
        threshold: float,
        ops: tuple[str, ...] = ("norm", "mean"),
        warmup: int = 20,
        two_sided: bool = False,
        skip_nonfinite: bool = True,
        noise: float = 6.0,
        floor: float = 0.1,
    ) -> None:
        self.threshold = threshold
        self.ops = ops
        self.warmup = warmup
        self.two_sided = two_sided
        self.skip_nonfinite = skip_nonfinite
        self.noise = noise
        self.floor = floor

    def apply(
        self, values: np.ndarray, state: State, op_names: tuple[str, ...], scale: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        ema = state["ema"]
        magnitude = np.abs(values)
        with np.errstate(invalid="ignore", over="ignore"):
            if self.two_sided:
                mask = np.abs(magnitude - ema) > self.threshold * ema
            else:
                mask = magnitude > ema * (1.0 + self.threshold)
            if self.noise:
                mask &= np.abs(magnitude - ema) > self.noise * state["spread"]
            if self.floor and scale is not None:
                signed = op_columns(SIGNED_OPS, op_names)
                mask &= ~signed | ~(magnitude < self.floor * scale[:, None])
            vanished = op_columns(("norm",), op_names) & (values == 0) & (ema > 0)
        judged = (state["count"] >= self.warmup) & op_columns(self.ops, op_names)
        if (vanished & judged).any():
            mask |= vanished & above_rounding_noise(ema, judged, vanished)
        return mask & judged, ema

    def update(self, values: np.ndarray, state: State) -> State:
        magnitude = np.abs(values)
        folded = _folded(magnitude, self.skip_nonfinite)
        fresh = state["count"] == 0
        with np.errstate(invalid="ignore", over="ignore"):
            blended = np.where(fresh, magnitude, self.beta * state["ema"] + (1.0 - self.beta) * magnitude)
            deviation = np.abs(magnitude - state["ema"])
            spread = np.where(
                fresh, 0.0, self.spread_beta * state["spread"] + (1.0 - self.spread_beta) * deviation
            )
        return {
            "ema": np.where(folded, blended, state["ema"]),
            "spread": np.where(folded, spread, state["spread"]),
            "count": state["count"] + folded,
        }


class RunningMeanTurbulence:
    """msprobe 1.2.2's ``AnomalyTurbulence`` (``semantics: "1.2.2"``), kept exactly for old configs.

    The baseline b is the arithmetic mean of all previous values (signed, not magnitudes; the first
    value initialises it). With ``bound = b + b * threshold`` a value is flagged iff
    ``value > bound`` when b > 0, else iff ``value < bound``: one-sided, only growth away from
    zero; b == 0 flags any negative value; a drop never fires. It judges every op (``ops``
    default: all). By default one NaN or Inf makes the mean NaN/Inf and silences the (tag, op)
    forever, as in 1.2.2; ``skip_nonfinite: true`` keeps non-finite values out of the mean.
    The arithmetic is msprobe 1.2.2's, operation for operation, so verdicts are bit-identical.
    """

    name = "AnomalyTurbulence"
    fields: ClassVar[dict[str, float]] = {"mean": 0.0, "count": 0.0}

    def __init__(
        self,
        threshold: float,
        ops: tuple[str, ...] | None = None,
        warmup: int = 1,
        skip_nonfinite: bool = False,
    ) -> None:
        self.threshold = threshold
        self.ops = ops
        self.warmup = warmup
        self.skip_nonfinite = skip_nonfinite

    def apply(
        self, values: np.ndarray, state: State, op_names: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        mean = state["mean"]
        with np.errstate(invalid="ignore", over="ignore"):
            bound = mean + mean * self.threshold
            mask = np.where(mean > 0, values > bound, values < bound)
        return mask & (state["count"] >= self.warmup) & op_columns(self.ops, op_names), mean

    def update(self, values: np.ndarray, state: State) -> State:
        folded = _folded(values, self.skip_nonfinite)
        count = state["count"]
        previous = np.where(count == 0, values, state["mean"])
        with np.errstate(invalid="ignore", over="ignore"):
            mean = (previous * count + values) / (count + 1.0)
        return {"mean": np.where(folded, mean, state["mean"]), "count": count + folded}


class AnomalyNan:
    """Flags NaN or Inf values, a positive NaN count, and (with ``threshold``) |value| > threshold."""

    name = "AnomalyNan"
    fields: ClassVar[dict[str, float]] = {}

    def __init__(self, threshold: float | None = None) -> None:
        self.threshold = threshold

    def apply(
        self, values: np.ndarray, state: State, op_names: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        counts = op_columns(COUNT_OPS, op_names)
        mask = non_finite_cells(values, op_names)
        if self.threshold is not None:
            with np.errstate(invalid="ignore"):
                mask |= ~counts & (np.abs(values) > self.threshold)
        return mask, np.full(values.shape, np.nan if self.threshold is None else self.threshold)

    def update(self, values: np.ndarray, state: State) -> State:
        return state


RULES: dict[str, type] = {cls.name: cls for cls in (AnomalyTurbulence, AnomalyNan, AnomalyZScore)}


def make_rule(name: str, args: Mapping[str, Any]) -> Any:
    """One rule object from its (validated) name and args; ``semantics`` picks the turbulence rule."""
    args = dict(args)
    if name == "AnomalyTurbulence" and args.pop("semantics", "later") == "1.2.2":
        return RunningMeanTurbulence(**args)
    return RULES[name](**args)


def build_rules(specs: tuple) -> list:
    """Instantiate the configured rules (specs already validated by the config)."""
    return [make_rule(spec.rule_name, spec.args) for spec in specs]
