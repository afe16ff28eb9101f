"""Anomaly rules: small objects that turn a step's values and their history into a mask.

A rule holds its parameters; its history lives in arrays (rows = tags, columns = ops) that the
detector keeps per data type and hands back each step:

* ``fields``: the state arrays the rule needs, with their initial fill value;
* ``apply(values, state, op_names) -> (mask, baseline)`` evaluates a whole step at once;
* ``update(values, state) -> state`` folds the step into the history (pure: new arrays).

NaN and Inf never enter a history, so one bad step never poisons a baseline (spec W22).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from monitor.config import ConfigError

#: ops whose value is a count of NaN elements: any count above zero is a NaN signal.
COUNT_OPS = ("nans",)
State = dict[str, np.ndarray]


def _op_columns(ops: tuple[str, ...], op_names: tuple[str, ...]) -> np.ndarray:
    return np.array([op in ops for op in op_names], dtype=bool)[None, :]


class AnomalyTurbulence:
    """``|value| > ema * (1 + threshold)``, where ema is the EMA (beta 0.99) of past |values|.

    msprobe's later semantics, initialised by the first value. Opt-in extras: ``warmup`` (values
    seen before any verdict, default 1) and ``ops`` (default norm and mean).
    """

    name = "AnomalyTurbulence"
    fields: ClassVar[dict[str, float]] = {"ema": 0.0, "count": 0.0}
    beta = 0.99

    def __init__(self, threshold: float, ops: tuple[str, ...] = ("norm", "mean"), warmup: int = 1) -> None:
        self.threshold = threshold
        self.ops = ops
        self.warmup = warmup

    def apply(
        self, values: np.ndarray, state: State, op_names: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(invalid="ignore"):
            mask = np.abs(values) > state["ema"] * (1.0 + self.threshold)
        return mask & (state["count"] >= self.warmup) & _op_columns(self.ops, op_names), state["ema"]

    def update(self, values: np.ndarray, state: State) -> State:
        magnitude = np.abs(values)
        finite = np.isfinite(magnitude)
        fresh = state["count"] == 0
        blended = np.where(fresh, magnitude, self.beta * state["ema"] + (1.0 - self.beta) * magnitude)
        return {"ema": np.where(finite, blended, state["ema"]), "count": state["count"] + finite}


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
        mask = ~np.isfinite(values) | (counts & (values > 0))
        if self.threshold is not None:
            with np.errstate(invalid="ignore"):
                mask |= ~counts & (np.abs(values) > self.threshold)
        return mask, np.full(values.shape, np.nan if self.threshold is None else self.threshold)

    def update(self, values: np.ndarray, state: State) -> State:
        return state


class AnomalyZScore:
    """Robust two-sided rule for heavy-tailed, trending signals such as gradient norms.

    Works on log|value|: keeps an exponentially weighted mean and variance (``beta``, default
    0.9) and flags a value whose z-score exceeds ``threshold`` (default 6) once ``warmup``
    values (default 10) were seen, provided it also differs from the running level by at least
    ``min_ratio`` (default 5x) in either direction. Zero, NaN and Inf never enter the history.
    A step that is flagged still enters it, so one spike is reported once, not at every step
    of its echo in the optimizer's moments.
    """

    name = "AnomalyZScore"
    fields: ClassVar[dict[str, float]] = {"mean": 0.0, "var": 0.0, "count": 0.0}
    #: smallest standard deviation of log|value| (5%), so constant signals do not alarm on noise.
    sigma_floor = 0.05

    def __init__(
        self,
        threshold: float = 6.0,
        ops: tuple[str, ...] = ("norm",),
        warmup: int = 10,
        beta: float = 0.9,
        min_ratio: float = 5.0,
    ) -> None:
        self.threshold = threshold
        self.ops = ops
        self.warmup = warmup
        self.beta = beta
        self.log_ratio = math.log(max(min_ratio, 1.0))

    @staticmethod
    def _log(values: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(np.abs(values))

    def apply(
        self, values: np.ndarray, state: State, op_names: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        logs = self._log(values)
        deviation = np.abs(logs - state["mean"])
        sigma = np.maximum(np.sqrt(state["var"]), self.sigma_floor)
        with np.errstate(invalid="ignore"):
            mask = (deviation > self.threshold * sigma) & (deviation > self.log_ratio) & np.isfinite(logs)
        mask &= (state["count"] >= self.warmup) & _op_columns(self.ops, op_names)
        return mask, np.exp(state["mean"])

    def update(self, values: np.ndarray, state: State) -> State:
        logs = self._log(values)
        finite = np.isfinite(logs)
        fresh = state["count"] == 0
        delta = logs - state["mean"]
        mean = np.where(fresh, logs, state["mean"] + (1.0 - self.beta) * delta)
        var = np.where(fresh, 0.0, self.beta * (state["var"] + (1.0 - self.beta) * delta * delta))
        return {
            "mean": np.where(finite, mean, state["mean"]),
            "var": np.where(finite, var, state["var"]),
            "count": state["count"] + finite,
        }


RULES: dict[str, type] = {cls.name: cls for cls in (AnomalyTurbulence, AnomalyNan, AnomalyZScore)}

#: argument name -> (kind, lower bound) per rule; kinds: "number", "int", "ops".
_ARGS: dict[str, dict[str, tuple[str, float]]] = {
    "AnomalyTurbulence": {"threshold": ("number", 0.0), "ops": ("ops", 0), "warmup": ("int", 1)},
    "AnomalyNan": {"threshold": ("number", 0.0)},
    "AnomalyZScore": {
        "threshold": ("number", 0.0),
        "ops": ("ops", 0),
        "warmup": ("int", 1),
        "beta": ("number", 0.0),
        "min_ratio": ("number", 1.0),
    },
}


def validate_rule_args(name: str, args: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Check a rule's ``args`` and return them normalised (raises ConfigError naming the key)."""
    from monitor.config import KNOWN_OPS

    known = _ARGS[name]
    result: dict[str, Any] = {}
    for key, value in args.items():
        if key not in known:
            raise ConfigError(f"{path}.{key}: unknown argument of {name}; expected one of {', '.join(known)}")
        kind, low = known[key]
        if kind == "ops":
            if not isinstance(value, list) or not value or any(op not in KNOWN_OPS for op in value):
                raise ConfigError(
                    f"{path}.ops: expected a non-empty list drawn from {', '.join(KNOWN_OPS)}, got {value!r}"
                )
            result[key] = tuple(value)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{path}.{key}: expected an integer >= {int(low)}, got {value!r}")
            result[key] = value
        else:
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < low
            ):
                raise ConfigError(f"{path}.{key}: expected a number >= {low:g}, got {value!r}")
            if key == "beta" and value >= 1:
                raise ConfigError(f"{path}.beta: expected a number in [0, 1), got {value!r}")
            result[key] = float(value)
    if name == "AnomalyTurbulence" and "threshold" not in result:
        raise ConfigError(f"{path}.threshold: expected a number >= 0 for AnomalyTurbulence, got nothing")
    return result


def build_rules(specs: tuple) -> list:
    """Instantiate the configured rules (specs already validated by the config)."""
    return [RULES[spec.rule_name](**dict(spec.args)) for spec in specs]
