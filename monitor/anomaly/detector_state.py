"""The layout of a Detector's saved history: the rules' identities, their state arrays and the
norm levels, checked against the rules configured now so that a resumed job keeps its baselines
only when they were made by the same rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

#: layout version of Detector.state_dict().
STATE_VERSION = 1


def rule_identities(rules: list) -> list[dict[str, Any]]:
    """Each rule's class and parameters as plain data, to tell whether a saved state fits."""

    def plain(value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    return [
        {"rule": type(rule).__name__, "args": {k: plain(v) for k, v in sorted(vars(rule).items())}}
        for rule in rules
    ]


def same_rules(saved: Any, rules: list) -> bool:
    """Whether a state's rule identities are those of ``rules``, where an argument a rule gained
    since (``added_args``) and absent from the saved identity reads as the earlier behaviour's."""
    configured = rule_identities(rules)
    if not isinstance(saved, list) or len(saved) != len(configured):
        return False
    for old, rule, new in zip(saved, rules, configured):
        if not isinstance(old, dict) or not isinstance(old.get("args"), dict):
            return False
        added = {k for k in getattr(rule, "added_args", ()) if k not in old["args"]}
        if old != {**new, "args": {k: v for k, v in new["args"].items() if k not in added}}:
            return False
    return True


def state_arrays(rule: Any, saved: Mapping[str, Any], tags: int, ops: int) -> dict[str, np.ndarray]:
    """One rule's saved arrays, checked against its fields and the tag table; a field the rule
    gained since states were first saved (``added_fields``) starts at its default, or as the
    rule's ``completed`` says."""
    missing = set(rule.fields) - set(saved)
    if (
        not set(saved) <= set(rule.fields)
        or missing - set(getattr(rule, "added_fields", ()))
        or (rule.fields and not saved)
    ):
        raise ValueError(
            f"{type(rule).__name__} state has fields {sorted(saved)}, expected {sorted(rule.fields)}"
        )
    first = np.array(next(iter(saved.values())), dtype=np.float64) if saved else np.zeros((0, ops))
    rows = first.shape[0] if first.ndim == 2 else 0
    arrays = {}
    for name in rule.fields:
        array = np.array(saved.get(name, np.full((rows, ops), rule.fields[name])), dtype=np.float64)
        if array.size == 0:
            array = array.reshape(0, ops)
        if array.ndim != 2 or array.shape[1] != ops or array.shape[0] > tags:
            raise ValueError(
                f"{type(rule).__name__}.{name} has shape {array.shape}, expected (<= {tags}, {ops})"
            )
        arrays[name] = array
    completed = getattr(rule, "completed", None)
    return completed(arrays, missing) if completed is not None and missing else arrays


def saved_levels(saved: Mapping[str, Any], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A data type's saved (level, count) arrays, checked against its tag table's length (they
    may be shorter: levels grow only with records that hold a norm)."""
    level = np.asarray(saved["level"], dtype=np.float64)
    count = np.asarray(saved["count"], dtype=np.float64)
    if level.ndim != 1 or level.shape != count.shape or len(level) > rows:
        raise ValueError(f"norm levels of {level.shape} / {count.shape} for {rows} tags")
    return level, count
