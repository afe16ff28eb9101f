"""The anomaly analysis CLI: ordering, both record formats, filtering, output and bad input."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from monitor.anomaly import analyse
from monitor.anomaly.analyse import collect, find_anomaly_files, main, parse_step_list, write_atomic
from monitor.anomaly.ordering import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    PARAMETERS,
    STAGE_NAMES,
    UNKNOWN,
    AnomalyRecord,
    TopK,
    parse_record,
    select_records,
    sort_key,
    stage_of,
    stage_of_task,
    top_k,
)

REPO = Path(__file__).resolve().parents[2]


def rec(tag: str, step: int = 0, **fields) -> AnomalyRecord:
    """A record with a message naming its tag and op."""
    op = fields.setdefault("op", "norm")
    rank = fields.pop("rank", 0)
    message = fields.pop(
        "message", f"Rule AnomalyTurbulence reports anomaly signal in ('{tag}', '{op}') at step {step}."
    )
    return AnomalyRecord(rank, step, tag, message, **fields)


TABLE_HEADER = ["#", "rank", "step", "micro_step", "stage", "tag", "op", "value", "baseline", "rule"]


def tags(records: list[AnomalyRecord]) -> list[str]:
    return [r.tag_name for r in records]


def ours(rank: int, step: int, tag: str, op: str = "norm", call_id: int = 0, **extra) -> tuple[str, dict]:
    """(key, record) in trainmon's anomaly.json format."""
    record = {
        "rank": rank,
        "step": step,
        "micro_step": 0,
        "pp_stage": 0,
        "vpp_stage": int(tag.split(":", 1)[0]) if ":" in tag else 0,
        "call_id": call_id,
        "tag_name": tag,
        "op": op,
        "value": 123.4,
        "baseline": 1.2,
        "rule": "AnomalyTurbulence",
        "message": f"Rule AnomalyTurbulence reports anomaly signal in ('{tag}', '{op}') at step {step}, "
        f"current value 123.4, history mean 1.2.",
        "group_mates": [0, 1],
    }
    record.update(extra)
    return f"{tag}_{op}_step_{step}_call_{call_id}", record


def reference(rank: int, step: int, tag: str, op: str = "min", call_id: int = 0) -> tuple[str, dict]:
    """(key, record) in msprobe 1.2.2's anomaly.json format (no op/value/rule fields)."""
    record = {
        "rank": rank,
        "step": step,
        "micro_step": 0,
        "pp_stage": 0,
        "vpp_stage": 0,
        "call_id": call_id,
        "tag_name": tag,
        "message": f"Rule AnomalyTurbulence reports anomaly signal in ('{tag}', '{op}') at step {step}.",
        "group_mates": [0],
    }
    return f"{tag}_step_{step}_call_{call_id}", record


def write_rank(root: Path, name: str, content: dict | list | bytes) -> Path:
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "anomaly.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(json.dumps(content, indent=1), encoding="utf-8")
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """rank0 in trainmon's format, rank1 in msprobe's format, steps 1 and 2."""
    root = tmp_path / "anomaly_detected"
    write_rank(
        root,
        "rank0",
        dict(
            [
                ours(0, 2, "0:layers.0.fc.weight/rank0/acc_grad", call_id=5),
                ours(0, 1, "0:layers.0.fc.weight/rank0/exp_avg", call_id=9),
                ours(0, 1, "0:layers.0.fc.weight/rank0/exp_avg", op="max", call_id=9),
                ours(0, 1, "0:layers.0.fc.output:0/rank0/actv", call_id=2),
            ]
        ),
    )
    write_rank(
        root,
        "rank1",
        dict(
            [
                reference(1, 1, "0:layers.0.fc.weight/rank1/acc_grad", op="min", call_id=4),
                reference(1, 2, "0:layers.0.fc.output:0/rank1/actv", op="norm", call_id=1),
            ]
        ),
    )
    return root


def output(directory: Path) -> dict:
    return json.loads((directory / "anomaly_analyse.json").read_text(encoding="utf-8"))


def assert_usage_error(capsys: pytest.CaptureFixture, rc: int, text: str) -> None:
    err = capsys.readouterr().err
    assert rc == 2
    assert text in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------- ordering


@pytest.mark.parametrize(
    ("task", "stage"),
    [
        ("actv", FORWARD),
        ("actv_grad", BACKWARD),
        ("pre_grad", BACKWARD),
        ("acc_grad", BACKWARD),
        ("post_grad", BACKWARD),
        ("pre_0", BACKWARD),
        ("post_12", BACKWARD),
        ("exp_avg", OPTIMIZER),
        ("exp_avg_sq", OPTIMIZER),
        ("mg_direction", OPTIMIZER),
        ("param_origin", PARAMETERS),
        ("param_updated", OPTIMIZER),
        ("qkt", FORWARD),  # attention's entropy, from the forward's queries and keys
        ("sr", PARAMETERS),  # a linear layer's spectral norm, of the weight the step started from
        ("future_task", UNKNOWN),
        ("post_x", UNKNOWN),
        ("", UNKNOWN),
    ],
)
def test_stage_of_task(task: str, stage: int) -> None:
    assert stage_of_task(task) == stage


def test_forward_before_backward_before_optimizer_whatever_the_call_id() -> None:
    records = [
        rec("0:fc.weight/rank0/exp_avg", call_id=0),
        rec("0:fc.weight/rank0/acc_grad", call_id=1),
        rec("0:fc.output:0/rank0/actv", call_id=2),
    ]
    assert tags(sorted(records, key=sort_key)) == [
        "0:fc.output:0/rank0/actv",
        "0:fc.weight/rank0/acc_grad",
        "0:fc.weight/rank0/exp_avg",
    ]


def test_step_then_micro_step_come_first() -> None:
    late_forward = rec("0:fc.output:0/rank0/actv", step=3)
    early_optimizer = rec("0:fc.weight/rank0/exp_avg", step=2)
    micro1_forward = rec("0:fc.output:1/rank0/actv", step=2, micro_step=1)
    micro0_backward = rec("0:fc.weight:0/rank0/acc_grad", step=2, micro_step=0)  # monitor_mbs_grad
    ranked = sorted([late_forward, micro1_forward, early_optimizer, micro0_backward], key=sort_key)
    assert ranked == [micro0_backward, micro1_forward, early_optimizer, late_forward]


def test_local_gradients_summed_over_the_step_rank_after_its_last_micro_step() -> None:
    """Without monitor_mbs_grad the local gradient is the step's sum, measured at its last
    micro-batch: its record carries micro-step 0 (its tag names none), yet a NaN that micro-batch
    1's forward made reaches it, so it must not rank before that forward."""
    summed = rec("0:fc.weight/rank0/acc_grad", step=2, micro_step=0, call_id=7)
    megatron_summed = rec("0:fc.weight/rank0/pre_grad", step=2, micro_step=0, call_id=7)
    micro1_forward = rec("0:fc.output:1/rank0/actv", step=2, micro_step=1, call_id=3)
    micro1_backward = rec("0:fc.output:1/rank0/actv_grad", step=2, micro_step=1, call_id=5)
    reduced = rec("0:fc.weight/rank0/post_grad", step=2, call_id=9)
    ranked = sorted([reduced, megatron_summed, summed, micro1_backward, micro1_forward], key=sort_key)
    assert ranked[:2] == [micro1_forward, micro1_backward] and ranked[-1] == reduced


def test_a_steps_parameters_rank_before_its_micro_steps_and_its_update_after_them() -> None:
    """Records of the whole step carry micro-step 0: the parameters it starts from are the cause
    of all that follows; reduced gradients and the optimizer's come after the last micro-step."""
    origin = rec("0:fc.weight/rank0/param_origin", step=2)
    forward = rec("0:.input:0/rank0/actv", step=2)
    later_micro = rec("0:.input:1/rank0/actv", step=2, micro_step=1)
    reduced = rec("0:fc.weight/rank0/post_grad", step=2)
    updated = rec("0:fc.weight/rank0/param_updated", step=2)
    ranked = sorted([updated, reduced, later_micro, forward, origin], key=sort_key)
    assert ranked == [origin, forward, later_micro, reduced, updated]
    assert STAGE_NAMES[stage_of(origin)] == "parameters"


def test_pipeline_stages_run_forward_in_order_and_backward_reversed() -> None:
    fwd = [rec("fc.output:0/rank0/actv", pp_stage=p, vpp_stage=v) for v in (1, 0) for p in (1, 0)]
    ranked = [(r.vpp_stage, r.pp_stage) for r in sorted(fwd, key=sort_key)]
    assert ranked == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for task in ("acc_grad", "exp_avg"):
        bwd = [rec(f"fc.weight/rank0/{task}", pp_stage=p, vpp_stage=v) for v in (0, 1) for p in (0, 1)]
        ranked = [(r.vpp_stage, r.pp_stage) for r in sorted(bwd, key=sort_key)]
        assert ranked == [(1, 1), (1, 0), (0, 1), (0, 0)], task


def test_call_id_then_rank_break_ties() -> None:
    a = rec("0:fc.weight/rank3/acc_grad", rank=3, call_id=1)
    b = rec("0:fc.weight/rank1/acc_grad", rank=1, call_id=1)
    c = rec("0:fc.weight/rank2/acc_grad", rank=2, call_id=0)
    assert sorted([a, b, c], key=sort_key) == [c, b, a]
    for task in ("post_0", "actv", "exp_avg", "unknown"):
        same_tag = [rec(f"fc/{task}", rank=r) for r in (2, 0, 1)]
        assert [r.rank for r in sorted(same_tag, key=sort_key)] == [0, 1, 2], task


def test_unknown_tasks_sort_after_known_stages_of_their_step() -> None:
    unknown = rec("0:attn.attention:0/rank0/future_task", step=1, call_id=0)
    bare = rec("0:fc.weight", step=1, call_id=0)
    optimizer = rec("0:fc.weight/rank0/exp_avg_sq", step=1, call_id=99)
    next_step = rec("0:fc.output:0/rank0/actv", step=2)
    ranked = sorted([next_step, unknown, bare, optimizer], key=sort_key)
    assert ranked[0] is optimizer
    assert {id(r) for r in ranked[1:3]} == {id(unknown), id(bare)}
    assert ranked[3] is next_step


def test_order_is_deterministic_under_input_permutation() -> None:
    rng = random.Random(7)
    task_names = ("actv", "actv_grad", "acc_grad", "exp_avg", "post_0", "qkt")
    records = [
        rec(
            f"{rng.randrange(2)}:m{rng.randrange(3)}/rank{rank}/{rng.choice(task_names)}",
            step=rng.randrange(3),
            rank=rank,
            micro_step=rng.randrange(2),
            pp_stage=rng.randrange(2),
            vpp_stage=rng.randrange(2),
            call_id=rng.randrange(4),
            op=rng.choice(("norm", "min")),
            message=f"m{rng.randrange(3)}",
        )
        for rank in (rng.randrange(4) for _ in range(300))
    ]
    expected = sorted(records, key=sort_key)
    expected_keys = [sort_key(r) for r in expected]
    assert len(set(expected_keys)) < len(expected_keys)  # some records tie on every key field
    for seed in range(10):
        shuffled = records[:]
        random.Random(seed).shuffle(shuffled)
        assert [sort_key(r) for r in sorted(shuffled, key=sort_key)] == expected_keys
        assert [sort_key(r) for r in top_k(shuffled, 17)] == expected_keys[:17]
        stream = TopK(17, chunk=5)
        for i in range(0, len(shuffled), 7):
            stream.extend(shuffled[i : i + 7])
        assert [sort_key(r) for r in stream.result()] == expected_keys[:17]


def test_top_k_selects_the_k_earliest_and_rejects_k_below_one() -> None:
    records = [rec("fc/rank0/actv", step=s) for s in (5, 3, 9, 1, 7)]
    assert [r.step for r in top_k(records, 2)] == [1, 3]
    assert [r.step for r in top_k(records, 50)] == [1, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="k must be >= 1"):
        top_k(records, 0)


def test_select_records_is_deterministic_under_document_permutation() -> None:
    items = [
        ours(0, 1, "0:fc/rank0/actv", message=f"message {i % 4}", value=float(i)) for i in range(12)
    ]  # all records tie on every field but the message (and value)
    expected = [r.message for r in select_records({f"{i}": r for i, (_, r) in enumerate(items)}, 5).records]
    assert expected == ["message 0"] * 3 + ["message 1"] * 2
    for seed in range(5):
        random.Random(seed).shuffle(items)
        document = {f"{i}": record for i, (_, record) in enumerate(items)}
        assert [r.message for r in select_records(document, 5).records] == expected


def test_select_records_matches_top_k_of_parsed_records() -> None:
    rng = random.Random(3)
    document = dict(
        ours(
            rng.randrange(3),
            rng.randrange(4),
            f"0:l{i % 5}/rank0/{rng.choice(('actv', 'exp_avg'))}",
            call_id=i,
        )
        for i in range(200)
    )
    parsed = [parse_record(v) for v in document.values()]
    in_steps = [r for r in parsed if r.step in {1, 2}]
    selection = select_records(document, 10, frozenset({1, 2}))
    assert selection.records == top_k(in_steps, 10)
    assert (selection.valid, selection.selected, selection.bad_keys) == (200, len(in_steps), [])


# -------------------------------------------------------------------------------------------- reading


def test_our_format_is_read_with_op_value_and_non_finite_strings() -> None:
    _, record = ours(3, 30, "0:layers.0.attn.weight/rank3/acc_grad", op="max", call_id=12, value="nan")
    parsed = parse_record(record)
    assert parsed is not None
    assert (parsed.rank, parsed.step, parsed.call_id, parsed.op, parsed.rule) == (
        3,
        30,
        12,
        "max",
        "AnomalyTurbulence",
    )
    assert math.isnan(parsed.value) and parsed.baseline == 1.2
    assert parsed.group_mates == (0, 1)


def test_reference_format_gets_op_and_rule_from_the_message() -> None:
    _, record = reference(0, 1, "0:0.fc2.bias/rank0/acc_grad", op="min", call_id=4)
    parsed = parse_record(record)
    assert parsed is not None
    assert (parsed.op, parsed.rule, parsed.value, parsed.call_id) == ("min", "AnomalyTurbulence", None, 4)
    later = dict(
        record,
        message="Rule AnomalyNan reports anomaly signal in ('t/rank0/actv', 'norm') at step 1, "
        "current value inf, history mean 0.5.",
    )
    parsed = parse_record(later)
    assert (parsed.op, parsed.rule, parsed.value, parsed.baseline) == ("norm", "AnomalyNan", math.inf, 0.5)
    explicit = parse_record(dict(later, value=7.0, baseline=None))  # fields win over the message
    assert (explicit.op, explicit.value, explicit.baseline) == ("norm", 7.0, None)


def test_optional_fields_default_when_absent() -> None:
    parsed = parse_record({"rank": 2, "step": 5, "tag_name": "x/rank2/actv", "message": "free text"})
    assert parsed == AnomalyRecord(2, 5, "x/rank2/actv", "free text")
    assert (parsed.micro_step, parsed.pp_stage, parsed.vpp_stage, parsed.call_id, parsed.op) == (
        0,
        0,
        0,
        -1,
        "",
    )


@pytest.mark.parametrize(
    "change",
    [
        {"rank": None},
        {"step": "3"},
        {"step": True},
        {"step": 3.0},
        {"tag_name": None},
        {"message": 5},
        {"micro_step": 1.5},
        {"call_id": False},
        {"op": 3},
        {"value": "1.5"},
        {"value": [1]},
        {"group_mates": ["a"]},
        {"group_mates": 0},
    ],
)
def test_malformed_records_are_rejected(change: dict) -> None:
    _, record = ours(0, 1, "0:fc/rank0/actv")
    assert parse_record(record) is not None
    record.update(change)
    record = {k: v for k, v in record.items() if not (k in ("rank", "tag_name") and v is None)}
    assert parse_record(record) is None
    assert parse_record([record]) is None


def test_find_anomaly_files_scans_one_level_below(tmp_path: Path) -> None:
    write_rank(tmp_path, "rank1", {})
    write_rank(tmp_path, "whatever", {})
    write_rank(tmp_path / "deep", "rank2", {})
    (tmp_path / "anomaly.json").write_text("{}")
    (tmp_path / "rank3").mkdir()
    assert find_anomaly_files(str(tmp_path)) == [
        str(tmp_path / "rank1" / "anomaly.json"),
        str(tmp_path / "whatever" / "anomaly.json"),
    ]


# -------------------------------------------------------------------------------------------- the CLI


def test_both_formats_ranked_into_the_output_file(tree: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["-d", str(tree)]) == 0
    document = output(tree)
    assert list(document) == [
        "0:layers.0.fc.output:0/rank0/actv_norm_step_1_call_2",
        "0:layers.0.fc.weight/rank1/acc_grad_min_step_1_call_4",
        "0:layers.0.fc.weight/rank0/exp_avg_max_step_1_call_9",
        "0:layers.0.fc.weight/rank0/exp_avg_norm_step_1_call_9",
        "0:layers.0.fc.output:0/rank1/actv_norm_step_2_call_1",
        "0:layers.0.fc.weight/rank0/acc_grad_norm_step_2_call_5",
    ]
    first_reference = document["0:layers.0.fc.weight/rank1/acc_grad_min_step_1_call_4"]
    assert (
        first_reference["op"] == "min" and first_reference["value"] is None and first_reference["rank"] == 1
    )
    assert document["0:layers.0.fc.weight/rank0/exp_avg_max_step_1_call_9"]["value"] == 123.4
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert header.split() == TABLE_HEADER
    assert "backward" in out and "optimizer" in out and "forward" in out
    assert out.rstrip().splitlines()[-1] == "6 records from 2 files; skipped 0 files, 0 records"


def test_anomaly_files_of_earlier_runs_are_named_as_not_read(tree: Path, capsys) -> None:
    """A second run in the same output directory set the first run's file aside: the analysis
    reads the newest run's only, and says that earlier ones are there."""
    earlier = tree / "rank0" / "anomaly.json.earlier-20261204-010203"
    earlier.write_text((tree / "rank0" / "anomaly.json").read_text())
    assert main(["-d", str(tree)]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()
    assert last[-2] == "6 records from 2 files; skipped 0 files, 0 records"
    assert last[-1].startswith(
        f"not read: 1 anomaly file(s) of earlier runs in these directories ({earlier})"
    )
    earlier.unlink()
    assert main(["-d", str(tree)]) == 0 and "not read" not in capsys.readouterr().out


def test_step_filter_and_top_k(tree: Path, tmp_path: Path) -> None:
    for flag in ("-s", "--step", "--step_list"):
        out = tmp_path / flag.strip("-")
        assert main(["-d", str(tree), "-o", str(out), flag, "[2]"]) == 0
        assert [r["step"] for r in output(out).values()] == [2, 2]
    assert main(["-d", str(tree), "-o", str(tmp_path / "k"), "-k", "2", "-s", "[]"]) == 0
    assert [r["tag_name"] for r in output(tmp_path / "k").values()] == [
        "0:layers.0.fc.output:0/rank0/actv",
        "0:layers.0.fc.weight/rank1/acc_grad",
    ]
    assert main(["-d", str(tree), "-o", str(tmp_path / "none"), "-s", "[99]"]) == 0
    assert output(tmp_path / "none") == {}


def test_out_path_is_created_and_written_atomically(tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper"
    assert main(["-d", str(tree), "-o", str(out), "-k", "1"]) == 0
    assert os.listdir(out) == ["anomaly_analyse.json"]
    assert main(["-d", str(tree), "-o", str(out), "-k", "3"]) == 0  # replaces the earlier result
    assert os.listdir(out) == ["anomaly_analyse.json"]
    assert len(output(out)) == 3
    assert not (tree / "anomaly_analyse.json").exists()


def test_write_atomic_leaves_no_temporary_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()  # os.replace of a file onto a directory fails
    with pytest.raises(OSError):
        write_atomic(str(target), "{}")
    assert sorted(os.listdir(tmp_path)) == ["taken"]
    write_atomic(str(tmp_path / "ok.json"), '{"a": 1}')
    assert sorted(os.listdir(tmp_path)) == ["ok.json", "taken"]
    assert json.loads((tmp_path / "ok.json").read_text()) == {"a": 1}


def test_non_finite_values_are_written_as_strict_json(tmp_path: Path) -> None:
    write_rank(tmp_path, "rank0", dict([ours(0, 1, "0:fc/rank0/actv", value="nan", baseline="inf")]))
    assert main(["-d", str(tmp_path)]) == 0

    def reject(constant: str) -> None:
        raise ValueError(constant)

    text = (tmp_path / "anomaly_analyse.json").read_text()
    (record,) = json.loads(text, parse_constant=reject).values()
    assert (record["value"], record["baseline"]) == ("nan", "inf")


def test_colliding_output_keys_are_kept_apart(tmp_path: Path) -> None:
    _, first = ours(0, 1, "fc/post_0")
    _, second = ours(1, 1, "fc/post_0")
    write_rank(tmp_path, "rank0", {"a": first})
    write_rank(tmp_path, "rank1", {"a": second})
    assert main(["-d", str(tmp_path)]) == 0
    assert list(output(tmp_path)) == ["fc/post_0_norm_step_1_call_0", "fc/post_0_norm_step_1_call_0_rank1"]


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["-k", "0"], "top k must be at least 1, got 0"),
        (["-k", "-3"], "top k must be at least 1, got -3"),
        (["-s", "5.0"], "step list must be integers"),
        (["-s", "[1, 'a']"], "step list must be integers"),
        (["-s", "[True]"], "step list must be integers"),
        (["-s", "[1,"], "step list must be integers"),
        (["-s", "__import__('os')"], "step list must be integers"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tree: Path, capsys, argv: list[str], text: str) -> None:
    assert_usage_error(capsys, main(["-d", str(tree), *argv]), text)
    assert not (tree / "anomaly_analyse.json").exists()


def test_the_run_root_is_read_through_its_anomaly_detected_directory(tmp_path: Path, tree: Path) -> None:
    root = tmp_path / "monitor_output"
    root.mkdir()
    tree.rename(root / "anomaly_detected")
    assert main(["-d", str(root)]) == 0
    through_root = output(root / "anomaly_detected")
    assert main(["-d", str(root / "anomaly_detected"), "-o", str(tmp_path / "direct")]) == 0
    assert through_root and through_root == output(tmp_path / "direct")


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--ranks", "[0, 1]"], "--ranks"),
        (["--k-mad", "4", "--memory-limit", "2GB"], "--k-mad, --memory-limit"),
    ],
)
def test_cross_rank_flags_without_cross_rank_exit_2(tree: Path, capsys, argv: list[str], flags: str) -> None:
    assert_usage_error(capsys, main(["-d", str(tree), *argv]), f"{flags}: only used with --cross-rank")
    assert not (tree / "anomaly_analyse.json").exists()


def test_bad_paths_exit_2_with_one_line(tmp_path: Path, tree: Path, capsys) -> None:
    assert_usage_error(capsys, main(["-d", str(tmp_path / "missing")]), "data path does not exist")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_usage_error(capsys, main(["-d", str(a_file)]), "data path is not a directory")
    assert_usage_error(capsys, main([str(a_file)]), "data path is not a directory")  # DIR as -d DIR
    empty = tmp_path / "empty"
    (empty / "rank0").mkdir(parents=True)
    assert_usage_error(capsys, main(["-d", str(empty)]), "no anomaly files found")
    assert_usage_error(capsys, main(["-d", str(tree), "-o", str(a_file)]), "output path is not a directory")


def test_one_ranks_directory_analyses_that_rank_alone(tree: Path, capsys) -> None:
    """-d at the directory holding anomaly.json (a rank's): its records, not 'no files found'."""
    assert main(["-d", str(tree / "rank1")]) == 0
    written = json.loads((tree / "rank1" / "anomaly_analyse.json").read_text())
    assert written and {record["rank"] for record in written.values()} == {1}, written


def test_a_run_without_anomaly_files_says_which_config_key_writes_them(tmp_path: Path, capsys) -> None:
    run = tmp_path / "monitor_output"
    (run / "Dec05_03-00-00_rank0").mkdir(parents=True)
    assert_usage_error(capsys, main(["-d", str(run)]), "alert.dump: true")


def test_argparse_errors_return_2(capsys) -> None:
    assert_usage_error(capsys, main([]), "DIR or -d DIR: expected the directory to analyse, got no directory")
    assert_usage_error(capsys, main(["a", "-d", "b"]), "got two different directories")


def test_dir_and_d_dir_naming_one_directory_are_one(tree: Path, capsys) -> None:
    assert main([str(tree), "-d", f"{tree}/"]) == 0
    assert "Top" in capsys.readouterr().out
    assert main(["-d", ".", "-k", "many"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_parse_step_list() -> None:
    assert parse_step_list("[]") is None
    assert parse_step_list("") is None
    assert parse_step_list(" [3, 1, 3] ") == frozenset({1, 3})
    assert parse_step_list([4]) == frozenset({4})
    assert parse_step_list("31") == frozenset({31})
    assert parse_step_list("31, 32") == parse_step_list("31,32") == frozenset({31, 32})


def test_malformed_files_are_skipped_with_one_warning_each(tmp_path: Path, capsys) -> None:
    good = dict([ours(0, 1, "0:fc/rank0/actv"), ours(0, 2, "0:fc/rank0/exp_avg")])
    write_rank(tmp_path, "rank0", good)
    truncated = write_rank(tmp_path, "rank1", json.dumps(good).encode()[:-20])
    latin1 = write_rank(tmp_path, "rank2", '{"a": {"message": "caf\xe9"}}'.encode("latin-1"))
    a_list = write_rank(tmp_path, "rank3", [good])
    _, missing_step = ours(4, 1, "0:fc/rank4/actv")
    del missing_step["step"]
    mixed = write_rank(
        tmp_path, "rank4", {"ok": ours(4, 3, "0:fc/rank4/acc_grad")[1], "no_step": missing_step, "junk": [1]}
    )
    assert main(["-d", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    warnings = captured.err.strip().splitlines()
    assert len(warnings) == 4
    for path, reason in ((truncated, "not valid JSON"), (latin1, "not UTF-8"), (a_list, "not a JSON object")):
        (line,) = [w for w in warnings if str(path) in w]
        assert reason in line
    (line,) = [w for w in warnings if str(mixed) in w]
    assert "skipped 2 malformed record(s)" in line and "'no_step'" in line
    assert "Traceback" not in captured.err
    assert captured.out.rstrip().splitlines()[-1] == "3 records from 2 files; skipped 3 files, 2 records"
    assert [r["step"] for r in output(tmp_path).values()] == [1, 2, 3]


def test_table_truncates_messages_and_neutralises_control_characters() -> None:
    record = rec("0:fc/rank0/actv\x1b[2J", message="x" * 100 + "\n")
    table = analyse.format_table([record])
    assert "\x1b" not in table and "\n" not in table.splitlines()[1]
    assert table.splitlines()[1].endswith("x" * (analyse.MESSAGE_WIDTH - 3) + "...")


def test_table_shows_the_rule_and_baseline_instead_of_repeating_the_tag() -> None:
    record = rec("0:fc.weight/rank0/post_grad", message="Rule AnomalyZScore reports anomaly signal in ...")
    record.op, record.value, record.baseline, record.rule = "norm", 452.342, 0.452, "AnomalyZScore"
    header, row = analyse.format_table([record]).splitlines()
    assert header.split() == TABLE_HEADER
    assert row.split()[-4:] == ["norm", "452.342", "0.452", "AnomalyZScore"]
    assert row.count("0:fc.weight") == 1


def test_parallel_scan_matches_serial(tmp_path: Path) -> None:
    rng = random.Random(11)
    for rank in range(6):
        write_rank(
            tmp_path,
            f"rank{rank}",
            dict(ours(rank, rng.randrange(5), f"0:l{i}/rank{rank}/acc_grad", call_id=i) for i in range(50)),
        )
    write_rank(tmp_path, "rank9", b"{")
    paths = find_anomaly_files(str(tmp_path))
    serial_warnings: list[str] = []
    parallel_warnings: list[str] = []
    serial = collect(paths, 7, frozenset({1, 3}), warn=serial_warnings.append, jobs=1)
    parallel = collect(paths, 7, frozenset({1, 3}), warn=parallel_warnings.append, jobs=2)
    assert parallel == serial
    assert len(serial[0]) == 7 and serial[1].files_skipped == 1
    assert parallel_warnings == serial_warnings != []


def test_run_mounts_as_a_subcommand(tree: Path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="trainmon")
    sub = parser.add_subparsers(dest="command", required=True)
    analyse.add_arguments(sub.add_parser("anomaly-analyse"))
    args = parser.parse_args(["anomaly-analyse", "-d", str(tree), "-k", "1"])
    assert analyse.run(args) == 0
    assert len(output(tree)) == 1
    assert "6 records from 2 files" in capsys.readouterr().out


def test_python_dash_m_entry_point(tree: Path) -> None:
    command = [sys.executable, "-m", "monitor.anomaly_analyse", "-d", str(tree), "-k", "2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "6 records from 2 files; skipped 0 files, 0 records" in done.stdout
    assert len(output(tree)) == 2
    bad = subprocess.run(
        [*command, "-k", "0"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == "anomaly-analyse: error: top k must be at least 1, got 0"


def test_the_cli_does_not_import_torch() -> None:
    code = "import sys, monitor.anomaly_analyse; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
