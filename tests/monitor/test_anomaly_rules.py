"""Anomaly rules driven through Detector.evaluate, and the anomaly.json dump."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import stat

import numpy as np
import pytest

from monitor.anomaly.detector import Detector
from monitor.anomaly.dump import AnomalyDump
from monitor.anomaly.rules import AnomalyNan, AnomalyTurbulence, AnomalyZScore
from monitor.record import RowSet


def msprobe_later(threshold: float, **kwargs) -> AnomalyTurbulence:
    """msprobe's later turbulence rule exactly: no warm-up beyond the first value, no noise or floor."""
    return AnomalyTurbulence(threshold, **{"warmup": 1, "noise": 0.0, "floor": 0.0, **kwargs})


def rules_only(rules, **kwargs) -> Detector:
    """A detector with the rules alone: its own verdicts (non-finite, moved alone) are tested apart."""
    return Detector(rules, non_finite=False, moved_alone=False, **kwargs)


def _tag(name: str) -> str:
    return f"0:{name}/rank0/post_grad"


def _rec(make_record, step, names, values, ops, **labels):
    """A grad_reduced record of rank 0 whose tags are ``_tag(name)``."""
    labels.setdefault("task", "post_grad")
    return make_record("grad_reduced", step, names, values, ops, **labels)


def _drive(detector, make_record, series, names=("w",), ops=("norm",), reuse_rows=True):
    """Feed ``series`` (steps x rows x ops) step by step; return every (step, tag, op) reported."""
    series = np.asarray(series, dtype=np.float64).reshape(-1, len(names), len(ops))
    rows = RowSet.build([0] * len(names), list(names), 0, "post_grad")
    hits = []
    for step, values in enumerate(series):
        record = make_record(
            "grad_reduced", step, names, values, ops, rows=rows if reuse_rows else None, task="post_grad"
        )
        hits += [(a.step, a.tag_name, a.op) for a in detector.evaluate(record)]
    return hits


def _flat_with_spike(length: int, at: int, spike: float, base: float = 1.0) -> list[float]:
    series = [base] * length
    series[at] = spike
    return series


# --------------------------------------------------------------------------------------------- spikes


def test_turbulence_detects_a_spike_exactly_at_its_step(make_record):
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    assert _drive(detector, make_record, _flat_with_spike(30, 17, 5.0)) == [(17, _tag("w"), "norm")]


def test_zscore_detects_a_spike_exactly_at_its_step(make_record):
    rng = np.random.default_rng(1)
    series = rng.lognormal(0.0, 0.1, 200)
    series[150] *= 10.0
    detector = rules_only([AnomalyZScore()], rank=0)
    assert _drive(detector, make_record, series) == [(150, _tag("w"), "norm")]


def test_nan_rule_detects_a_nan_exactly_at_its_step(make_record):
    detector = rules_only([AnomalyNan()], rank=0)
    assert _drive(detector, make_record, _flat_with_spike(30, 4, math.nan)) == [(4, _tag("w"), "norm")]


def test_spike_on_one_tag_is_reported_for_that_tag_only(make_record):
    names = ("a", "b", "c")
    series = np.ones((20, 3, 1))
    series[12, 1, 0] = 40.0
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    assert _drive(detector, make_record, series, names=names) == [(12, _tag("b"), "norm")]


def test_new_rows_objects_each_step_keep_the_same_baselines(make_record):
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    hits = _drive(detector, make_record, _flat_with_spike(20, 9, 3.0), reuse_rows=False)
    assert hits == [(9, _tag("w"), "norm")]


# --------------------------------------------------------------------------------------------- turbulence


def _reference_turbulence(series: list[float], threshold: float, beta: float = 0.99) -> list[bool]:
    """Later msprobe semantics, written out in plain Python."""
    flags = []
    ema = None
    for value in series:
        magnitude = abs(value)
        if ema is None:
            ema = magnitude
        flags.append(magnitude > ema * (1 + threshold))
        ema = beta * ema + (1 - beta) * magnitude
    return flags


def test_turbulence_matches_an_independent_reimplementation(make_record):
    rng = np.random.default_rng(2024)
    steps, names, ops = 400, ("a", "b", "c", "d"), ("norm", "min", "mean")
    signs = rng.choice([-1.0, 1.0], size=(steps, len(names), len(ops)))
    series = signs * rng.lognormal(0.0, 0.4, size=(steps, len(names), len(ops)))
    series[rng.random(series.shape) < 0.02] *= 8.0  # occasional spikes
    threshold = 0.5
    configured = ("norm", "mean")

    expected = set()
    for r, name in enumerate(names):
        for c, op in enumerate(ops):
            if op not in configured:
                continue
            flags = _reference_turbulence(series[:, r, c].tolist(), threshold)
            expected |= {(step, _tag(name), op) for step, flag in enumerate(flags) if flag}

    detector = rules_only([msprobe_later(threshold=threshold, ops=configured)], rank=0)
    hits = _drive(detector, make_record, series, names=names, ops=ops)
    assert len(hits) == len(set(hits))
    assert set(hits) == expected
    assert len(expected) > 20  # the series does exercise the rule


def test_turbulence_only_flags_configured_ops(make_record):
    series = np.ones((10, 1, 3))
    series[5] = 50.0  # every op jumps
    detector = rules_only([msprobe_later(threshold=0.5, ops=("max",))], rank=0)
    assert _drive(detector, make_record, series, ops=("norm", "max", "mean")) == [(5, _tag("w"), "max")]


def test_turbulence_default_ops_are_norm_and_mean(make_record):
    series = np.ones((10, 1, 3))
    series[5] = 50.0
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    hits = _drive(detector, make_record, series, ops=("norm", "max", "mean"))
    assert hits == [(5, _tag("w"), "norm"), (5, _tag("w"), "mean")]


def test_turbulence_reports_the_ema_before_the_update_as_baseline(make_record):
    series = [2.0, 4.5, 1.0, 30.0]  # 4.5 > 2 * (1 + 1)
    ema = 2.0
    for value in series[1:3]:
        ema = 0.99 * ema + 0.01 * value
    detector = rules_only([msprobe_later(threshold=1.0)], rank=0)
    found = []
    for step, value in enumerate(series):
        found += detector.evaluate(_rec(make_record, step, ["w"], [[value]], ("norm",)))
    assert [a.step for a in found] == [1, 3]
    assert found[0].baseline == pytest.approx(2.0, rel=1e-12)
    assert found[1].baseline == pytest.approx(ema, rel=1e-12)
    assert found[1].value == 30.0


# --------------------------------------------------------------------------------------------- nan / inf


def test_nan_rule_flags_nan_and_both_infinities(make_record):
    detector = rules_only([AnomalyNan()], rank=0)
    names = ("finite", "nan", "pinf", "ninf")
    record = _rec(make_record, 0, names, [[1.0], [math.nan], [math.inf], [-math.inf]], ("norm",))
    found = detector.evaluate(record)
    assert [a.tag_name for a in found] == [_tag("nan"), _tag("pinf"), _tag("ninf")]
    assert all(a.rule == "AnomalyNan" for a in found)


def test_nan_rule_flags_a_positive_nan_count(make_record):
    detector = rules_only([AnomalyNan()], rank=0)
    record = _rec(make_record, 0, ("clean", "dirty"), [[3.0, 0.0], [3.0, 2.0]], ("norm", "nans"))
    found = detector.evaluate(record)
    assert [(a.tag_name, a.op, a.value) for a in found] == [(_tag("dirty"), "nans", 2.0)]


@pytest.mark.parametrize("judge", ["AnomalyNan", "the detector's own check"])
def test_id_of_a_tensor_with_many_elements_is_no_nan_signal(make_record, judge):
    """``id`` is the value of a one-element tensor, NaN (no value) for any other: msprobe writes
    nothing there, and a NaN signal would open a false incident at step 0 that hides real NaNs."""
    if judge == "AnomalyNan":
        detector = rules_only([AnomalyNan()], rank=0)
    else:
        detector = Detector([], non_finite=True, moved_alone=False, rank=0)
    ops = ("norm", "nans", "id")
    names = ("matrix", "scalar", "broken", "inf_scalar")
    values = [[2.0, 0.0, math.nan], [0.5, 0.0, 0.5], [math.nan, 3.0, math.nan], [math.inf, 0.0, math.inf]]
    found = detector.evaluate(_rec(make_record, 0, names, values, ops))
    assert sorted((a.tag_name, a.op) for a in found) == [
        (_tag("broken"), "nans"),
        (_tag("broken"), "norm"),
        (_tag("inf_scalar"), "id"),
        (_tag("inf_scalar"), "norm"),
    ]


def test_a_norm_that_turns_nan_reports_the_norms_level_as_its_baseline(make_record):
    detector = Detector([], non_finite=True, moved_alone=False, rank=0)
    rows = RowSet.build([0, 0], ["a", "b"], 0, "post_grad")
    norms = [[2.0, 3.0], [2.0, 3.0], [2.0, 3.0], [math.nan, 3.0]]
    for step, (a, b) in enumerate(norms):
        values = np.array([[a, 0.0], [b, 0.0]])
        found = detector.evaluate(
            make_record("grad_reduced", step, ("a", "b"), values, ("norm", "nans"), rows=rows)
        )
    (anomaly,) = found
    assert (anomaly.tag_name, anomaly.op, anomaly.rule) == (_tag("a"), "norm", "NonFinite")
    assert anomaly.baseline == pytest.approx(2.0, rel=1e-12)  # a steady norm's level is the norm


def test_nan_rule_threshold_flags_large_magnitudes_but_not_counts(make_record):
    detector = rules_only([AnomalyNan(threshold=100.0)], rank=0)
    values = [[50.0, -150.0, 0.0], [101.0, 10.0, 0.0]]
    record = _rec(make_record, 0, ("a", "b"), values, ("norm", "min", "nans"))
    found = detector.evaluate(record)
    assert sorted((a.tag_name, a.op) for a in found) == [(_tag("a"), "min"), (_tag("b"), "norm")]


def test_nan_rule_without_threshold_ignores_large_finite_values(make_record):
    detector = rules_only([AnomalyNan()], rank=0)
    assert _drive(detector, make_record, [1.0, 1e30, -1e30, 1.0]) == []


def test_turbulence_baseline_is_not_poisoned_by_nan(make_record):
    # the 1.2.2 running mean becomes NaN forever after one NaN
    series = [1.0, 1.0, 1.0, math.nan, 1.0, 1.0, 5.0, 1.0]
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    assert _drive(detector, make_record, series) == [(6, _tag("w"), "norm")]


def test_turbulence_baseline_after_nan_and_inf_equals_ema_of_finite_values(make_record):
    series = [1.0, 2.0, math.nan, math.inf, 1.5, 40.0]
    ema = 1.0
    for value in (2.0, 1.5):
        ema = 0.99 * ema + 0.01 * value
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    found = []
    for step, value in enumerate(series):
        found += detector.evaluate(_rec(make_record, step, ["w"], [[value]], ("norm",)))
    assert [a.step for a in found] == [1, 3, 5]  # 2.0 > 1.5, +inf, the spike; never the NaN
    assert found[-1].baseline == pytest.approx(ema, rel=1e-12)


def test_zscore_baseline_is_not_poisoned_by_nan_inf_or_zero(make_record):
    """NaN and Inf are left to the non-finite check; a norm that vanishes is flagged, and none
    of them enters the baseline, so the spike at 100 is still judged against the clean history."""
    rng = np.random.default_rng(7)
    series = rng.lognormal(0.0, 0.1, 120)
    series[40], series[50], series[60] = math.nan, math.inf, 0.0
    series[100] *= 10.0
    detector = rules_only([AnomalyZScore()], rank=0)
    assert _drive(detector, make_record, series) == [(60, _tag("w"), "norm"), (100, _tag("w"), "norm")]


SIX = ("norm", "min", "max", "mean", "zeros", "nans")


@pytest.mark.parametrize(
    "rule",
    [AnomalyZScore(), AnomalyTurbulence(0.5), AnomalyTurbulence(0.5, ops=SIX)],
    ids=["z", "t", "t-six"],
)
def test_a_share_of_zero_is_a_value_not_a_vanished_norm(make_record, rule):
    """mg_direction's share of agreeing signs sits in the norm column (and min, max, mean; zeros
    is 1 where it is 0); for a bias of four elements it is 0, 0.25, ... 1 by chance, so 0 must not
    read as a norm that died, nor its zeros column as a jump. A gradient's norm that drops to 0
    beside it still does."""
    rows = RowSet.build([0], ["b"], 0, "mg_direction")
    grad_rows = RowSet.build([0], ["b"], 0, "post_grad")
    shares = np.random.default_rng(3).choice([0.25, 0.5, 0.75, 1.0], size=40)
    shares[30] = 0.0
    detector = Detector([rule], rank=0, moved_alone=False)
    found = []
    for step, share in enumerate(shares):
        norm = 0.0 if step == 35 else 1.0 + 0.01 * step
        row = [share, share, share, share, float(share == 0), 0.0]
        for prefix, task, table, values, ops in (
            ("other", "mg_direction", rows, [row], SIX),
            ("grad_reduced", "post_grad", grad_rows, [[norm]], ("norm",)),
        ):
            record = make_record(prefix, step, ["b"], values, ops, rows=table, task=task)
            found += [(a.step, a.tag_name) for a in detector.evaluate(record)]
    assert found == [(35, _tag("b"))]


def test_zscore_leaves_mg_direction_shares_to_the_non_finite_check(make_record):
    """A fast-learning model's overshoot takes a bias's share of signs agreeing with Adam's
    momentum from about 0.9 to 2 of 128 in a step, in a clean run: AnomalyZScore, a rule of sizes,
    does not judge that share (AnomalyTurbulence, msprobe's, two-sided here, still does); a NaN
    in it is still found."""
    rows = RowSet.build([0], ["fc1.bias"], 0, "mg_direction")
    shares = [0.9 + 0.01 * (step % 3) for step in range(30)]
    shares[20], shares[26] = 2 / 128, math.nan
    found = {}
    for rule in (AnomalyZScore(), AnomalyTurbulence(0.5, two_sided=True)):
        detector = Detector([rule], rank=0, moved_alone=False)
        found[rule.name] = [
            (a.step, a.rule)
            for step, share in enumerate(shares)
            for a in detector.evaluate(
                make_record("other", step, ["fc1.bias"], [[share]], ("norm",), rows=rows, task="mg_direction")
            )
        ]
    assert found["AnomalyZScore"] == [(26, "NonFinite")]
    assert (20, "AnomalyTurbulence") in found["AnomalyTurbulence"]


def test_nan_first_value_does_not_start_the_turbulence_baseline(make_record):
    series = [math.nan, 4.0, 4.2, 20.0]
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    assert _drive(detector, make_record, series) == [(3, _tag("w"), "norm")]


# --------------------------------------------------------------------------------------------- warm-up


def test_turbulence_never_flags_the_first_value(make_record):
    detector = rules_only([msprobe_later(threshold=0.0)], rank=0)
    assert _drive(detector, make_record, [1e6]) == []


def test_turbulence_default_warmup_flags_the_second_value(make_record):
    detector = rules_only([msprobe_later(threshold=0.5)], rank=0)
    assert _drive(detector, make_record, [1.0, 10.0]) == [(1, _tag("w"), "norm")]


def test_turbulence_warmup_suppresses_verdicts_until_enough_values(make_record):
    series = np.ones((8, 2, 1))
    series[2, 0, 0] = 10.0  # third value of "early": only 2 seen before it
    series[3, 1, 0] = 10.0  # fourth value of "late": 3 seen before it
    detector = rules_only([msprobe_later(threshold=0.5, warmup=3)], rank=0)
    assert _drive(detector, make_record, series, names=("early", "late")) == [(3, _tag("late"), "norm")]


# ------------------------------------------------- turbulence's own defaults (warm-up, noise, floor)


def _adam_moment(beta: float, signal: np.ndarray) -> np.ndarray:
    """An Adam moment of ``signal`` growing from zero, as the optimizer computes it."""
    moment, out = 0.0, np.empty(len(signal))
    for t, value in enumerate(signal):
        moment = beta * moment + (1 - beta) * value
        out[t] = abs(moment)
    return out


def test_default_turbulence_is_silent_on_training_trends_msprobes_rule_floods(make_record):
    """Adam's moments growing from zero, a learning-rate warm-up, a steady 2% growth per step:
    msprobe's later rule (threshold 0.5) flags them; the defaults judge each against its noise."""
    rng = np.random.default_rng(7)
    trends = {
        "exp_avg_sq": _adam_moment(0.999, rng.lognormal(0, 0.3, 400) ** 2),
        "exp_avg": _adam_moment(0.9, rng.normal(0.5, 0.3, 400)),
        "warm_up": np.minimum(np.arange(1, 401) / 100, 1.0) * rng.lognormal(0, 0.1, 400),
        "growth": 1.02 ** np.arange(400),
    }
    for name, series in trends.items():
        assert _drive(rules_only([AnomalyTurbulence(0.5)], rank=0), make_record, series) == [], name
    flooded = [_drive(rules_only([msprobe_later(0.5)], rank=0), make_record, s) for s in trends.values()]
    assert all(flooded), "msprobe's rule should flag these trends (else the test proves nothing)"


def test_default_turbulence_flags_a_spike_in_noise_at_its_step(make_record):
    """A x5 or x100 spike in lognormal noise (sigma 0.3) is flagged at its step; the noise itself
    passes the rule's bars about once in a thousand values (a 3-sigma draw), never more than 1%."""
    rng = np.random.default_rng(8)
    for factor in (5.0, 100.0):
        series = rng.lognormal(0, 0.3, 300)
        series[200] *= factor
        hits = _drive(rules_only([AnomalyTurbulence(0.5)], rank=0), make_record, series)
        assert (200, _tag("w"), "norm") in hits, (factor, hits)
        assert len(hits) - 1 <= 3, (factor, hits)


def test_default_turbulence_warmup_is_twenty_values(make_record):
    series = [1.0] * 40
    series[19], series[30] = 50.0, 50.0  # the twentieth value: 19 seen before it
    assert _drive(rules_only([AnomalyTurbulence(0.5)], rank=0), make_record, series) == [
        (30, _tag("w"), "norm")
    ]


def test_default_turbulence_leaves_a_mean_near_zero_to_the_floor_of_the_elements_scale(make_record):
    """A mean of 1e-3 that doubles, next to elements of size 1: below a tenth of their scale."""
    rng = np.random.default_rng(9)
    steps = 300
    mean = np.abs(rng.normal(1e-3, 1e-4, steps))
    mean[200] *= 20
    columns = [np.ones(steps), mean, -np.abs(rng.normal(1, 0.05, steps)), np.abs(rng.normal(1, 0.05, steps))]
    series = np.stack(columns, axis=1)
    ops = ("norm", "mean", "min", "max")
    assert _drive(rules_only([AnomalyTurbulence(0.5)], rank=0), make_record, series, ops=ops) == []
    floor_off = rules_only([AnomalyTurbulence(0.5, floor=0.0)], rank=0)
    assert (200, _tag("w"), "mean") in _drive(floor_off, make_record, series, ops=ops)


def test_zscore_warmup_suppresses_verdicts_until_enough_values(make_record):
    series = np.ones((15, 2, 1))
    series[9, 0, 0] = 10.0  # 9 values seen: default warmup 10 not reached
    series[10, 1, 0] = 10.0  # 10 values seen
    detector = rules_only([AnomalyZScore()], rank=0)
    assert _drive(detector, make_record, series, names=("early", "late")) == [(10, _tag("late"), "norm")]


# --------------------------------------------------------------------------------------------- zscore


def test_zscore_is_silent_on_stationary_lognormal_noise(make_record):
    rng = np.random.default_rng(12345)
    names = tuple(f"layers.{i}.weight" for i in range(8))
    series = rng.lognormal(0.0, 0.1, size=(1000, len(names), 1))
    detector = rules_only([AnomalyZScore()], rank=0)
    assert _drive(detector, make_record, series, names=names) == []


def test_zscore_detects_a_10x_spike_after_stationary_noise(make_record):
    rng = np.random.default_rng(54321)
    series = rng.lognormal(0.0, 0.1, 1001)
    series[1000] = 10.0 * series[999]
    detector = rules_only([AnomalyZScore()], rank=0)
    assert _drive(detector, make_record, series) == [(1000, _tag("w"), "norm")]


def test_zscore_detects_a_10x_drop(make_record):
    rng = np.random.default_rng(99)
    series = rng.lognormal(0.0, 0.1, 300)
    series[250] /= 10.0
    detector = rules_only([AnomalyZScore()], rank=0)
    assert _drive(detector, make_record, series) == [(250, _tag("w"), "norm")]


def test_zscore_ignores_a_2x_step_below_min_ratio(make_record):
    detector = rules_only([AnomalyZScore()], rank=0)
    assert _drive(detector, make_record, _flat_with_spike(40, 30, 2.0)) == []


# --------------------------------------------------------------------------------------------- reporting


def test_first_rule_wins_nan_before_turbulence(make_record):
    detector = rules_only([AnomalyNan(), msprobe_later(threshold=0.5)], rank=0)
    found = []
    for step, value in enumerate([1.0, math.inf]):
        found += detector.evaluate(_rec(make_record, step, ["w"], [[value]], ("norm",)))
    assert [(a.step, a.rule) for a in found] == [(1, "AnomalyNan")]


def test_first_rule_wins_turbulence_before_nan(make_record):
    detector = rules_only([msprobe_later(threshold=0.5), AnomalyNan()], rank=0)
    found = []
    for step, value in enumerate([1.0, math.inf]):
        found += detector.evaluate(_rec(make_record, step, ["w"], [[value]], ("norm",)))
    assert [(a.step, a.rule) for a in found] == [(1, "AnomalyTurbulence")]


def test_later_rule_still_reports_cells_the_first_rule_did_not_flag(make_record):
    detector = rules_only([AnomalyNan(), msprobe_later(threshold=0.5)], rank=0)
    found = []
    for step, values in enumerate([[[1.0], [1.0]], [[math.nan], [9.0]]]):
        found += detector.evaluate(_rec(make_record, step, ["a", "b"], values, ("norm",)))
    assert [(a.tag_name, a.rule) for a in found] == [
        (_tag("a"), "AnomalyNan"),
        (_tag("b"), "AnomalyTurbulence"),
    ]


def test_record_labels_are_carried_into_the_anomaly(make_record):
    detector = rules_only([AnomalyNan()], rank=5, pp_stage=2, group_mates=[1, 5, 9])
    record = make_record(
        "actv",
        11,
        ["layers.0.fc1.input", "layers.0.fc1.output"],
        [[1.0], [math.nan]],
        ("norm",),
        rank=5,
        task="actv",
        vpp_stages=[0, 3],
        micro_steps=[0, 4],
        call_ids=[17, 23],
    )
    (anomaly,) = detector.evaluate(record)
    assert anomaly.tag_name == "3:layers.0.fc1.output:4/rank5/actv"
    assert (anomaly.rank, anomaly.step, anomaly.micro_step) == (5, 11, 4)
    assert (anomaly.pp_stage, anomaly.vpp_stage, anomaly.call_id) == (2, 3, 23)
    assert anomaly.group_mates == [1, 5, 9]
    assert anomaly.op == "norm"
    assert math.isnan(anomaly.value)
    assert "3:layers.0.fc1.output:4/rank5/actv" in anomaly.message
    assert "step 11" in anomaly.message


def test_missing_call_ids_and_micro_steps_default_to_minus_one_and_zero(make_record):
    detector = rules_only([AnomalyNan()], rank=0)
    (anomaly,) = detector.evaluate(_rec(make_record, 0, ["w"], [[math.nan]], ("norm",)))
    assert anomaly.call_id == -1
    assert anomaly.micro_step == 0
    assert anomaly.group_mates == [0]


def test_two_ops_flagged_on_one_tag_in_one_step_are_two_records(make_record):
    detector = rules_only([AnomalyNan()], rank=0)
    record = _rec(make_record, 3, ["w"], [[math.nan, math.inf]], ("norm", "max"), call_ids=[4])
    found = detector.evaluate(record)
    assert [a.op for a in found] == ["norm", "max"]
    keys = [a.key for a in found]
    assert len(set(keys)) == 2
    assert "norm" in keys[0]
    assert "max" in keys[1]
    assert all(k.startswith(_tag("w")) and "step_3" in k and "call_4" in k for k in keys)


def test_no_rules_reports_nothing(make_record):
    detector = rules_only([], rank=0)
    assert _drive(detector, make_record, [1.0, math.nan, 1e9]) == []


# --------------------------------------------------------------------------------------------- dump


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _read_json(path):
    with open(path, encoding="utf-8") as handle:
        return _strict_json(handle.read())


def _flagged(make_record, step, values, ops=("norm",), names=("w",), rules=None):
    detector = rules_only(rules or [AnomalyNan()], rank=0)
    return detector.evaluate(_rec(make_record, step, names, values, ops, call_ids=[step] * len(names)))


def test_dump_starts_with_an_empty_object(tmp_path):
    dump = AnomalyDump(tmp_path, rank=3)
    assert dump.path == os.path.join(tmp_path, "anomaly_detected", "rank3", "anomaly.json")
    assert _read_json(dump.path) == {}


def test_dump_is_valid_json_with_every_record_after_each_step(tmp_path, make_record):
    dump = AnomalyDump(tmp_path, rank=0)
    expected_keys = []
    for step in range(4):
        found = _flagged(make_record, step, [[math.nan], [math.inf]], names=("a", "b"))
        dump.add(found)
        dump.end_step(step)
        expected_keys += [f"{_tag(n)}_norm_step_{step}_call_{step}" for n in ("a", "b")]
        document = _read_json(dump.path)
        assert sorted(document) == sorted(expected_keys)
    record = document[f"{_tag('b')}_norm_step_3_call_3"]
    assert record["step"] == 3
    assert record["tag_name"] == _tag("b")
    assert record["message"].startswith("Rule AnomalyNan reports anomaly signal in")


#: msprobe's anomaly record: its analyser builds its record class from exactly these keys and
#: rejects a record with any other (written out here, independently of the code under test).
MSPROBE_RECORD_FIELDS = {
    "rank": int,
    "step": int,
    "micro_step": int,
    "pp_stage": int,
    "vpp_stage": int,
    "call_id": int,
    "tag_name": str,
    "message": str,
    "group_mates": list,
}


def test_dump_records_have_exactly_msprobes_fields(tmp_path, make_record):
    dump = AnomalyDump(tmp_path, rank=0)
    dump.add(_flagged(make_record, 0, [[math.nan, -math.inf]], ops=("norm", "min")))
    dump.end_step(0)
    for record in _read_json(dump.path).values():
        assert set(record) == set(MSPROBE_RECORD_FIELDS)
        assert all(type(record[name]) is kind for name, kind in MSPROBE_RECORD_FIELDS.items())


def test_details_write_nan_and_inf_values_as_strings(make_record):
    found = _flagged(make_record, 0, [[math.nan, -math.inf]], ops=("norm", "min"))
    details = {anomaly.op: json.loads(json.dumps(anomaly.details(), allow_nan=False)) for anomaly in found}
    assert details["norm"]["value"] == "nan"
    assert details["min"]["value"] == "-inf"
    assert details["norm"]["baseline"] == "nan"
    assert details["norm"]["rule"] == "AnomalyNan"


def test_dump_leaves_no_temporary_files(tmp_path, make_record):
    dump = AnomalyDump(tmp_path, rank=0)
    for step in range(3):
        dump.add(_flagged(make_record, step, [[math.nan]]))
        dump.end_step(step)
        assert sorted(os.listdir(dump.directory)) == ["anomaly.json", "incidents.json"]
    dump.close()
    assert sorted(os.listdir(dump.directory)) == ["anomaly.json", "incidents.json"]


def test_dump_replaces_the_file_by_rename(tmp_path, make_record):
    dump = AnomalyDump(tmp_path, rank=0)
    dump.add(_flagged(make_record, 0, [[math.nan]]))
    dump.end_step(0)
    with open(dump.path) as old:  # a reader holding the previous version
        inode = os.fstat(old.fileno()).st_ino
        dump.add(_flagged(make_record, 1, [[math.nan]]))
        dump.end_step(1)
        assert len(_strict_json(old.read())) == 1  # still the whole previous document
    assert os.stat(dump.path).st_ino != inode
    assert len(_read_json(dump.path)) == 2


def test_a_large_file_defers_its_next_rewrite_and_close_writes_the_rest(tmp_path, make_record, monkeypatch):
    import monitor.anomaly.dump as dump_module

    monkeypatch.setattr(dump_module, "THROTTLE_ABOVE_RECORDS", 0)  # every file counts as large

    clock = [100.0]
    monkeypatch.setattr(dump_module.time, "monotonic", lambda: clock[0])
    real_write = dump_module.atomic_write_text

    def slow_write(path, text):  # a rewrite of anomaly.json takes 1 s of the (fake) clock
        clock[0] += 1.0 if path.endswith("anomaly.json") else 0.0
        real_write(path, text)

    dump = AnomalyDump(tmp_path, rank=0)
    monkeypatch.setattr(dump_module, "atomic_write_text", slow_write)
    dump.add(_flagged(make_record, 0, [[math.nan]]))
    dump.end_step(0)  # written; took 1 s, so the next rewrite waits REWRITE_PAUSE_FACTOR s
    assert len(_read_json(dump.path)) == 1
    clock[0] += 5.0
    dump.add(_flagged(make_record, 1, [[math.nan]]))
    dump.end_step(1)
    assert len(_read_json(dump.path)) == 1  # deferred
    clock[0] += dump_module.REWRITE_PAUSE_FACTOR
    dump.add(_flagged(make_record, 2, [[math.nan]]))
    dump.end_step(2)
    assert len(_read_json(dump.path)) == 3  # the pause is over: everything so far
    dump.add(_flagged(make_record, 3, [[math.nan]]))
    dump.end_step(3)
    assert len(_read_json(dump.path)) == 3
    dump.close()
    assert len(_read_json(dump.path)) == 4  # nothing is lost at the end


def test_a_small_file_is_rewritten_at_every_step_however_slow(tmp_path, make_record, monkeypatch):
    """Crash safety: below THROTTLE_ABOVE_RECORDS every ended step is in the file."""
    import monitor.anomaly.dump as dump_module

    clock = [0.0]
    monkeypatch.setattr(dump_module.time, "monotonic", lambda: clock[0])
    real_write = dump_module.atomic_write_text

    def slow_write(path, text):  # a loaded machine: every rewrite takes 5 s
        clock[0] += 5.0
        real_write(path, text)

    monkeypatch.setattr(dump_module, "atomic_write_text", slow_write)
    dump = AnomalyDump(tmp_path, rank=0)
    for step in range(3):
        dump.add(_flagged(make_record, step, [[math.nan]]))
        dump.end_step(step)
        assert len(_read_json(dump.path)) == step + 1


def test_dump_does_not_rewrite_without_new_records(tmp_path, make_record):
    dump = AnomalyDump(tmp_path, rank=0)
    dump.add(_flagged(make_record, 0, [[math.nan]]))
    dump.end_step(0)
    inode = os.stat(dump.path).st_ino
    dump.add([])
    dump.end_step(1)
    assert os.stat(dump.path).st_ino == inode


def test_dump_file_mode_is_0640(tmp_path, make_record):
    previous = os.umask(0o077)
    try:
        dump = AnomalyDump(tmp_path, rank=0)
        dump.add(_flagged(make_record, 0, [[math.nan]]))
        dump.end_step(0)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(dump.path).st_mode) == 0o640


def test_dump_keeps_the_files_of_an_earlier_run_beside_its_own(tmp_path, trainmon_log):
    directory = tmp_path / "anomaly_detected" / "rank0"
    directory.mkdir(parents=True)
    (directory / "anomaly.json").write_text('{"old": {}}')
    (directory / "incidents.json").write_text('{"incidents": ["old"]}')
    for _ in range(2):  # a second new run keeps the first one's files too
        dump = AnomalyDump(tmp_path, rank=0)
        assert _read_json(dump.path) == {}
        dump.close()
    kept = sorted(p.name for p in directory.iterdir() if ".earlier-" in p.name)
    assert len(kept) == 4, kept  # both files of both earlier runs
    earliest = [p for p in directory.iterdir() if p.name.startswith("anomaly.json.earlier-")]
    assert sorted(p.read_text() for p in earliest) == ['{"old": {}}', "{}"]  # the old one, the first run's
    assert sum("is kept as" in m for m in trainmon_log.at(logging.WARNING)) == 4


def test_two_live_dumps_of_one_rank_write_apart_and_one_dropped_frees_its_directory(tmp_path, trainmon_log):
    """Two monitors attached at once each keep their files (the second renamed the first's fresh
    ones as an earlier run's, then both overwrote them); one dropped without close() is not live."""
    first = AnomalyDump(tmp_path, rank=0)
    second = AnomalyDump(tmp_path, rank=0)
    assert (first.directory, second.directory) == (
        str(tmp_path / "anomaly_detected" / "rank0"),
        str(tmp_path / "anomaly_detected" / "rank0-2"),
    )
    assert not list((tmp_path / "anomaly_detected" / "rank0").glob("*.earlier-*"))
    second.close()
    del first
    gc.collect()
    third = AnomalyDump(tmp_path, rank=0)
    assert third.directory == str(tmp_path / "anomaly_detected" / "rank0")
    third.close()


def test_dump_refuses_a_symlink_at_the_file_path(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text('{"mine": 1}')
    directory = tmp_path / "anomaly_detected" / "rank0"
    directory.mkdir(parents=True)
    os.symlink(victim, directory / "anomaly.json")
    with pytest.raises(OSError, match="symbolic link"):
        AnomalyDump(tmp_path, rank=0)
    assert victim.read_text() == '{"mine": 1}'
