"""Rule arguments: the table of each anomaly rule's arguments and their checks at config load.

Kept apart from the rules so that a config error names the key, the value and what was expected
before any rule object exists; ``rules.make_rule`` takes the normalised result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from monitor.config.schema import ConfigError
from monitor.config.values import unknown_key

#: ``semantics`` of AnomalyTurbulence: msprobe's later EMA rule (default) or 1.2.2's running mean.
TURBULENCE_SEMANTICS = ("later", "1.2.2")
#: largest integer rule argument (warm-up lengths); keeps comparisons within float range.
MAX_INT_ARG = 2**53

#: argument name -> (kind, lower bound) per rule; kinds: "number", "int", "ops", "bool", "semantics".
_ARGS: dict[str, dict[str, tuple[str, float]]] = {
    "AnomalyTurbulence": {
        "threshold": ("number", 0.0),
        "ops": ("ops", 0),
        "warmup": ("int", 1),
        "semantics": ("semantics", 0),
        "two_sided": ("bool", 0),
        "skip_nonfinite": ("bool", 0),
        "noise": ("number", 0.0),
        "floor": ("number", 0.0),
    },
    "AnomalyNan": {"threshold": ("number", 0.0)},
    "AnomalyZScore": {
        "threshold": ("number", 0.0),
        "ops": ("ops", 0),
        "warmup": ("int", 1),
        "beta": ("number", 0.0),
        "min_ratio": ("number", 1.0),
        "trend": ("bool", 0),
    },
}


def _shown(value: Any) -> str:
    """repr for an error message, shortened; never raises on an int too long to print."""
    try:
        text = repr(value)
    except ValueError:
        return f"{type(value).__name__} value too large to print"
    return text if len(text) <= 200 else text[:197] + "..."


def _check_arg(key: str, kind: str, low: float, value: Any, path: str) -> Any:
    """One argument, normalised; raises ConfigError naming ``path.key``, the value and what was expected."""
    from monitor.config.schema import KNOWN_OPS
    from monitor.datatypes.l2 import LINEAR_OPS, attention_ops

    if kind == "ops":
        judged = (*KNOWN_OPS, *attention_ops("all"), *LINEAR_OPS)  # the l2 features' columns too
        if not isinstance(value, (list, tuple)) or not value or any(op not in judged for op in value):
            choices = ", ".join(judged)
            raise ConfigError(
                f"{path}.ops: expected a non-empty list drawn from {choices}, got {_shown(value)}"
            )
        return tuple(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}.{key}: expected true or false, got {_shown(value)}")
        return value
    if kind == "semantics":
        if value not in TURBULENCE_SEMANTICS:
            choices = ", ".join(repr(s) for s in TURBULENCE_SEMANTICS)
            raise ConfigError(f"{path}.semantics: expected one of {choices}, got {_shown(value)}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_INT_ARG:
            raise ConfigError(
                f"{path}.{key}: expected an integer in [{int(low)}, {MAX_INT_ARG}], got {_shown(value)}"
            )
        return value
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            pass
    if not math.isfinite(number) or number < low:
        raise ConfigError(f"{path}.{key}: expected a number >= {low:g}, got {_shown(value)}")
    if key == "beta" and number >= 1:
        raise ConfigError(f"{path}.beta: expected a number in [0, 1), got {_shown(value)}")
    return number


def validate_rule_args(name: str, args: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Check a rule's ``args`` and return them normalised (raises ConfigError naming the key)."""
    known = _ARGS[name]
    result: dict[str, Any] = {}
    for key, value in args.items():
        if key not in known:
            raise unknown_key(f"{path}.{key}", key, tuple(known), f"unknown argument of {name}")
        result[key] = _check_arg(key, *known[key], value, path)
    if name == "AnomalyTurbulence":
        if "threshold" not in result:
            raise ConfigError(f"{path}.threshold: expected a number >= 0 for AnomalyTurbulence, got nothing")
        if result.get("semantics") == "1.2.2" and result.get("two_sided"):
            raise ConfigError(
                f"{path}.two_sided: expected false or absent with semantics '1.2.2' (its rule is "
                "one-sided by definition), got True"
            )
        for key in ("noise", "floor"):
            if result.get("semantics") == "1.2.2" and key in result:
                raise ConfigError(
                    f"{path}.{key}: expected absent with semantics '1.2.2' (msprobe 1.2.2's rule is kept "
                    f"exactly and has no {key}), got {_shown(result[key])}"
                )
    return result
