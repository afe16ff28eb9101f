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

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

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
State = dict[str, np.ndarray]


def _op_columns(ops: tuple[str, ...] | None, op_names: tuple[str, ...]) -> np.ndarray:
    """Boolean row vector: which columns a rule looks at (``None``: all of them)."""
    return np.array([ops is None or op in ops for op in op_names], dtype=bool)[None, :]


#: a level this far below its record's median level is rounding noise: its vanishing is no sign
VANISHED_FLOOR = 1e-6


def above_rounding_noise(levels: np.ndarray, judged: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Which of ``cells`` have a level above ``VANISHED_FLOOR`` times the median level of their
    column's judged rows: a norm that vanishes from there is a dead layer, one that was 1e-9 of
    the others' (a gradient the data leaves at zero but for rounding) merely rounded to zero."""
    visible = np.ones(levels.shape, dtype=bool)
    usable = judged & np.isfinite(levels)  # a level a NaN/Inf entered tells nothing of the size
    for column in np.flatnonzero((cells & usable).any(axis=0)):
        typical = np.median(levels[usable[:, column], column])
        visible[:, column] = ~(levels[:, column] <= VANISHED_FLOOR * typical)
    return visible


def non_finite_cells(values: np.ndarray, op_names: tuple[str, ...]) -> np.ndarray:
    """The cells that signal a NaN/Inf in their tensor: a non-finite statistic (but not an absent
    ``id``) or a NaN count above zero."""
    counts = _op_columns(COUNT_OPS, op_names)
    with np.errstate(invalid="ignore"):
        cells = ~np.isfinite(values) | (counts & (values > 0))
    if any(op in NAN_IS_ABSENT_OPS for op in op_names):
        cells &= ~(_op_columns(NAN_IS_ABSENT_OPS, op_names) & np.isnan(values))
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
                signed = _op_columns(SIGNED_OPS, op_names)
                mask &= ~signed | ~(magnitude < self.floor * scale[:, None])
            vanished = _op_columns(("norm",), op_names) & (values == 0) & (ema > 0)
        judged = (state["count"] >= self.warmup) & _op_columns(self.ops, op_names)
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
        return mask & (state["count"] >= self.warmup) & _op_columns(self.ops, op_names), mean

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
        counts = _op_columns(COUNT_OPS, op_names)
        mask = non_finite_cells(values, op_names)
        if self.threshold is not None:
            with np.errstate(invalid="ignore"):
                mask |= ~counts & (np.abs(values) > self.threshold)
        return mask, np.full(values.shape, np.nan if self.threshold is None else self.threshold)

    def update(self, values: np.ndarray, state: State) -> State:
        return state


def _median_change(change: np.ndarray, judged: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Per op column (of those ``columns`` marks), the median change of the judged finite rows
    (0 where there is none): how the record's tensors moved together."""
    usable = judged & np.isfinite(change)
    medians = np.zeros(change.shape[1])
    for column in np.flatnonzero(usable.any(axis=0) & columns):
        medians[column] = np.median(change[usable[:, column], column])
    return medians


class AnomalyZScore:
    """Robust two-sided rule for heavy-tailed, trending signals such as gradient norms.

    Works on log|value|: forecasts each value from the history and keeps the exponentially
    weighted variance of the forecasts' errors (``beta``, default 0.9; bias-corrected for its
    zero start, like Adam's moments; its square root is the signal's relative spread). With
    ``trend`` (the default) the forecast is Brown's double exponential smoothing (factor
    TREND_BETA, 0.8): a level and its slope, so that a norm falling steadily, as gradient norms
    do early in training, is forecast where it is going. A plain running mean lags such a
    signal by several times its fall per step, and the lag entered the spread: on a small model
    whose gradient norms fell 8x in 12 steps the spread grew to 1.2 in log, so that only a value
    1,600x off was flagged, where the forecasts' errors make it 0.35 (8x). ``trend: false`` is
    the running mean (``beta``) of earlier versions. Once ``warmup`` values (default 10) were
    seen, it flags a value at least ``min_ratio`` (default 4x) off its forecast whose z-score of
    log|value| exceeds ``threshold`` (default 6). A drop must also be one of: from a quiet signal (the
    share of the level lost, 0 to 1, exceeds ``threshold`` times the relative spread), at least
    ``min_ratio`` squared (16x), or shared (the record's tensors fell by ``min_ratio`` in the
    median: clipping of an exploded gradient, a cut loss scale). Drops are held to more because
    the logarithm stretches them without bound: the norm of a tensor of a few elements that
    nearly cancel (a bias gradient of a small classifier head on one rank) falls 5x on its own
    now and then, which is noise, yet a log z-score of 6. Zero, NaN and Inf never enter the history; a
    ``norm`` that drops to exactly zero after such a history is flagged (a layer whose gradients
    died; the detector leaves out mg_direction's share, whose norm column may be 0 by chance),
    unless its level was rounding noise (``above_rounding_noise``: the gradient of a weight that
    the data leaves mathematically at zero, about 1e-9 where the others are 1e-2, now and then
    rounds to exactly zero).
    A flagged value is held out of the history for a step: when the next value is flagged too,
    the change lasts and both enter (the level and spread learn it, so its echo in the
    optimizer's moments is reported at two steps, not at every step); when the next value is
    back, the spike was alone and never enters, so the same fault a few steps later is seen
    again (entered at once, a 1000x spike widened the spread enough to hide a repeat for about
    15 steps).

    False positives on a stationary signal (100 tags x 10,000 steps of i.i.d. noise, measured by
    ``benchmarks/anomaly_rules.py``; rate = flagged / judged values):

    args                                   lognormal s=0.1  lognormal s=0.5  log-t3 s=0.5
    defaults (threshold 6, min_ratio 4)                  0           5.0e-6        3.8e-3
    min_ratio 5                                          0           5.0e-6        3.7e-3
    threshold 4                                          0           5.0e-4        1.2e-2
    threshold 4, min_ratio 1                        1.1e-3           1.1e-3        1.5e-2
    threshold 3, min_ratio 1                        1.3e-2           1.3e-2        4.3e-2
    threshold 4, min_ratio 1, beta 0.99             1.1e-4           1.1e-4        8.8e-3

    (with ``trend``; the running mean gave the same on the first two noises and 5.0e-3 on the
    third: the slope's noise widens the spread a little, which the heavy tail notices.)

    The z-test is heavier-tailed than a Gaussian one because beta 0.9 estimates the variance from
    about 19 effective values (the rates are close to a Student t with ~19 degrees of freedom);
    beta 0.99 is ten times quieter at the cost of slower adaptation to trends. ``min_ratio``
    is what keeps quiet signals (s=0.1) silent whatever the threshold.
    """

    name = "AnomalyZScore"
    #: ``held``: the log of last step's flagged value, held out of the history where ``holding``
    #: is 1 (finite both, so that a saved state is plain JSON)
    fields: ClassVar[dict[str, float]] = {
        "mean": 0.0,
        "mean2": 0.0,
        "var": 0.0,
        "count": 0.0,
        "held": 0.0,
        "holding": 0.0,
    }
    #: fields a state saved by an earlier version lacks (they start at their default, or as
    #: ``completed`` says)
    added_fields = ("held", "holding", "mean2")
    #: arguments an earlier version lacked: a state saved without them was made with ``trend``
    #: off, whose running mean starts the trend's smoothings (a slope of 0)
    added_args = ("trend",)
    #: ``update`` takes this rule's verdicts of the values (``flagged``)
    learns_from_verdicts = True
    #: smallest standard deviation of log|value| (5%), so constant signals do not alarm on noise.
    sigma_floor = 0.05
    #: smoothing of the forecast's level and slope with ``trend``: faster than the spread's, so
    #: that the forecast follows the bend where a fall levels off within a few steps
    TREND_BETA = 0.8

    def __init__(
        self,
        threshold: float = 6.0,
        ops: tuple[str, ...] = ("norm",),
        warmup: int = 10,
        beta: float = 0.9,
        min_ratio: float = 4.0,
        trend: bool = True,
    ) -> None:
        self.threshold = threshold
        self.ops = ops
        self.warmup = warmup
        self.beta = beta
        self.log_ratio = math.log(max(min_ratio, 1.0))
        self.trend = trend

    @staticmethod
    def completed(arrays: State, missing: set[str]) -> State:
        """A state saved by an earlier version, made whole: its running mean starts both smoothings."""
        if "mean2" in missing:
            arrays["mean2"] = arrays["mean"].copy()
        return arrays

    def _forecast(self, state: State) -> np.ndarray:
        """The log|value| expected next: Brown's level plus slope (``mean``, ``mean2``: the
        single and double smoothings), or the running mean without ``trend``."""
        if not self.trend:
            return state["mean"]
        return state["mean"] + (state["mean"] - state["mean2"]) / self.TREND_BETA

    def _correction(self, count: np.ndarray) -> np.ndarray | float:
        """Bias correction of the variance: count values gave count - 1 updates of total weight
        1 - beta**(count - 1); inf where there was none (the variance is 0 then). One power when all
        cells have seen the same number of values, the usual case.
        """
        low, high = (count.min(), count.max()) if count.size else (0.0, 0.0)
        updates = max(low - 1.0, 0.0) if low == high else np.maximum(count - 1.0, 0.0)
        correction = 1.0 - self.beta**updates
        return np.where(correction > 0, correction, np.inf) if low != high else correction or math.inf

    @staticmethod
    def _log(values: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(np.abs(values))

    def apply(
        self, values: np.ndarray, state: State, op_names: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        logs = self._log(values)
        level = self._forecast(state)
        change = logs - level
        var = state["var"] / self._correction(state["count"])
        sigma = np.maximum(np.sqrt(var), self.sigma_floor)
        vanished = _op_columns(("norm",), op_names) & (logs == -np.inf)  # a norm dropped to zero
        judged = (state["count"] >= self.warmup) & _op_columns(self.ops, op_names)
        if (vanished & judged).any():
            vanished &= above_rounding_noise(np.exp(level), judged, vanished)
        with np.errstate(invalid="ignore", over="ignore"):
            far_out = np.abs(change) > self.threshold * sigma
            rise = far_out & (change > self.log_ratio)
            drop = far_out & (-change > self.log_ratio) & judged
            quiet = -np.expm1(change) > self.threshold * sigma  # the share of the level lost
            lone = drop & ~quiet & (-change <= 2 * self.log_ratio)  # neither quiet nor 16x
            if lone.any():  # kept only where the record fell as a whole
                drop &= ~lone | (-_median_change(change, judged, lone.any(axis=0)) > self.log_ratio)
            mask = rise | drop | vanished
        mask &= (np.isfinite(logs) | vanished) & judged
        return mask, np.exp(level)

    def update(self, values: np.ndarray, state: State, flagged: np.ndarray | None = None) -> State:
        logs = self._log(values)
        finite = np.isfinite(logs)
        flagged = np.zeros(logs.shape, dtype=bool) if flagged is None else flagged & finite
        held = state.get("held", np.zeros(logs.shape))
        lasting = flagged & (state.get("holding", np.zeros(logs.shape)) > 0)  # flagged twice running
        state = self._fold(held, state, lasting)  # the held value first, then this one
        enter = finite & (~flagged | lasting)
        state = self._fold(logs, state, enter)
        holding = flagged & ~lasting
        state["held"] = np.where(holding, logs, 0.0)
        state["holding"] = holding.astype(np.float64)
        return state

    def _fold(self, logs: np.ndarray, state: State, where: np.ndarray) -> State:
        """The smoothings and the forecasts' error spread with ``logs`` folded in ``where``,
        elsewhere as they were."""
        fresh = state["count"] == 0
        rate = 1.0 - (self.TREND_BETA if self.trend else self.beta)
        with np.errstate(invalid="ignore"):
            error = logs - self._forecast(state)
            mean = np.where(fresh, logs, state["mean"] + rate * (logs - state["mean"]))
            mean2 = np.where(fresh, logs, state["mean2"] + rate * (mean - state["mean2"]))
            var = np.where(fresh, 0.0, self.beta * (state["var"] + (1.0 - self.beta) * error * error))
        return {
            "mean": np.where(where, mean, state["mean"]),
            "mean2": np.where(where, mean2, state["mean2"]),
            "var": np.where(where, var, state["var"]),
            "count": state["count"] + where,
        }


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
