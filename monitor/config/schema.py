"""Every config key, its default and its validation, in one place.

Reads msprobe's JSON config files (and YAML by extension). The result is an immutable
MonitorConfig; the user's dict and file are never changed. Wrong types and ranges raise
ConfigError naming the key path, the bad value and what was expected; an unknown top-level or
``alert`` key gets one warning naming the closest known key (a config shared with msprobe may
hold keys of its other versions), an unknown key inside another section is an error.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from monitor.alerts.config import BundleSpec, SinkSpec
from monitor.config.alert_section import AlertConfig, RuleSpec, parse_alert
from monitor.config.files import read_config_file
from monitor.config.values import (
    ConfigError,
    as_bool,
    as_int,
    as_number,
    as_rank_list,
    as_str_list,
    as_time_range,
    describe,
    not_one_of,
    unknown_key,
    warn,
    warn_unknown,
)

#: statistics a config may ask for, in msprobe's spelling.
KNOWN_OPS = ("min", "max", "norm", "zeros", "nans", "mean", "id")
#: later msprobe versions always add these; they are not scalars, so we accept and ignore them.
IGNORED_OPS = ("shape", "dtype")
FORMATS = ("csv", "tensorboard", "parquet", "api")
#: anomaly rules known to the config; the rule classes live in monitor.anomaly.rules.
CC_KEYS = ("enable", "cc_codeline", "cc_pre_hook", "cc_log_only")
L2_HOOK_KEYS = ("linear_hook", "attention_hook")
L2_HEAD_CHOICES = ("first", "all", "each")
DEFAULT_COLLECT_TIMES = 100_000_000


@dataclass(frozen=True)
class CCConfig:
    """``cc_distribution``: monitoring of torch.distributed collectives."""

    enable: bool = False
    cc_codeline: tuple[str, ...] = ()
    cc_pre_hook: bool = False
    cc_log_only: bool = False


@dataclass(frozen=True)
class MonitorConfig:
    """The validated, immutable configuration. Field names are the config keys."""

    #: module or parameter names to monitor -> per-module I/O formats; empty = everything.
    targets: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    #: with DYNAMIC_MONITOR=true, switch collection on by editing the file.
    dynamic_on: bool = False
    #: first step eligible for collection.
    start_step: int = 0
    #: number of collected steps, after which every hook is removed.
    collect_times: int = DEFAULT_COLLECT_TIMES
    #: collect when (step - start_step) % step_interval == 0.
    step_interval: int = 1
    #: dump the module I/O structure after the first step.
    print_struct: bool = False
    #: ranks that monitor; empty = all ranks.
    module_ranks: tuple[int, ...] = ()
    #: Adam update / ratio distributions.
    ur_distribution: bool = False
    #: module inputs/outputs (forward) and their gradients (backward).
    xy_distribution: bool = False
    all_xy: bool = False
    forward_only: bool = False
    backward_only: bool = False
    #: Adam exp_avg / exp_avg_sq.
    mv_distribution: bool = False
    #: parameter values before (param_origin) and after (param_updated) the update.
    param_distribution: bool = False
    #: weight gradients before (grad_unreduced) and after (grad_reduced) data-parallel reduction.
    wg_distribution: bool = False
    #: unreduced gradient of every micro-batch instead of once per step.
    monitor_mbs_grad: bool = False
    #: share of elements whose gradient sign agrees with exp_avg.
    mg_direction: bool = False
    #: sharded optimizers (ZeRO, Megatron distributed): merge the ranks' pieces so every row is
    #: the whole tensor (one all_gather per data type per collected step); ours, not msprobe's.
    shard_reduce: bool = False
    cc_distribution: CCConfig = field(default_factory=CCConfig)
    alert: AlertConfig = field(default_factory=AlertConfig)
    #: output format: csv, tensorboard, parquet or api (in memory).
    format: str = "csv"
    #: statistics computed for every monitored tensor.
    ops: tuple[str, ...] = ("norm",)
    #: |x| < eps counts as zero for the ``zeros`` op.
    eps: float = 1e-8
    #: significant digits written to CSV (not decimal places: small values stay visible).
    ndigits: int = 6
    #: steps per CSV file.
    step_count_per_record: int = 1
    #: resume into per-rank directories whose time tag lies in [t0, t1].
    append_output: tuple[str, ...] = ()
    #: shorten names the way msprobe's later versions do.
    squash_name: bool = True
    stack_info: bool = False
    l2_targets: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    recording_l2_features: bool = False
    sa_order: str = "s,b,h,d"
    #: l2 attention features: batch 0's first head (msprobe's), all heads summarised, or each head; ours.
    l2_heads: str = "first"

    def to_dict(self, for_outputs: bool = False) -> dict[str, Any]:
        """A plain, JSON-serialisable dict of the config (for dynamic rewrites; ``for_outputs``:
        for the run's files, webhook URLs cut to scheme and host)."""
        return _plain(self, for_outputs)

    def fingerprint(self) -> int:
        """A checksum of what decides which tensors are measured when (the ranks of one run
        compare theirs): every setting but how the results are written and alerted."""
        collected = {k: v for k, v in self.to_dict().items() if k not in _WRITING_KEYS}
        return zlib.crc32(json.dumps(collected, sort_keys=True, default=str).encode())

    def __reduce__(self) -> tuple:
        """Pickled (and deep-copied) as its plain dict, validated again when loaded: its read-only
        mappings cannot be pickled themselves."""
        return (load_config, (self.to_dict(),))


#: settings of how results are written and alerted, which may differ between ranks
_WRITING_KEYS = frozenset({"format", "ndigits", "step_count_per_record", "append_output", "alert"})


def _plain(value: Any, for_outputs: bool) -> Any:
    if isinstance(value, (MonitorConfig, AlertConfig, CCConfig, RuleSpec)):
        return {f.name: _plain(getattr(value, f.name), for_outputs) for f in fields(value)}
    if isinstance(value, SinkSpec):
        return value.to_dict(for_outputs)
    if isinstance(value, BundleSpec):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v, for_outputs) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v, for_outputs) for v in value]
    return value


_TOP_LEVEL_KEYS = tuple(f.name for f in fields(MonitorConfig))
_BOOL_KEYS = tuple(f.name for f in fields(MonitorConfig) if f.type == "bool")


def load_config(source: str | os.PathLike | Mapping[str, Any] | MonitorConfig) -> MonitorConfig:
    """Load and validate a config from a JSON/YAML file path, a dict or an existing MonitorConfig.

    Raises:
        ConfigError: the file cannot be read or parsed, or a value is invalid.
    """
    if isinstance(source, MonitorConfig):
        return source
    if isinstance(source, Mapping):
        return validate_config(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config: expected a file path or a dict, got {type(source).__name__}")
    raw = read_config_file(source)
    try:
        return validate_config(raw)
    except ConfigError as exc:  # which file, as errors reading it say
        raise ConfigError(f"config file {os.fspath(source)!r}: {exc}") from None


def validate_config(raw: Mapping[str, Any]) -> MonitorConfig:
    """Validate a raw config dict (not modified) into a MonitorConfig."""
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"config: keys must be strings, got {key!r}")
        if key not in _TOP_LEVEL_KEYS and key not in ("is_select", "opt_ty"):
            warn_unknown(key, _TOP_LEVEL_KEYS, "")
    values: dict[str, Any] = {}
    for key in _BOOL_KEYS:
        if key in raw:
            values[key] = as_bool(raw[key], key)
    if raw.get("targets") is not None:  # an empty YAML key loads as None: the default
        values["targets"] = _targets(raw["targets"])
    for key, low in (("start_step", 0), ("collect_times", 1), ("step_interval", 1)):
        if key in raw:
            values[key] = as_int(raw[key], key, low)
    if "module_ranks" in raw:
        values["module_ranks"] = as_rank_list(raw["module_ranks"], "module_ranks")
    if "cc_distribution" in raw:
        values["cc_distribution"] = _cc(raw["cc_distribution"])
    if raw.get("alert") is not None:
        values["alert"] = parse_alert(raw["alert"])
    if "format" in raw:
        fmt = raw["format"]
        if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
            raise not_one_of("format", fmt, FORMATS)
        values["format"] = fmt.lower()
    if "ops" in raw:
        values["ops"] = _ops(raw["ops"])
    if "eps" in raw:
        values["eps"] = as_number(raw["eps"], "eps", positive=True)
    if "ndigits" in raw:
        values["ndigits"] = as_int(raw["ndigits"], "ndigits", 1, 17)
    if "step_count_per_record" in raw:
        values["step_count_per_record"] = as_int(
            raw["step_count_per_record"], "step_count_per_record", 1, 1_000_000
        )
    if "append_output" in raw:
        values["append_output"] = as_time_range(raw["append_output"], "append_output")
    if "l2_targets" in raw:
        values["l2_targets"] = _l2_targets(raw["l2_targets"])
    if "sa_order" in raw:
        order = raw["sa_order"]
        normalised = order.replace(" ", "") if isinstance(order, str) else None
        if normalised not in ("s,b,h,d", "b,s,h,d"):
            raise ConfigError(f"sa_order: expected 's,b,h,d' or 'b,s,h,d', got {describe(order)}")
        values["sa_order"] = normalised
    if "l2_heads" in raw:
        if raw["l2_heads"] not in L2_HEAD_CHOICES:
            raise not_one_of("l2_heads", raw["l2_heads"], L2_HEAD_CHOICES)
        values["l2_heads"] = raw["l2_heads"]
    if values.get("shard_reduce") and values.get("module_ranks"):
        raise ConfigError(
            "shard_reduce, module_ranks: expected module_ranks empty with shard_reduce (every rank of the "
            f"data-parallel group takes part in its collective), got {list(values['module_ranks'])}"
        )
    if values.get("alert", AlertConfig()).actions and values.get("module_ranks"):
        raise ConfigError(
            "alert.actions, module_ranks: expected module_ranks empty with actions (every rank takes "
            f"part in agreeing on the step to act at), got {list(values['module_ranks'])}"
        )
    if values.get("forward_only") and values.get("backward_only"):
        raise ConfigError(
            "forward_only, backward_only: expected at most one of them to be true, got both true"
        )
    return MonitorConfig(**values)


def _targets(value: Any) -> Mapping[str, Mapping[str, Any]]:
    if isinstance(value, list):  # a plain list of names is accepted as {name: {}}
        value = {name: {} for name in as_str_list(value, "targets")}
    if not isinstance(value, dict):
        raise ConfigError(
            f"targets: expected an object mapping module names to objects, got {describe(value)}"
        )
    result = {}
    for name, spec in value.items():
        if not isinstance(name, str):
            raise ConfigError(f"targets: expected string keys, got {describe(name)}")
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise ConfigError(f"targets.{name}: expected an object (use {{}}), got {describe(spec)}")
        for direction, fmt in spec.items():
            if direction not in ("input", "output", "input_grad", "output_grad"):
                raise ConfigError(
                    f"targets.{name}.{direction}: expected one of input, output, input_grad, output_grad"
                )
            if not isinstance(fmt, str):
                raise ConfigError(
                    f"targets.{name}.{direction}: expected a format string, got {describe(fmt)}"
                )
        result[name] = MappingProxyType(dict(spec))
    return MappingProxyType(result)


def _cc(value: Any) -> CCConfig:
    if not isinstance(value, dict):
        raise ConfigError(f"cc_distribution: expected an object, got {describe(value)}")
    for key in value:
        if key not in CC_KEYS:
            raise unknown_key(f"cc_distribution.{key}", key, CC_KEYS)
    return CCConfig(
        enable=as_bool(value.get("enable", False), "cc_distribution.enable"),
        cc_codeline=_codelines(value.get("cc_codeline", [])),
        cc_pre_hook=as_bool(value.get("cc_pre_hook", False), "cc_distribution.cc_pre_hook"),
        cc_log_only=as_bool(value.get("cc_log_only", False), "cc_distribution.cc_log_only"),
    )


def _codelines(value: Any) -> tuple[str, ...]:
    lines = as_str_list(value, "cc_distribution.cc_codeline")
    for i, pattern in enumerate(lines):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(
                f"cc_distribution.cc_codeline[{i}]: expected a regular expression, got {pattern!r} ({exc})"
            ) from None
    return lines


def _ops(value: Any) -> tuple[str, ...]:
    ops = as_str_list(value, "ops")
    chosen = []
    for i, op in enumerate(ops):
        if op in IGNORED_OPS:
            warn("ops[%d] %r is not a scalar statistic and is ignored", i, op)
            continue
        if op not in KNOWN_OPS:
            raise not_one_of(f"ops[{i}]", op, KNOWN_OPS)
        if op not in chosen:
            chosen.append(op)
    if not chosen:
        warn("ops names no statistic; norm is recorded, as msprobe does")
    return tuple(chosen) or ("norm",)


def _l2_targets(value: Any) -> Mapping[str, tuple[str, ...]]:
    if not isinstance(value, dict):
        raise ConfigError(f"l2_targets: expected an object, got {describe(value)}")
    result = {}
    for key, names in value.items():
        if key not in L2_HOOK_KEYS:
            raise unknown_key(f"l2_targets.{key}", key, L2_HOOK_KEYS)
        result[key] = as_str_list(names, f"l2_targets.{key}")
    return MappingProxyType(result)
