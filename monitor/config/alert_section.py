"""The ``alert`` section of a config: the anomaly rules, the dump, and trainmon's own sinks,
actions and evidence bundles."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from monitor.alerts.config import BundleSpec, SinkSpec, parse_actions, parse_bundle, parse_sinks
from monitor.config.values import ConfigError, as_bool, describe, kind_of, unknown_key, warn, warn_unknown

KNOWN_RULES = ("AnomalyTurbulence", "AnomalyNan", "AnomalyZScore")
ALERT_KEYS = ("rules", "dump", "non_finite", "sinks", "actions", "bundle")
#: the keys of ``alert`` that msprobe does not have: a key close to one of them is a typo of ours
OWN_ALERT_KEYS = ("non_finite", "sinks", "actions", "bundle")


@dataclass(frozen=True)
class RuleSpec:
    """One ``alert.rules`` entry: the rule's name and its arguments."""

    rule_name: str
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class AlertConfig:
    """``alert``: anomaly rules, whether anomalies are dumped to the anomaly files, and whether a
    NaN/Inf statistic is an anomaly whatever the rules (``non_finite``, default true), and where
    incidents are sent and what the run does about them."""

    rules: tuple[RuleSpec, ...] = ()
    dump: bool = False
    non_finite: bool = True
    #: where each new incident is sent (``monitor.alerts``); ours, not msprobe's.
    sinks: tuple[SinkSpec, ...] = ()
    #: what the run does on an incident (``checkpoint``, ``stop``); ours, not msprobe's.
    actions: tuple[str, ...] = ()
    #: evidence bundles of the first incidents (None: none); ours, not msprobe's.
    bundle: BundleSpec | None = None


def parse_alert(value: Any) -> AlertConfig:
    """The ``alert`` section, checked: an unknown key is warned about (msprobe's later releases
    may add keys there), one closest to a key of ours refused (``alert.sink`` would leave every
    incident undelivered); sinks, actions or bundles no incident can reach are said."""
    if not isinstance(value, dict):
        raise ConfigError(
            f"alert: expected an object with 'rules', 'dump', 'sinks'..., got {describe(value)}"
        )
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"alert: keys must be strings, got {describe(key)}")
        close = difflib.get_close_matches(key.lower(), ALERT_KEYS, n=1, cutoff=0.8)
        if key not in ALERT_KEYS and close and close[0] in OWN_ALERT_KEYS:
            raise unknown_key(
                f"alert.{key}",
                key,
                ALERT_KEYS,
                "unknown key (a misspelt key of ours would leave alerts going nowhere)",
            )
        if key not in ALERT_KEYS:  # msprobe's later releases may add keys there
            warn_unknown(key, ALERT_KEYS, "alert.")
    rules_raw = value.get("rules", [])
    if not isinstance(rules_raw, list):
        raise ConfigError(f"alert.rules: expected a list of rules, got {describe(rules_raw)}")
    rules = tuple(_rule(spec, f"alert.rules[{i}]") for i, spec in enumerate(rules_raw))
    alert = AlertConfig(
        rules=rules,
        dump=as_bool(value.get("dump", False), "alert.dump"),
        non_finite=as_bool(value.get("non_finite", True), "alert.non_finite"),
        sinks=parse_sinks(value.get("sinks", [])),
        actions=parse_actions(value.get("actions", [])),
        bundle=parse_bundle(value.get("bundle")),
    )
    if not rules and not alert.non_finite and (alert.sinks or alert.actions or alert.bundle):
        warn(
            "alert: no rules and non_finite false: no incident can happen, so alert.sinks, "
            "alert.actions and alert.bundle never act; add a rule or leave non_finite on"
        )
    return alert


def _rule(spec: Any, path: str) -> RuleSpec:
    from monitor.anomaly.rule_args import validate_rule_args

    name = kind_of(spec, path, "rule_name", KNOWN_RULES, "an object with 'rule_name' (and optional 'args')")
    for key in spec:
        if key not in ("rule_name", "args"):  # a misspelt "args" would drop the rule's arguments
            raise unknown_key(f"{path}.{key}", str(key), ("rule_name", "args"))
    args = spec.get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{path}.args: expected an object, got {describe(args)}")
    return RuleSpec(name, MappingProxyType(validate_rule_args(name, args, f"{path}.args")))
