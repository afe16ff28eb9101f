"""Config loading and validation (monitor/config/schema.py) against msprobe's keys."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import yaml

import config_templates
import monitor
from monitor.anomaly.rules import AnomalyNan, AnomalyTurbulence, build_rules
from monitor.config.schema import ConfigError, MonitorConfig, load_config

TEMPLATE_DIR = Path(config_templates.__file__).parent
TEMPLATES = sorted(p for p in TEMPLATE_DIR.iterdir() if p.suffix in (".json", ".yaml"))


# --------------------------------------------------------------------------------------------- templates


def test_template_directory_is_not_empty():
    assert TEMPLATES, f"no *.json / *.yaml under {TEMPLATE_DIR}"


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_loads_without_warnings_and_collects_something(path, trainmon_log):
    config = load_config(path)
    assert isinstance(config, MonitorConfig)
    assert trainmon_log.at(logging.WARNING) == []
    collected = (
        "wg_distribution",
        "mv_distribution",
        "param_distribution",
        "xy_distribution",
        "mg_direction",
    )
    assert any(getattr(config, key) for key in collected)
    assert len(build_rules(config.alert.rules)) == len(config.alert.rules)
    json.dumps(config.to_dict())  # the plain form is JSON-serialisable


# --------------------------------------------------------------------------------------------- defaults

#: msprobe's defaults (later versions), as the plain dict form.
REFERENCE_DEFAULTS = {
    "targets": {},
    "dynamic_on": False,
    "start_step": 0,
    "collect_times": 100_000_000,
    "step_interval": 1,
    "print_struct": False,
    "module_ranks": [],
    "ur_distribution": False,
    "xy_distribution": False,
    "all_xy": False,
    "forward_only": False,
    "backward_only": False,
    "mv_distribution": False,
    "param_distribution": False,
    "wg_distribution": False,
    "monitor_mbs_grad": False,
    "mg_direction": False,
    "cc_distribution": {"enable": False, "cc_codeline": [], "cc_pre_hook": False, "cc_log_only": False},
    # non_finite, sinks, actions and bundle are ours: msprobe reports a NaN only when a configured rule
    # happens to flag it, and only on the console
    "alert": {"rules": [], "dump": False, "non_finite": True, "sinks": [], "actions": [], "bundle": None},
    "format": "csv",
    "ops": ["norm"],
    "eps": 1e-8,
    "ndigits": 6,
    "step_count_per_record": 1,
    "append_output": [],
    "squash_name": True,
    "stack_info": False,
    "l2_targets": {},
    "recording_l2_features": False,
    "sa_order": "s,b,h,d",
}


@pytest.mark.parametrize("key", sorted(REFERENCE_DEFAULTS))
def test_default_equals_reference(key):
    plain = load_config({}).to_dict()
    assert plain[key] == REFERENCE_DEFAULTS[key]
    assert type(plain[key]) is type(REFERENCE_DEFAULTS[key])


def test_a_bad_value_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"wg_distribution": true, "ops": ["norm", "l2"]}')
    with pytest.raises(ConfigError) as raised:
        load_config(str(path))
    assert str(raised.value).startswith(f"config file {str(path)!r}: ops[1]: expected one of")


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing configured\n")
    assert load_config(path) == MonitorConfig()


# --------------------------------------------------------------------------------------------- file formats

RICH = {
    "targets": {"layers.0": {}, "layers.1.mlp": {"input": "tensor"}},
    "wg_distribution": True,
    "xy_distribution": True,
    "ops": ["norm", "min", "max", "nans"],
    "eps": 1e-6,
    "ndigits": 8,
    "step_count_per_record": 5,
    "start_step": 3,
    "step_interval": 2,
    "collect_times": 40,
    "module_ranks": [1, 0],
    "format": "tensorboard",
    "cc_distribution": {"enable": True, "cc_codeline": ["train\\.py\\[\\d+\\]"]},
    "alert": {
        "rules": [
            {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
            {"rule_name": "AnomalyNan"},
        ],
        "dump": True,
    },
    "append_output": ["Dec03_21-34-40", "Dec04_01-00-00"],
}


def test_yaml_and_json_files_load_the_same_config(tmp_path):
    json_path = tmp_path / "cfg.json"
    yaml_path = tmp_path / "cfg.yaml"
    json_path.write_text(json.dumps(RICH))
    yaml_path.write_text(yaml.safe_dump(RICH))
    from_json, from_yaml = load_config(json_path), load_config(yaml_path)
    assert from_json == from_yaml
    assert from_json.to_dict() == from_yaml.to_dict()
    assert from_json.step_count_per_record == 5
    assert from_json.module_ranks == (0, 1)


def test_yml_extension_is_read_as_yaml(tmp_path):
    path = tmp_path / "cfg.yml"
    path.write_text("wg_distribution: true\nops: [norm, max]\n")
    config = load_config(path)
    assert config.wg_distribution is True
    assert config.ops == ("norm", "max")


def test_dict_and_file_load_the_same_config(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(RICH))
    assert load_config(path) == load_config(RICH)


# --------------------------------------------------------------------------------------------- immutability


def test_users_dict_is_not_mutated():
    raw = {
        "targets": {},
        "xy_distribution": True,
        "ops": ["norm", "shape", "dtype", "norm"],
        "module_ranks": ["1", 0],
        "cc_distribution": {"enable": True},
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1}}]},
    }
    before = copy.deepcopy(raw)
    load_config(raw)
    assert raw == before
    assert type(raw["alert"]["rules"][0]["args"]["threshold"]) is int


def test_users_file_is_not_changed(tmp_path):
    path = tmp_path / "cfg.json"
    text = json.dumps({"targets": {}, "ops": ["norm", "shape"], "dynamic_on": True})
    path.write_text(text)
    load_config(path)
    assert path.read_text() == text


def test_assigning_a_field_raises():
    config = load_config(RICH)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.step_interval = 7  # type: ignore[misc]
    assert config.step_interval == 2


def test_targets_cannot_be_mutated():
    config = load_config(RICH)
    with pytest.raises(TypeError):
        config.targets["layers.9"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        config.targets["layers.1.mlp"]["output"] = "tensor"  # type: ignore[index]
    assert set(config.targets) == {"layers.0", "layers.1.mlp"}


def test_alert_rules_cannot_be_mutated():
    config = load_config(RICH)
    with pytest.raises(AttributeError):
        config.alert.rules.append(config.alert.rules[0])  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        config.alert.rules[0].args["threshold"] = 9.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.alert.dump = False  # type: ignore[misc]
    assert config.alert.rules[0].args["threshold"] == 0.5
    assert len(config.alert.rules) == 2


def test_list_valued_fields_are_tuples():
    config = load_config(RICH)
    assert isinstance(config.ops, tuple)
    assert isinstance(config.module_ranks, tuple)
    assert isinstance(config.cc_distribution.cc_codeline, tuple)
    assert isinstance(config.append_output, tuple)


# --------------------------------------------------------------------------------------------- unknown keys


def test_misspelt_top_level_key_warns_once_with_closest_known_key(trainmon_log):
    config = load_config({"wg_distrbution": True})
    warnings = trainmon_log.at(logging.WARNING)
    assert len(warnings) == 1
    assert "wg_distrbution" in warnings[0]
    assert "'wg_distribution'" in warnings[0]
    assert config.wg_distribution is False


def test_unknown_key_far_from_every_known_key_warns_without_a_suggestion(trainmon_log):
    load_config({"zzzzzzzz": 1})
    warnings = trainmon_log.at(logging.WARNING)
    assert len(warnings) == 1
    assert "zzzzzzzz" in warnings[0]
    assert "did you mean" not in warnings[0]


def test_a_misspelt_alert_key_of_ours_is_refused_and_one_of_msprobes_warned(trainmon_log):
    """``alert.sink`` would leave every incident undelivered: refused at the door; a key close
    to msprobe's own (``rule``) may be one of its later releases': warned, as at the top level."""
    with pytest.raises(ConfigError, match=r"alert\.sink: unknown key .*; did you mean 'sinks'\?"):
        load_config({"alert": {"sink": [{"type": "file", "path": "x.jsonl"}]}})
    config = load_config({"alert": {"rule": [], "options": {}}})  # "options" is no typo of "actions"
    warnings = trainmon_log.at(logging.WARNING)
    assert len(warnings) == 2 and "'alert.rule' ignored; did you mean 'rules'?" in warnings[0], warnings
    assert config.alert.rules == ()


def test_sinks_that_no_incident_can_reach_are_warned_about(trainmon_log):
    load_config({"alert": {"non_finite": False, "sinks": [{"type": "file", "path": "x.jsonl"}]}})
    (warning,) = trainmon_log.at(logging.WARNING)
    assert "no incident can happen" in warning
    load_config({"alert": {"sinks": [{"type": "file", "path": "x.jsonl"}]}})  # NaN/Inf still alert
    assert len(trainmon_log.at(logging.WARNING)) == 1


def test_reference_internal_keys_do_not_warn(trainmon_log):
    load_config({"is_select": True, "opt_ty": "Megatron_DistributedOptimizer"})
    assert trainmon_log.at(logging.WARNING) == []


# --------------------------------------------------------------------------------------------- bad values

_TURB = "AnomalyTurbulence"

#: (id, raw config, text the message must contain: key path, text: the bad value)
BAD_CONFIGS = [
    ("step_interval_zero", {"step_interval": 0}, "step_interval", "got 0"),
    ("step_interval_string", {"step_interval": "2"}, "step_interval", "got '2'"),
    ("step_interval_fraction", {"step_interval": 2.5}, "step_interval", "got 2.5"),
    ("start_step_negative", {"start_step": -1}, "start_step", "got -1"),
    ("collect_times_zero", {"collect_times": 0}, "collect_times", "got 0"),
    ("mg_direction_string", {"mg_direction": "yes"}, "mg_direction", "got 'yes'"),
    ("wg_distribution_int", {"wg_distribution": 1}, "wg_distribution", "got 1"),
    ("format_unknown", {"format": "hdf5"}, "format", "got 'hdf5'"),
    ("ops_not_a_list", {"ops": "norm"}, "ops", "got 'norm'"),
    ("ops_misspelt", {"ops": ["norm", "nrom"]}, "ops[1]", "got 'nrom'; did you mean 'norm'?"),
    ("ops_upper_case", {"ops": ["NORM"]}, "ops[0]", "got 'NORM'; did you mean 'norm'?"),
    ("format_misspelt", {"format": "tensorbord"}, "format", "got 'tensorbord'; did you mean 'tensorboard'?"),
    (
        "rule_name_misspelt",
        {"alert": {"rules": [{"rule_name": "AnomalyZscore"}]}},
        "alert.rules[0].rule_name",
        "did you mean 'AnomalyZScore'?",
    ),
    (
        "rule_argument_misspelt",
        {"alert": {"rules": [{"rule_name": "AnomalyZScore", "args": {"treshold": 3}}]}},
        "alert.rules[0].args.treshold",
        "unknown argument of AnomalyZScore; expected one of threshold, ops, warmup, beta, min_ratio, trend; "
        "did you mean 'threshold'?",
    ),
    (
        "cc_key_misspelt",
        {"cc_distribution": {"enabel": True}},
        "cc_distribution.enabel",
        "unknown key; expected one of enable, cc_codeline, cc_pre_hook, cc_log_only; did you mean 'enable'?",
    ),
    ("l2_key_misspelt", {"l2_targets": {"attention_hok": []}}, "l2_targets.attention_hok", "'attention_hook"),
    (
        "rule_key_misspelt",
        {"alert": {"rules": [{"rule_name": "AnomalyZScore", "arg": {"threshold": 3}}]}},
        "alert.rules[0].arg",
        "unknown key; expected one of rule_name, args; did you mean 'args'?",
    ),
    ("eps_zero", {"eps": 0}, "eps", "got 0"),
    ("eps_string", {"eps": "small"}, "eps", "got 'small'"),
    ("ndigits_zero", {"ndigits": 0}, "ndigits", "got 0"),
    ("ndigits_too_many", {"ndigits": 40}, "ndigits", "got 40"),
    ("step_count_per_record_zero", {"step_count_per_record": 0}, "step_count_per_record", "got 0"),
    (
        "step_count_per_record_huge",
        {"step_count_per_record": 2_000_000},
        "step_count_per_record",
        "got 2000000",
    ),
    ("module_ranks_not_a_list", {"module_ranks": "0"}, "module_ranks", "got '0'"),
    ("module_ranks_negative", {"module_ranks": [0, -1]}, "module_ranks[1]", "got -1"),
    ("module_ranks_bool", {"module_ranks": [True]}, "module_ranks[0]", "got True"),
    (
        "threshold_string",
        {"alert": {"rules": [{"rule_name": _TURB, "args": {"threshold": "high"}}]}},
        "alert.rules[0].args.threshold",
        "got 'high'",
    ),
    (
        "threshold_negative",
        {"alert": {"rules": [{"rule_name": _TURB, "args": {"threshold": -1}}]}},
        "alert.rules[0].args.threshold",
        "got -1",
    ),
    (
        "threshold_missing",
        {"alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": _TURB}]}},
        "alert.rules[1].args.threshold",
        "got nothing",
    ),
    (
        "rule_name_unknown",
        {"alert": {"rules": [{"rule_name": "AnomalySpike", "args": {"threshold": 0.5}}]}},
        "alert.rules[0].rule_name",
        "got 'AnomalySpike'",
    ),
    (  # the bad "value" of an unknown key is its name, which the key path carries
        "rule_arg_unknown",
        {"alert": {"rules": [{"rule_name": _TURB, "args": {"threshold": 0.5, "bogus": 1}}]}},
        "alert.rules[0].args.bogus",
        "unknown argument",
    ),
    (
        "rule_ops_misspelt",
        {"alert": {"rules": [{"rule_name": _TURB, "args": {"threshold": 0.5, "ops": ["nrom"]}}]}},
        "alert.rules[0].args.ops",
        "got ['nrom']",
    ),
    (
        "zscore_beta_one",
        {"alert": {"rules": [{"rule_name": "AnomalyZScore", "args": {"beta": 1.0}}]}},
        "alert.rules[0].args.beta",
        "got 1.0",
    ),
    ("rules_not_a_list", {"alert": {"rules": "AnomalyNan"}}, "alert.rules", "got 'AnomalyNan'"),
    ("alert_dump_string", {"alert": {"rules": [], "dump": "yes"}}, "alert.dump", "got 'yes'"),
    (
        "cc_unknown_key",
        {"cc_distribution": {"enable": True, "bogus": 1}},
        "cc_distribution.bogus",
        "unknown key",
    ),
    (
        "cc_codeline_bad_regex",
        {"cc_distribution": {"enable": True, "cc_codeline": ["(unclosed"]}},
        "cc_distribution.cc_codeline[0]",
        "got '(unclosed'",
    ),
    ("targets_string", {"targets": "layers.0"}, "targets", "got 'layers.0'"),
    ("targets_value_not_object", {"targets": {"a": 3}}, "targets.a", "got 3"),
    (
        "forward_and_backward_only",
        {"forward_only": True, "backward_only": True},
        "forward_only, backward_only",
        "got both true",
    ),
    ("append_output_one_time", {"append_output": ["x"]}, "append_output", "got ['x']"),
    (
        "append_output_bad_time",
        {"append_output": ["Dec03_21-34-40", "yesterday"]},
        "append_output[1]",
        "got 'yesterday'",
    ),
    ("sa_order_unknown", {"sa_order": "h,s,b,d"}, "sa_order", "got 'h,s,b,d'"),
]


@pytest.mark.parametrize(
    ("raw", "path", "value"), [case[1:] for case in BAD_CONFIGS], ids=[case[0] for case in BAD_CONFIGS]
)
def test_bad_value_raises_config_error_naming_key_path_and_value(raw, path, value):
    with pytest.raises(monitor.ConfigError) as info:
        load_config(raw)
    message = str(info.value)
    assert path in message
    assert value in message


def test_config_error_is_a_value_error():
    assert issubclass(monitor.ConfigError, ValueError)


def _json_syntax_error(tmp_path: Path) -> Path:
    path = tmp_path / "syntax.json"
    path.write_text('{"wg_distribution": true,, }')
    return path


def _not_utf8(tmp_path: Path) -> Path:
    path = tmp_path / "latin1.json"
    path.write_bytes('{"targets": {"schicht\xe4": {}}}'.encode("latin-1"))
    return path


def _top_level_list(tmp_path: Path) -> Path:
    path = tmp_path / "list.json"
    path.write_text('[{"wg_distribution": true}]')
    return path


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "does_not_exist.json"


def _yaml_syntax_error(tmp_path: Path) -> Path:
    path = tmp_path / "syntax.yaml"
    path.write_text("ops: [norm, max\nwg_distribution: true\n")
    return path


@pytest.mark.parametrize(
    ("make_file", "detail"),
    [
        (_json_syntax_error, "not valid JSON"),
        (_not_utf8, "UTF-8"),
        (_top_level_list, "list"),
        (_missing, "cannot be read"),
        (_yaml_syntax_error, "not valid YAML"),
    ],
    ids=["json_syntax_error", "not_utf8", "top_level_list", "missing_file", "yaml_syntax_error"],
)
def test_bad_file_raises_config_error_naming_the_file(tmp_path, make_file, detail):
    path = make_file(tmp_path)
    with pytest.raises(monitor.ConfigError) as info:
        load_config(path)
    assert path.name in str(info.value)
    assert detail in str(info.value)


def test_uppercase_yaml_extension_syntax_error_says_yaml(tmp_path):
    path = tmp_path / "CFG.YAML"
    path.write_text("ops: [norm, max\n")
    with pytest.raises(monitor.ConfigError, match="not valid YAML"):
        load_config(path)


def test_a_yaml_error_names_its_place_without_quoting_the_file(tmp_path):
    """A token pasted where a variable's name belongs, in a line YAML cannot parse: the error
    must not carry it into the logs."""
    path = tmp_path / "config.yaml"
    path.write_text("alert:\n  sinks: [{type: webhook, headers_env: {Authorization: Bearer s3cr3t: x}}]\n")
    with pytest.raises(monitor.ConfigError) as info:
        load_config(path)
    assert "not valid YAML" in str(info.value) and "line 2, column" in str(info.value)
    assert "s3cr3t" not in str(info.value)


def test_module_ranks_superscript_digit_raises_config_error():
    with pytest.raises(monitor.ConfigError, match=r"module_ranks\[0\]"):
        load_config({"module_ranks": ["²"]})


def test_yaml_exponent_without_a_dot_is_a_number(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("eps: 1e-8\nalert:\n  rules:\n    - {rule_name: AnomalyNan, args: {threshold: 1e3}}\n")
    config = load_config(path)
    assert config.eps == 1e-8
    assert config.alert.rules[0].args["threshold"] == 1000.0


def test_append_output_impossible_time_raises_config_error():
    with pytest.raises(monitor.ConfigError, match=r"append_output\[0\]"):
        load_config({"append_output": ["Dec32_21-34-40", "Dec31_23-59-59"]})


# --------------------------------------------------------------------------------------------- leniency


def test_integer_threshold_is_accepted_as_float():
    config = load_config({"alert": {"rules": [{"rule_name": _TURB, "args": {"threshold": 1}}]}})
    threshold = config.alert.rules[0].args["threshold"]
    assert threshold == 1.0
    assert isinstance(threshold, float)
    (rule,) = build_rules(config.alert.rules)
    assert isinstance(rule, AnomalyTurbulence)
    assert rule.threshold == 1.0


def test_rule_without_args_is_accepted_for_anomaly_nan():
    config = load_config({"alert": {"rules": [{"rule_name": "AnomalyNan"}]}})
    (rule,) = build_rules(config.alert.rules)
    assert isinstance(rule, AnomalyNan)
    assert rule.threshold is None


def test_module_ranks_strings_are_accepted_as_ints():
    config = load_config({"module_ranks": ["0", "3", 1]})
    assert config.module_ranks == (0, 1, 3)
    assert all(type(rank) is int for rank in config.module_ranks)


def test_shape_and_dtype_ops_are_dropped_with_a_warning(trainmon_log):
    config = load_config({"ops": ["norm", "shape", "max", "dtype"]})
    assert config.ops == ("norm", "max")
    warnings = trainmon_log.at(logging.WARNING)
    assert len(warnings) == 2
    assert "'shape'" in warnings[0]
    assert "'dtype'" in warnings[1]


def test_only_ignored_ops_fall_back_to_norm():
    assert load_config({"ops": ["shape", "dtype"]}).ops == ("norm",)


def test_empty_ops_fall_back_to_norm_as_msprobe_and_say_so(caplog):
    assert load_config({"ops": []}).ops == ("norm",)
    assert "ops names no statistic; norm is recorded" in caplog.text


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.json", '{"ops": ["norm"], "wg_distribution": true, "ops": ["max"]}'),
        ("c.yaml", "ops: [norm]\nops: [max]\n"),
    ],
)
def test_a_key_given_twice_keeps_the_last_value_and_is_said(tmp_path, caplog, name, text):
    (tmp_path / name).write_text(text)
    assert load_config(tmp_path / name).ops == ("max",)
    assert "key 'ops' appears twice" in caplog.text


def test_duplicate_ops_are_kept_once_in_order():
    assert load_config({"ops": ["max", "norm", "max"]}).ops == ("max", "norm")


def test_integral_float_step_interval_is_accepted_as_int():
    config = load_config({"step_interval": 4.0})
    assert config.step_interval == 4
    assert type(config.step_interval) is int


def test_format_is_case_insensitive():
    assert load_config({"format": "TensorBoard"}).format == "tensorboard"


def test_targets_list_of_names_means_names_with_empty_specs():
    config = load_config({"targets": ["layers.0", "lm_head"]})
    assert dict(config.targets) == {"layers.0": {}, "lm_head": {}}


def test_mg_direction_is_validated_under_its_own_key():
    # msprobe 1.2.2 validates a key named "mg_distribution" instead, so "yes" enabled it.
    assert load_config({"mg_direction": True}).mg_direction is True
    with pytest.raises(monitor.ConfigError):
        load_config({"mg_direction": "yes"})


def test_sa_order_with_spaces_is_normalised():
    assert load_config({"sa_order": "b, s, h, d"}).sa_order == "b,s,h,d"


def test_existing_monitor_config_is_returned_unchanged():
    config = load_config(RICH)
    assert load_config(config) is config


def test_plain_dict_form_loads_back_to_the_same_config():
    config = load_config(RICH)
    assert load_config(config.to_dict()) == config


def test_a_config_pickles_and_deep_copies_to_an_equal_one(monkeypatch):
    """Trainers copy their callbacks (Lightning's ddp_spawn pickles them into each process, a
    deepcopy of a trainer's arguments): the config's read-only mappings must survive both."""
    import copy
    import pickle

    monkeypatch.setenv("TRAINMON_TEST_TOKEN", "t")
    raw = {
        "targets": {"layers.0": {"input": "tensor"}},
        "l2_targets": {"attention_hook": ["attn"], "linear_hook": []},
        "alert": {
            "sinks": [{"type": "webhook", "url": "http://x", "headers_env": {"A": "TRAINMON_TEST_TOKEN"}}]
        },
        "ops": ["norm", "nans"],
    }
    config = load_config(raw)
    for twin in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert twin == config and twin.to_dict() == config.to_dict()
        assert dict(twin.targets["layers.0"]) == {"input": "tensor"}
