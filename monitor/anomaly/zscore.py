"""AnomalyZScore: a two-sided rule on the log of a value against its forecast, for trending,
heavy-tailed signals such as gradient norms (the rule the recommended template uses)."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from monitor.anomaly.rule_cells import State, above_rounding_noise, op_columns


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
    share of the level lost, 0 to 1, exceeds ``threshold`` times the relative spread, once
    2 x ``warmup`` values made that spread worth trusting), at least
    ``min_ratio`` squared (16x), or shared (the record's tensors fell by ``min_ratio`` in the
    median: clipping of an exploded gradient, a cut loss scale). Drops are held to more because
    the logarithm stretches them without bound: the norm of a tensor of a few elements that
    nearly cancel (a bias gradient of a small classifier head on one rank) falls 5x on its own
    now and then, which is noise, yet a log z-score of 6. Zero, NaN and Inf never enter the history; a
    ``norm`` that drops to exactly zero after such a history is flagged (a layer whose gradients
    died; mg_direction's share of agreeing signs is no size and not judged: ``judges_shares``),
    unless its level was rounding noise (``above_rounding_noise``: the gradient of a weight that
    the data leaves mathematically at zero, about 1e-9 where the others are 1e-2, now and then
    rounds to exactly zero).
    A flagged value is held out of the history for a step: when the next value is flagged too,
    the change lasts and both enter (the level and spread learn it, so its echo in the
    optimizer's moments is reported at two steps, not at every step); when the next value is
    back, the spike was alone and never enters (its forecast enters in its place, so that the
    forecast moves on along a trend), so the same fault a few steps later is seen again (entered
    at once, a 1000x spike widened the spread enough to hide a repeat for about 15 steps).

    False positives on a stationary signal (100 tags x 10,000 steps of i.i.d. noise, measured by
    ``benchmarks/anomaly_rules.py``; rate = flagged / judged values):

    args                                   lognormal s=0.1  lognormal s=0.5  log-t3 s=0.5
    defaults (threshold 6, min_ratio 4)                  0           5.0e-6        3.8e-3
    min_ratio 5                                          0           5.0e-6        3.7e-3
    threshold 4                                          0           5.0e-4        1.2e-2
    threshold 4, min_ratio 1                        1.1e-3           1.1e-3        1.5e-2
    threshold 3, min_ratio 1                        1.3e-2           1.3e-2        4.3e-2
    threshold 4, min_ratio 1, beta 0.99             1.1e-4           1.1e-4        8.8e-3

    (with ``trend``; the running mean gave 4.5e-4 for threshold 4 on the second noise, the same
    elsewhere on the first two, and 5.0e-3, 4.7e-3, 1.4e-2, 1.9e-2, 5.2e-2 and 1.2e-2 on the
    third.) The forecast's slope is noisy on a flat signal, so the forecasts' errors spread a
    little more than the values (1.06 times their log-sd, against 0.95 for the running mean): on
    a flat lognormal signal of log-sd 0.5 a spike must be about 24x, not 17x, to reach 6 spreads.
    That is the price of seeing a spike of 30x at all on a norm that falls fast.

    The z-test is heavier-tailed than a Gaussian one because beta 0.9 estimates the variance from
    about 19 effective values (the rates are close to a Student t with ~19 degrees of freedom);
    beta 0.99 is ten times quieter, its spread slower to follow a signal whose noise changes
    (with ``trend``, ``beta`` sets the spread alone; the forecast follows the level at
    TREND_BETA). ``min_ratio`` is what keeps quiet signals (s=0.1) silent whatever the threshold.
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
    #: a rule of sizes on a log scale: mg_direction's share of gradient signs that agree with
    #: Adam's momentum is no size (a fast-learning model's overshoot takes it from 0.9 to 0.02
    #: in a step, in clean runs), so the detector leaves those records to the non-finite check
    judges_shares = False
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

    def _slope(self, state: State) -> np.ndarray | float:
        """The forecast's change per step (0 without ``trend``)."""
        if not self.trend:
            return 0.0
        return (state["mean"] - state["mean2"]) * (1.0 - self.TREND_BETA) / self.TREND_BETA

    def _forecast(self, state: State, ahead: np.ndarray | float = 1.0) -> np.ndarray:
        """The log|value| expected ``ahead`` steps after the last one folded in: Brown's level
        plus slope (``mean``, ``mean2``: the single and double smoothings), or the running mean
        without ``trend``."""
        if not self.trend:
            return state["mean"]
        return state["mean"] + (state["mean"] - state["mean2"]) + ahead * self._slope(state)

    def _advanced(self, state: State, where: np.ndarray) -> State:
        """The smoothings a step on where a held-out spike's step passed without entering: its
        forecast folded in its place, which moves both by one slope."""
        step = np.where(where, self._slope(state), 0.0)
        return {**state, "mean": state["mean"] + step, "mean2": state["mean2"] + step}

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
        level = self._forecast(state, 1.0 + state["holding"])  # past a held-out spike's step too
        change = logs - level
        var = state["var"] / self._correction(state["count"])
        sigma = np.maximum(np.sqrt(var), self.sigma_floor)
        vanished = op_columns(("norm",), op_names) & (logs == -np.inf)  # a norm dropped to zero
        judged = (state["count"] >= self.warmup) & op_columns(self.ops, op_names)
        if (vanished & judged).any():
            vanished &= above_rounding_noise(np.exp(level), judged, vanished)
        with np.errstate(invalid="ignore", over="ignore"):
            far_out = np.abs(change) > self.threshold * sigma
            rise = far_out & (change > self.log_ratio)
            drop = far_out & (-change > self.log_ratio) & judged
            # the share of the level lost, against a spread of enough values to be trusted: in
            # the steps just after warm-up a smooth history (a clipped gradient) reads as quiet
            quiet = (-np.expm1(change) > self.threshold * sigma) & (state["count"] >= 2 * self.warmup)
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
        was_holding = state.get("holding", np.zeros(logs.shape)) > 0
        lasting = flagged & was_holding  # flagged twice running
        state = self._fold(held, state, lasting)  # the held value first, then this one
        enter = finite & (~flagged | lasting)
        state = self._advanced(state, enter & was_holding & ~lasting)  # a lone spike's step, skipped
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
