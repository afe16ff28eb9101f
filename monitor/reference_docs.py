"""The generated parts of the documentation, so that they cannot drift from the code.

- the table of config keys in docs/configuration.md: every key of ``MonitorConfig`` (and of its
  ``alert`` and ``cc_distribution`` sections) with its real default, and its meaning from
  ``MEANINGS`` below (a test fails when a key has none or a meaning has no key);
- the side-by-side table of config keys in docs/migrating-from-msprobe.md: each key's default
  here and what msprobe does differently, from ``MSPROBE_DIFFERENCES`` below;
- docs/cli.md: the help of ``trainmon`` and each of its commands, from the argparse parser.

``python -m monitor.reference_docs`` rewrites them from the code; a test checks that the
committed files say the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

from monitor.config.schema import MonitorConfig

#: config key (``section.key`` inside ``alert`` / ``cc_distribution``) -> what it does.
MEANINGS = {
    "targets": (
        "module or parameter names to monitor (empty: everything; parameters that do not require "
        "a gradient, frozen ones, are never selected: they have no gradient or moments and do not "
        "change). A key selects a name exactly or as a dotted prefix on a name boundary: "
        "`layers.1` selects `layers.1.mlp.weight` but not `layers.10.*`. Raw, squashed and "
        "`N:`-prefixed spellings match; a leading `module.` (DDP), like PEFT's `base_model.model.` "
        "around a LoRA model, is optional, in the key as in the name (a config written for a "
        "wrapped run selects the same modules without the wrapper). A plain list of names is "
        "accepted too. A key that names no module or parameter of the model is warned about at "
        "attach, with the closest name where one is close (else how to list them: print_struct)."
    ),
    "wg_distribution": (
        "weight gradients: `grad_unreduced` (each rank's local gradient, accumulated over the "
        "step's micro-batches, before data-parallel reduction) and `grad_reduced` (what the "
        "optimizer sees)"
    ),
    "monitor_mbs_grad": (
        "`grad_unreduced` per micro-batch (that micro-batch's own gradient), with a `micro_step` column"
    ),
    "mv_distribution": "Adam `exp_avg`, `exp_avg_sq` (any optimizer whose state has those keys)",
    "param_distribution": "`param_origin` (before the update) and `param_updated` (after)",
    "mg_direction": (
        "share of elements whose gradient sign agrees with `exp_avg` (before this step's update; "
        "1.0 at the first step), a zero on either side counting half, as msprobe's formula has it "
        "(a NaN's sign is 0, as torch.sign gives it: a gradient all NaN reads 0.5, its NaN is said by "
        "its own rows); in the `other` files"
    ),
    "ur_distribution": (
        "TensorBoard histograms of Adam's update and of m/sqrt(v) (bias-corrected where the optimizer "
        "corrects) per parameter (format `tensorboard` only)"
    ),
    "ops": (
        "any of `min`, `max`, `norm`, `mean`, `zeros`, `nans`, `id`; unknown names are an error; "
        "`shape`/`dtype` (later msprobe) are accepted and ignored. `id` is the value of a one-element "
        "tensor and NaN (no value; msprobe writes none) for any other, never an anomaly by itself"
    ),
    "eps": "`zeros` is the share of elements with `|x| < eps`",
    "format": (
        "`csv`, `tensorboard`, `parquet` (the dataset's long rows, live) or "
        "`api` (in memory, no statistics files; `alert.dump` still writes the anomaly files), in any "
        "case; anything else is an error"
    ),
    "ndigits": (
        "**significant digits** in CSV (msprobe rounds to decimal places, so every `exp_avg_sq` prints 0.0)"
    ),
    "step_count_per_record": "steps per CSV file (Parquet merges its files per 100 steps)",
    "start_step": "first step eligible for collection",
    "step_interval": (
        "collect when `(step - start_step) % step_interval == 0` (0 is an error, not a ZeroDivisionError)"
    ),
    "collect_times": "collected steps, after which the hooks are removed (must be >= 1; see The API above)",
    "module_ranks": (
        "ranks that monitor (empty: all); other ranks attach nothing and write nothing. Strings "
        'such as `"0"` are accepted.'
    ),
    "squash_name": (
        "shorten names like msprobe's later versions (`module.decoder.layers.3.mlp.weight` -> "
        "`layers.3.mlp.weight`), except that a name starting with a keyword stays whole "
        "(`layers.0.norm2.weight`, which msprobe collapses to a colliding `norm2.weight`)"
    ),
    "alert.rules": ('list of `{"rule_name": ..., "args": {...}}`, see [anomalies.md](anomalies.md)'),
    "alert.dump": "write `anomaly_detected/rank{R}/anomaly.json` and `incidents.json`",
    "alert.non_finite": "ours: a NaN/Inf statistic is an anomaly whatever the rules",
    "alert.sinks": "ours: where each new incident is sent (webhook, command, file); [alerts.md](alerts.md)",
    "alert.actions": "ours: `checkpoint`, `stop`, `skip_step` on every rank at once; [alerts.md](alerts.md)",
    "alert.bundle": "ours: `{incidents, max_mb}`: evidence of the first incidents; [alerts.md](alerts.md)",
    "append_output": (
        '`[t0, t1]` (`"Dec03_21-34-40"`): resume into this rank\'s existing directory with a time '
        "tag in range; a new one is made (with a warning) when none matches"
    ),
    "xy_distribution": (
        "module activations: `actv` (inputs/outputs, forward) and `actv_grad` (their gradients, "
        "backward), see below"
    ),
    "all_xy": (
        "with `xy_distribution`, every submodule; otherwise the modules named exactly in "
        "`targets` (or every module when `targets` is empty)"
    ),
    "forward_only": "only `actv` (no `actv_grad`); with `backward_only` too it is an error",
    "backward_only": "only `actv_grad` (no `actv`)",
    "print_struct": (
        "write the module structure after the first step and stop the run with `monitor.StructurePrinted`"
    ),
    "stack_info": "write `stack_info.csv` (each module's call stack) once, at the first collected step",
    "dynamic_on": ('with `DYNAMIC_MONITOR=true`: collect while the file says true, see "Live control"'),
    "shard_reduce": (
        "ours: with sharded parameters or optimizers, merge the ranks' pieces so each row is the "
        "whole tensor (one all_gather per data type per collected step); under tensor parallelism "
        "also activations and unreduced gradients, and the spectral norms of FSDP and DTensor weights. "
        "Every rank must collect the same: with sharded parameters set_monitor compares the configs "
        "(all but format, ndigits, step_count_per_record, append_output and alert) and refuses ones "
        "that differ"
    ),
    "cc_distribution.enable": (
        "statistics of the tensors passing through torch.distributed collectives, see "
        "[distributed.md](distributed.md)"
    ),
    "cc_distribution.cc_codeline": "only the call sites whose stack matches one of these patterns",
    "cc_distribution.cc_pre_hook": "also the inputs before each call",
    "cc_distribution.cc_log_only": "log each distinct collective once and stop at the first optimizer step",
    "l2_targets": (
        "msprobe's l2 features: `attention_hook` and `linear_hook` module lists (empty linear list: "
        "every linear layer), see [configuration.md](configuration.md#l2-features)"
    ),
    "recording_l2_features": "msprobe's l2 features: attention entropy and softmax max, linear spectral norm",
    "sa_order": 'layout of the attention module\'s Q and K: `"s,b,h,d"` or `"b,s,h,d"`',
    "l2_heads": 'ours: attention heads of batch 0: `"first"` (msprobe\'s), `"all"` summarised, `"each"`',
}

#: config key -> what msprobe's monitor does with it where trainmon differs ("" where it is the
#: same; None where the key is trainmon's own), for the side-by-side table of the migration page.
MSPROBE_DIFFERENCES: dict[str, str | None] = {
    "targets": "a plain string prefix (`layers.1` also selects `layers.10`); a dict only",
    "dynamic_on": "`false` does not stop a collection that is running; later releases ignore `start_step`",
    "start_step": "",
    "collect_times": "1.2.2 collects one step for a value <= 0",
    "step_interval": "1.2.2 raises ZeroDivisionError at the first step for 0",
    "print_struct": "",
    "module_ranks": "integers on PyTorch, strings on MindSpore 1.2.2 (both accepted here)",
    "ur_distribution": "PyTorch only",
    "xy_distribution": "1.2.2 tags the gradients `actv`, like the forward values",
    "all_xy": "",
    "forward_only": "with `backward_only` too: a warning and no activation hooks (here an error)",
    "backward_only": "",
    "mv_distribution": "the rows of step N are the moments before its update (one step behind)",
    "param_distribution": "1.2.2: `param`, before the update only",
    "wg_distribution": "",
    "monitor_mbs_grad": "later releases only; not under FSDP",
    "mg_direction": 'never validated: any value, `"yes"` included, switches it on',
    "shard_reduce": None,
    "cc_distribution.enable": "",
    "cc_distribution.cc_codeline": "",
    "cc_distribution.cc_pre_hook": "",
    "cc_distribution.cc_log_only": "",
    "alert.rules": "`AnomalyTurbulence` (later also `AnomalyNan`); here also `AnomalyZScore`",
    "alert.dump": "`anomaly.json` only (here also `incidents.json`)",
    "alert.non_finite": None,
    "alert.sinks": None,
    "alert.actions": None,
    "alert.bundle": None,
    "format": "no `parquet`; an unknown value falls back to `csv` with a logged error (here an error)",
    "ops": "unknown names are dropped with a warning (here an error); later releases add `shape`, `dtype`",
    "eps": "",
    "ndigits": "decimal places, not significant digits",
    "step_count_per_record": "",
    "append_output": "1.2.2 crashes where a rank has no directory in the range (here: a new one, warned)",
    "squash_name": "can collapse two names into one",
    "stack_info": "later releases only",
    "l2_targets": "later releases only",
    "recording_l2_features": "later releases only; at every step, whatever `step_interval` says",
    "sa_order": "later releases only; spaces pass the check, then the layout is treated as unsupported",
    "l2_heads": None,
}

#: columns of the generated help text
HELP_WIDTH = 96
BEGIN, END = "<!-- generated: config keys -->", "<!-- end of generated config keys -->"
SIDE_BEGIN = "<!-- generated: keys side by side -->"
SIDE_END = "<!-- end of generated keys side by side -->"


def config_keys() -> dict[str, object]:
    """Every config key with its default, in the order of ``MonitorConfig``'s fields."""
    defaults = MonitorConfig().to_dict()
    keys: dict[str, object] = {}
    for field in fields(MonitorConfig):
        value = getattr(MonitorConfig(), field.name)
        if is_dataclass(value):
            for inner, default in defaults[field.name].items():
                keys[f"{field.name}.{inner}"] = default
        else:
            keys[field.name] = defaults[field.name]
    return keys


def config_table() -> str:
    """The markdown table of config keys, defaults and meanings (in ``MEANINGS``' order)."""
    defaults = config_keys()
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, meaning in MEANINGS.items():
        lines.append(f"| `{key}` | `{json.dumps(defaults[key])}` | {meaning} |")
    return "\n".join(lines)


def side_by_side_table() -> str:
    """The migration page's table: each key, whether msprobe reads it, trainmon's default, and
    what msprobe does differently (in ``MEANINGS``' order)."""
    defaults = config_keys()
    lines = ["| key | trainmon's default | in msprobe |", "|---|---|---|"]
    for key in MEANINGS:
        difference = MSPROBE_DIFFERENCES[key]
        said = "**trainmon only**" if difference is None else difference or "the same"
        lines.append(f"| `{key}` | `{json.dumps(defaults[key])}` | {said} |")
    return "\n".join(lines)


def _help(parser: argparse.ArgumentParser) -> str:
    """The parser's help at a fixed width (not the terminal's), so the page is the same anywhere."""
    formatter = parser.formatter_class
    parser.formatter_class = lambda prog: formatter(prog, width=HELP_WIDTH)
    try:
        return parser.format_help().rstrip()
    finally:
        parser.formatter_class = formatter


def cli_page(parser: argparse.ArgumentParser) -> str:
    """docs/cli.md: the help of the command and of each subcommand."""
    parts = [
        "# Command line",
        "",
        "Generated from the command's own parser (`python -m monitor.reference_docs`); `trainmon "
        "COMMAND --help` prints the same.",
        "",
        "```text",
        _help(parser),
        "```",
    ]
    parts += _subcommand_sections(parser, "trainmon", "##")
    return "\n".join(parts) + "\n"


def _subcommand_sections(parser: argparse.ArgumentParser, prog: str, level: str) -> list[str]:
    """A section with the help of each subcommand of ``parser``, and of theirs one level down
    (``trainmon bundle show``)."""
    if parser._subparsers is None:
        return []
    parts = []
    for action in parser._subparsers._group_actions:  # argparse keeps subcommands only here
        for name, command in action.choices.items():
            parts += ["", f"{level} {prog} {name}", "", "```text", _help(command), "```"]
            parts += _subcommand_sections(command, f"{prog} {name}", level + "#")
    return parts


def with_config_table(text: str) -> str:
    """``text`` (docs/configuration.md) with its generated table replaced by the current one."""
    return _with_generated(text, BEGIN, END, config_table())


def with_side_by_side_table(text: str) -> str:
    """``text`` (docs/migrating-from-msprobe.md) with its generated table replaced by the current one."""
    return _with_generated(text, SIDE_BEGIN, SIDE_END, side_by_side_table())


def _with_generated(text: str, begin: str, end: str, table: str) -> str:
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def main() -> int:
    """Rewrite the generated parts of docs/ from the code."""
    from monitor.cli import build_parser

    docs = Path(__file__).resolve().parents[1] / "docs"
    configuration = docs / "configuration.md"
    configuration.write_text(with_config_table(configuration.read_text(encoding="utf-8")), encoding="utf-8")
    migrating = docs / "migrating-from-msprobe.md"
    migrating.write_text(with_side_by_side_table(migrating.read_text(encoding="utf-8")), encoding="utf-8")
    (docs / "cli.md").write_text(cli_page(build_parser()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
