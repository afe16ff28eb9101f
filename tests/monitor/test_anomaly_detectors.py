"""Turbulence semantics (1.2.2 and later), two-sided deviation, z-score false positives, state round trip.

Every verdict is checked against an independent plain-Python re-implementation written from
the rules' documented definitions (msprobe 1.2.2's running-mean turbulence rule, its later
moving-average form, the z-score rule of docs/anomalies.md), never against the code under test.
"""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest

from monitor.anomaly.detector import Detector
from monitor.anomaly.rules import (
    AnomalyNan,
    AnomalyTurbulence,
    AnomalyZScore,
    RunningMeanTurbulence,
    build_rules,
)
from monitor.config.schema import ConfigError, load_config
from monitor.record import RowSet


def msprobe_later(threshold: float, **kwargs) -> AnomalyTurbulence:
    """msprobe's later turbulence rule exactly: no warm-up beyond the first value, no noise or floor."""
    return AnomalyTurbulence(threshold, **{"warmup": 1, "noise": 0.0, "floor": 0.0, **kwargs})


def rules_only(rules, **kwargs) -> Detector:
    """A detector with the rules alone: its own verdicts (non-finite, moved alone) are tested apart."""
    return Detector(rules, non_finite=False, moved_alone=False, **kwargs)


def _tag(name: str) -> str:
    return f"0:{name}/rank0/post_grad"


def _drive(detector, make_record, series, names=("w",), ops=("norm",), start=0):
    """Feed ``series`` (steps x rows x ops) from step ``start``; return every anomaly found."""
    series = np.asarray(series, dtype=np.float64).reshape(-1, len(names), len(ops))
    rows = RowSet.build([0] * len(names), list(names), 0, "post_grad")
    found = []
    for offset, values in enumerate(series):
        record = make_record("grad_reduced", start + offset, names, values, ops, rows=rows)
        found += detector.evaluate(record)
    return found


def _hits(found):
    return [(a.step, a.tag_name, a.op) for a in found]


def _signed_series(rng, steps, rows, ops, nonfinite=True):
    """Signed, heavy-tailed values with spikes, zeros and (optionally) NaN/Inf sprinkled in."""
    signs = rng.choice([-1.0, 1.0], size=(steps, rows, ops))
    series = signs * rng.lognormal(0.0, 0.4, size=(steps, rows, ops))
    series[rng.random(series.shape) < 0.03] *= 8.0
    series[rng.random(series.shape) < 0.01] = 0.0
    if nonfinite:
        series[rng.random(series.shape) < 0.004] = math.nan
        series[rng.random(series.shape) < 0.002] = math.inf
        series[rng.random(series.shape) < 0.002] = -math.inf
    return series


# --------------------------------------------------------------------------- independent references


def _reference_122(series: list[float], threshold: float) -> list[tuple[bool, float]]:
    """msprobe 1.2.2: running arithmetic mean, one-sided bound; (flag, mean) per value."""
    out, avg = [], None
    for count, cur in enumerate(series):
        if avg is None:
            avg = cur
        baseline = avg
        bound = baseline + baseline * threshold
        out.append((cur > bound if baseline > 0 else cur < bound, baseline))
        avg = (avg * count + cur) / (count + 1)
    return out


def _reference_later(
    series: list[float], threshold: float, two_sided=False, skip_nonfinite=True, vanish=False
):
    """Later msprobe EMA of |value| (beta 0.99), with the opt-in two-sided test and NaN/Inf skipping;
    ``vanish``: also a value of exactly zero after a positive EMA (what trainmon adds for norms)."""
    out, ema = [], None
    for cur in series:
        magnitude = abs(cur)
        if ema is None:
            flag = False
        elif vanish and cur == 0 and ema > 0:
            flag = True
        elif two_sided:
            flag = abs(magnitude - ema) > threshold * ema
        else:
            flag = magnitude > ema * (1 + threshold)
        out.append(flag)
        if skip_nonfinite and not math.isfinite(magnitude):
            continue
        ema = magnitude if ema is None else 0.99 * ema + 0.01 * magnitude
    return out


def _reference_zscore(series, threshold=6.0, warmup=10, beta=0.9, min_ratio=5.0, floor=0.05, trend=True):
    """A forecast of log|x| (with trend: Brown's double smoothing at 0.8, level 2 S1 - S2 plus k
    slopes of 0.2 / 0.8 (S1 - S2) for the value k steps on; without, the EWMA mean at beta) and
    the EWMA variance of the one-step forecasts' errors, bias-corrected; a flagged value held out
    until the next is flagged too (then both enter) or is not (then it never does, its forecast
    entering in its place); flags before folding in: a rise by its log z-score; a drop also needs
    a quiet signal (the share of the forecast lost above threshold x sigma, with 2 x warmup values
    seen) or to be min_ratio squared (a record falling as a whole, which these independent series
    do not, is left out)."""
    out, single, double, var, count, held = [], 0.0, 0.0, 0.0, 0, None
    rate = 0.2 if trend else 1 - beta

    def forecast(steps):
        if not trend:
            return single
        return 2 * single - double + steps * rate / (1 - rate) * (single - double)

    def smooth(value):
        nonlocal single, double
        single += rate * (value - single)
        double += rate * (single - double)

    for x in series:
        finite = math.isfinite(x) and x != 0
        log = math.log(abs(x)) if finite else math.nan
        mean = forecast(1 if held is None else 2)  # past a held-out value's step too
        flag = x == 0 and count >= warmup  # a norm that vanished after a history
        if finite and count >= warmup:
            corrected = var / (1 - beta ** (count - 1)) if count > 1 else 0.0
            sigma = max(math.sqrt(corrected), floor)
            z_far = abs(log - mean) > threshold * sigma and abs(log - mean) > math.log(min_ratio)
            quiet = 1 - math.exp(log - mean) > threshold * sigma and count >= 2 * warmup
            flag = z_far and (log > mean or quiet or mean - log > 2 * math.log(min_ratio))
        out.append(flag)
        if not finite:
            held = None
            continue
        if flag and held is None:  # held out for a step: a lone spike never enters
            held = log
            continue
        if held is not None and not flag:  # the spike's step: its forecast enters instead
            smooth(forecast(1))
        for entered in (held, log) if flag else (log,):  # flagged twice running: both enter
            if count == 0:
                single, double, var = entered, entered, 0.0
            else:
                error = entered - forecast(1)
                smooth(entered)
                var = beta * (var + (1 - beta) * error * error)
            count += 1
        held = None
    return out


def _expected(series, names, ops, judged_ops, flags_of):
    expected = set()
    for r, name in enumerate(names):
        for c, op in enumerate(ops):
            if op in judged_ops:
                flags = flags_of(series[:, r, c].tolist())
                expected |= {(step, _tag(name), op) for step, flag in enumerate(flags) if flag}
    return expected


# --------------------------------------------------------------------------- 1.2.2 semantics


def _rule_from_config(args):
    config = load_config({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": args}]}})
    (rule,) = build_rules(config.alert.rules)
    return rule


def test_semantics_1_2_2_in_the_config_selects_the_running_mean_rule():
    rule = _rule_from_config({"threshold": 0.5, "semantics": "1.2.2"})
    assert isinstance(rule, RunningMeanTurbulence)
    assert (rule.threshold, rule.ops, rule.warmup, rule.skip_nonfinite) == (0.5, None, 1, False)


def test_default_semantics_is_the_later_ema_rule():
    rule = _rule_from_config({"threshold": 0.5})
    assert isinstance(rule, AnomalyTurbulence)
    assert (rule.ops, rule.two_sided, rule.skip_nonfinite) == (("norm", "mean"), False, True)
    explicit = _rule_from_config({"threshold": 0.5, "semantics": "later"})
    assert isinstance(explicit, AnomalyTurbulence)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 2.0])
def test_1_2_2_matches_the_reference_on_every_op_with_nan_and_inf(make_record, threshold):
    rng = np.random.default_rng(122)
    names, ops = ("a", "b", "c"), ("norm", "min", "mean", "nans")
    series = _signed_series(rng, 300, len(names), len(ops))
    found = _drive(
        rules_only([_rule_from_config({"threshold": threshold, "semantics": "1.2.2"})], rank=0),
        make_record,
        series,
        names,
        ops,
    )

    expected, baselines = set(), {}
    for r, name in enumerate(names):
        for c, op in enumerate(ops):
            for step, (flag, mean) in enumerate(_reference_122(series[:, r, c].tolist(), threshold)):
                if flag:
                    expected.add((step, _tag(name), op))
                    baselines[(step, _tag(name), op)] = mean
    assert set(_hits(found)) == expected
    assert len(found) == len(expected)
    assert {op for _, _, op in expected} == set(ops)  # every op is judged, min and nans included
    assert all(a.baseline == baselines[(a.step, a.tag_name, a.op)] for a in found)  # bit-identical


def test_1_2_2_one_nan_silences_the_tag_forever(make_record):
    series = [1.0, 1.0, math.nan, 1.0, 50.0, 500.0]
    rule = RunningMeanTurbulence(threshold=0.5)
    assert _drive(rules_only([rule], rank=0), make_record, series) == []


def test_1_2_2_skip_nonfinite_keeps_the_mean_alive(make_record):
    series = [1.0, 1.0, math.nan, 1.0, 50.0]
    rule = _rule_from_config({"threshold": 0.5, "semantics": "1.2.2", "skip_nonfinite": True})
    assert _hits(_drive(rules_only([rule], rank=0), make_record, series)) == [(4, _tag("w"), "norm")]


def test_1_2_2_never_flags_a_drop_but_flags_growth_away_from_zero(make_record):
    # positive mean: a drop to 0.01 is silent; negative mean: -5 is "growth"; zero mean: any negative
    series = np.array([[[1.0], [-1.0], [0.0]], [[0.01], [-5.0], [-0.001]]])
    found = _drive(
        rules_only([RunningMeanTurbulence(0.5)], rank=0), make_record, series, names=("p", "n", "z")
    )
    assert _hits(found) == [(1, _tag("n"), "norm"), (1, _tag("z"), "norm")]


def test_1_2_2_warmup_delays_the_first_verdict(make_record):
    series = [1.0, 9.0, 1.0, 9.0]
    found = _drive(rules_only([RunningMeanTurbulence(0.5, warmup=3)], rank=0), make_record, series)
    assert _hits(found) == [(3, _tag("w"), "norm")]


# --------------------------------------------------------------------------- later semantics


def test_later_without_nonfinite_skipping_is_the_reference_exactly(make_record):
    rng = np.random.default_rng(8)
    names, ops = ("a", "b"), ("norm", "mean", "max")
    series = _signed_series(rng, 300, len(names), len(ops))
    exact = {"warmup": 1, "noise": 0, "floor": 0}
    rule = _rule_from_config({"threshold": 0.5, "skip_nonfinite": False, **exact})
    found = _drive(rules_only([rule], rank=0), make_record, series, names, ops)
    expected = _expected(
        series, names, ops, ("norm",), lambda s: _reference_later(s, 0.5, skip_nonfinite=False, vanish=True)
    ) | _expected(series, names, ops, ("mean",), lambda s: _reference_later(s, 0.5, skip_nonfinite=False))
    assert set(_hits(found)) == expected
    assert len(found) == len(expected) > 10


def test_later_exact_reference_is_poisoned_by_nan(make_record):
    series = [1.0, math.nan, 1.0, 40.0]
    poisoned = msprobe_later(0.5, skip_nonfinite=False)
    assert _drive(rules_only([poisoned], rank=0), make_record, series) == []
    assert _hits(_drive(rules_only([msprobe_later(0.5)], rank=0), make_record, series)) == [
        (3, _tag("w"), "norm")
    ]


def test_two_sided_matches_the_reference_with_nan_and_inf(make_record):
    rng = np.random.default_rng(21)
    names, ops = ("a", "b", "c"), ("norm", "mean")
    series = _signed_series(rng, 300, len(names), len(ops))
    rule = _rule_from_config({"threshold": 0.6, "two_sided": True, "warmup": 1, "noise": 0, "floor": 0})
    found = _drive(rules_only([rule], rank=0), make_record, series, names, ops)
    expected = _expected(
        series, names, ops, ("norm",), lambda s: _reference_later(s, 0.6, two_sided=True, vanish=True)
    ) | _expected(series, names, ops, ("mean",), lambda s: _reference_later(s, 0.6, two_sided=True))
    assert set(_hits(found)) == expected
    assert len(found) == len(expected) > 10


def test_two_sided_flags_a_drop_at_its_step_and_one_sided_does_not(make_record):
    series = [1.0] * 20
    series[12] = 0.1
    two = _drive(rules_only([msprobe_later(0.5, two_sided=True)], rank=0), make_record, series)
    one = _drive(rules_only([msprobe_later(0.5)], rank=0), make_record, series)
    assert _hits(two) == [(12, _tag("w"), "norm")]
    assert one == []


def test_two_sided_flags_a_spike_at_its_step(make_record):
    series = [2.0] * 20
    series[15] = 10.0
    found = _drive(rules_only([msprobe_later(0.5, two_sided=True)], rank=0), make_record, series)
    assert _hits(found) == [(15, _tag("w"), "norm")]


def test_two_sided_warmup_suppresses_early_verdicts(make_record):
    series = [1.0, 0.1, 1.0, 1.0, 0.1]
    found = _drive(rules_only([msprobe_later(0.5, warmup=4, two_sided=True)], rank=0), make_record, series)
    assert _hits(found) == [(4, _tag("w"), "norm")]


@pytest.mark.parametrize(
    ("args", "key", "needle"),
    [
        ({"threshold": 0.5, "semantics": "1.3"}, "semantics", "'later', '1.2.2'"),
        ({"threshold": 0.5, "semantics": 122}, "semantics", "122"),
        ({"threshold": 0.5, "two_sided": "yes"}, "two_sided", "true or false"),
        ({"threshold": 0.5, "skip_nonfinite": 1}, "skip_nonfinite", "true or false"),
        ({"threshold": 0.5, "semantics": "1.2.2", "two_sided": True}, "two_sided", "one-sided"),
    ],
)
def test_bad_turbulence_args_name_the_key(args, key, needle):
    with pytest.raises(ConfigError, match=rf"alert\.rules\[0\]\.args\.{key}: .*{needle}"):
        _rule_from_config(args)


def test_turbulence_args_survive_the_config_round_trip():
    args = {"threshold": 0.5, "semantics": "1.2.2", "ops": ["min"], "warmup": 2, "skip_nonfinite": True}
    config = load_config({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": args}]}})
    again = load_config(config.to_dict())
    assert again == config
    (rule,) = build_rules(again.alert.rules)
    assert isinstance(rule, RunningMeanTurbulence)
    assert (rule.ops, rule.warmup, rule.skip_nonfinite) == (("min",), 2, True)


# --------------------------------------------------------------------------- z-score


@pytest.mark.parametrize("trend", [True, False])
def test_zscore_matches_the_reference_with_bias_corrected_variance(make_record, trend):
    rng = np.random.default_rng(5)
    names = ("a", "b", "c", "d")
    series = rng.lognormal(0.0, 0.5, size=(400, len(names), 1))
    series *= np.exp(-0.02 * np.arange(400))[:, None, None] if trend else 1.0  # a falling norm
    series[rng.random(series.shape) < 0.01] *= 30.0
    series[rng.random(series.shape) < 0.005] = 0.0
    series[rng.random(series.shape) < 0.005] = math.nan
    args = {"threshold": 3.0, "min_ratio": 1.5, "beta": 0.95, "warmup": 3, "trend": trend}
    found = _drive(rules_only([AnomalyZScore(**args)], rank=0), make_record, series, names)
    expected = _expected(series, names, ("norm",), ("norm",), lambda s: _reference_zscore(s, **args))
    assert set(_hits(found)) == expected
    assert len(found) == len(expected) > 10


def test_zscore_forecasts_a_steady_exponential_fall_exactly(make_record):
    """Brown's smoothing follows a straight line in log exactly: a norm halving every step is,
    after warm-up, forecast at the value it then has (the baseline of a spike put there is the
    unspiked value), and the step after the spike, back on the line, is not flagged (the
    forecast moved on over the held-out step). A running mean stays nine halvings behind and
    takes that lag for spread: it flags nothing."""
    series = 2.0 ** -np.arange(80.0)  # Brown's start (a slope of 0) fades as 0.8 ** step
    spiked = series.copy()
    spiked[70] *= 100.0
    (found,) = _drive(rules_only([AnomalyZScore(min_ratio=1.5, threshold=3.0)], rank=0), make_record, spiked)
    assert found.step == 70 and found.baseline == pytest.approx(series[70], rel=1e-3)
    lagging = rules_only([AnomalyZScore(trend=False, min_ratio=1.5, threshold=3.0)], rank=0)
    assert _drive(lagging, make_record, spiked) == []  # nine halvings behind, the lag taken for spread


@pytest.mark.parametrize("seed", range(4))
def test_zscore_sees_a_spike_on_a_norm_falling_steeply_early_in_training(make_record, seed):
    """A small model's gradient norm: falling 8x in the first 12 steps (log noise 0.3), then
    slowly; a 30x spike at step 15 or 25 is flagged there. A running mean lags such a fall by
    several times its step, and the lag entered the spread (only ~1,000x was flagged); without
    a spike nothing is."""
    rng = np.random.default_rng(seed)
    steps = np.arange(40)
    clean = 0.5 * np.exp(-0.17 * np.minimum(steps, 12) - 0.03 * np.maximum(steps - 12, 0))
    clean *= rng.lognormal(0.0, 0.3, size=40)
    assert _drive(rules_only([AnomalyZScore()], rank=0), make_record, clean) == []
    for step in (15, 25):
        spiked = clean.copy()
        spiked[step] *= 30.0
        found = _drive(rules_only([AnomalyZScore()], rank=0), make_record, spiked)
        assert [a.step for a in found] == [step]
        lagging = _drive(rules_only([AnomalyZScore(trend=False)], rank=0), make_record, spiked)
        assert lagging == []  # what the trend's forecast fixes


def test_zscore_sees_a_fault_that_comes_back_and_learns_a_lasting_change(make_record):
    """The same 1000x spike at steps 12, 20 and 28 is flagged each time (entered at once, a
    flagged value widened the spread enough to hide a repeat for about 15 steps); a lasting
    1000x change from step 40 on is flagged at its first two steps, then learnt."""
    series = np.random.default_rng(3).lognormal(0.0, 0.1, size=80)
    for step in (12, 20, 28):
        series[step] *= 1000.0
    series[40:] *= 1000.0
    steps = [a.step for a in _drive(rules_only([AnomalyZScore()], rank=0), make_record, series)]
    assert steps == [12, 20, 28, 40, 41]


def _false_positive_rate(make_record, rule, series):
    """Flagged / judged values (judged: the rule's warm-up is over)."""
    steps, tags = series.shape[:2]
    names = tuple(f"t{i}" for i in range(tags))
    found = _drive(rules_only([rule], rank=0), make_record, series, names)
    return len(found) / (tags * (steps - rule.warmup))


# documented in AnomalyZScore's docstring (100 tags x 10,000 steps, seed 0): 1.1e-3 and 5.0e-6
def test_zscore_false_positive_rate_with_a_lower_threshold_is_as_documented(make_record):
    series = np.random.default_rng(2).lognormal(0.0, 0.5, size=(3000, 100, 1))
    rate = _false_positive_rate(make_record, AnomalyZScore(threshold=4.0, min_ratio=1.0), series)
    assert 0.5e-3 < rate < 2.0e-3


@pytest.mark.parametrize(
    ("spread", "factor", "tensors", "flagged"),
    [
        (0.25, 1 / 5, 1, False),
        (0.05, 1 / 5, 1, True),
        (0.25, 1 / 100, 1, True),
        (0.25, 1 / 8, 1, False),
        (0.25, 1 / 8, 8, True),
        (0.25, 12.0, 1, True),
        (0.05, 5.0, 1, True),
        (0.25, 3.0, 1, False),
    ],
)
def test_zscore_judges_drops_more_strictly_than_rises(make_record, spread, factor, tensors, flagged):
    """Of 8 tensors, ``tensors`` fall or rise by ``factor`` at step 40. One noisy norm (relative
    spread 25%: 6 x 0.25 > the 80% or 88% lost) falling 5x or 8x is noise; a quiet one (5%), a
    100x fall (beyond 16x) or all 8 falling 8x together are alarms; rises are judged on the log
    scale (log 12 > 6 x 0.25)."""
    series = np.random.default_rng(9).lognormal(0.0, spread, size=(60, 8, 1))
    series[40, :tensors] = np.exp(np.log(series[:40, :tensors]).mean(axis=0)) * factor
    names = tuple(f"w{i}" for i in range(8))
    found = _drive(rules_only([AnomalyZScore()], rank=0), make_record, series, names)
    assert ((40, "0:w0/rank0/post_grad") in {(a.step, a.tag_name) for a in found}) is flagged


def test_zscore_false_positive_rate_with_defaults_is_as_documented(make_record):
    series = np.random.default_rng(3).lognormal(0.0, 0.5, size=(3000, 100, 1))
    assert _false_positive_rate(make_record, AnomalyZScore(), series) < 5e-5
    quiet = np.random.default_rng(4).lognormal(0.0, 0.1, size=(3000, 100, 1))
    assert _false_positive_rate(make_record, AnomalyZScore(), quiet) == 0.0


def test_zscore_bias_correction_keeps_a_slow_beta_quiet_after_warmup(make_record):
    # uncorrected, the variance of beta 0.99 starts near zero and 10 values later still alarms often
    series = np.random.default_rng(6).lognormal(0.0, 0.5, size=(100, 100, 1))
    assert (
        _false_positive_rate(make_record, AnomalyZScore(threshold=6.0, min_ratio=1.0, beta=0.99), series)
        == 0.0
    )


# --------------------------------------------------------------------------- state round trip


def _rules():
    return [
        AnomalyNan(),
        AnomalyZScore(threshold=4.0, min_ratio=2.0, warmup=5),
        msprobe_later(0.5, two_sided=True, warmup=3),
        RunningMeanTurbulence(0.3),
    ]


def _feed(detector, make_record, steps):
    """Two data types; tags of 'late' appear at step 40, so the tag tables grow mid-run."""
    found = []
    for step in steps:
        rng = np.random.default_rng(step)
        early = ("a", "b", "c")
        names = early + (("late",) if step >= 40 else ())
        values = rng.lognormal(0.0, 0.5, size=(len(names), 2))
        if step % 17 == 0:
            values[0, 0] = math.nan
        if step % 23 == 0:
            values[1, 1] *= 40.0
        found += detector.evaluate(make_record("grad_reduced", step, names, values, ("norm", "min")))
        found += detector.evaluate(make_record("exp_avg", step, early, values[:3, :1] * 3.0, ("norm",)))
    return [json.dumps(a.to_json(), sort_keys=True) for a in found]


@pytest.mark.parametrize("own_verdicts", [False, True])
@pytest.mark.parametrize("transport", ["none", "json", "pickle"])
def test_state_round_trip_continues_exactly_like_an_uninterrupted_run(make_record, transport, own_verdicts):
    """With the detector's own verdicts (non-finite, moved alone) the norm levels they measure
    against are part of the state too: a NaN after the resume names the same baseline."""

    def detector():
        return Detector(_rules(), rank=0) if own_verdicts else rules_only(_rules(), rank=0)

    whole = detector()
    expected = _feed(whole, make_record, range(100))

    first = detector()
    before = _feed(first, make_record, range(60))
    state = first.state_dict()
    if transport == "json":
        state = json.loads(json.dumps(state))
    elif transport == "pickle":
        state = pickle.loads(pickle.dumps(state))
    resumed = detector()
    resumed.load_state_dict(state)
    after = _feed(resumed, make_record, range(60, 100))

    assert before + after == expected
    assert len(expected) > 20
    assert json.dumps(resumed.state_dict(), sort_keys=True) == json.dumps(whole.state_dict(), sort_keys=True)


def test_state_holds_tag_tables_and_per_rule_arrays(make_record):
    detector = rules_only([msprobe_later(0.5)], rank=0)
    _drive(detector, make_record, [[2.0, -4.0], [4.0, -8.0]], names=("x",), ops=("norm", "min"))
    state = detector.state_dict()
    assert state["tags"] == {"grad_reduced": [_tag("x")]}
    (entry,) = state["baselines"]
    assert (entry["prefix"], entry["ops"]) == ("grad_reduced", ["norm", "min"])
    # the rule judges norm and mean only: the min column keeps no history
    ema, spread = [[0.99 * 2.0 + 0.01 * 4.0, 0.0]], [[(1.0 - 0.9) * abs(4.0 - 2.0), 0.0]]
    assert entry["states"] == [{"ema": ema, "spread": spread, "count": [[2.0, 0.0]]}]
    assert state["rules"] == [
        {
            "rule": "AnomalyTurbulence",
            "args": {
                "floor": 0.0,
                "noise": 0.0,
                "ops": ["norm", "mean"],
                "skip_nonfinite": True,
                "threshold": 0.5,
                "two_sided": False,
                "warmup": 1,
            },
        }
    ]


def test_a_zscore_state_saved_before_the_trend_loads_with_its_running_mean_as_level(make_record):
    """A state saved by the version without ``trend`` (no such argument, no ``mean2``) is that
    rule's running mean: it starts both smoothings, so the first forecast is that mean."""
    earlier = rules_only([AnomalyZScore(trend=False)], rank=0)
    _feed(earlier, make_record, range(30))
    state = json.loads(json.dumps(earlier.state_dict()))
    del state["rules"][0]["args"]["trend"]
    for entry in state["baselines"]:
        for saved in entry["states"]:
            del saved["mean2"]
    resumed = rules_only([AnomalyZScore()], rank=0)
    resumed.load_state_dict(state)
    loaded = resumed.state_dict()["baselines"]
    assert [e["states"][0]["mean2"] for e in loaded] == [e["states"][0]["mean"] for e in state["baselines"]]
    with pytest.raises(ValueError, match="other anomaly rules"):  # an explicit trend: false is another rule
        rules_only([AnomalyZScore()], rank=0).load_state_dict(earlier.state_dict())
    state["rules"][0]["args"] = None  # malformed: refused as such, not a TypeError
    with pytest.raises(ValueError, match="other anomaly rules"):
        rules_only([AnomalyZScore()], rank=0).load_state_dict(state)


def test_state_of_a_fresh_detector_loads(make_record):
    fresh = rules_only(_rules(), rank=0)
    other = rules_only(_rules(), rank=0)
    other.load_state_dict(fresh.state_dict())
    assert _feed(other, make_record, range(30)) == _feed(rules_only(_rules(), rank=0), make_record, range(30))


@pytest.mark.parametrize(
    "configured",
    [
        [
            AnomalyNan(),
            AnomalyZScore(threshold=4.0, min_ratio=2.0, warmup=5),
            msprobe_later(0.5, warmup=3),
            RunningMeanTurbulence(0.3),
        ],  # two_sided differs
        _rules()[:3],  # a rule fewer
        [
            AnomalyNan(),
            AnomalyZScore(threshold=4.0, min_ratio=2.0, warmup=5),
            msprobe_later(0.5, two_sided=True, warmup=3),
            msprobe_later(0.3),
        ],  # later vs 1.2.2
    ],
)
def test_loading_a_state_saved_with_other_rules_is_refused(make_record, configured):
    saved = rules_only(_rules(), rank=0)
    _feed(saved, make_record, range(5))
    target = rules_only(configured, rank=0)
    _feed(target, make_record, range(3))
    before = json.dumps(target.state_dict(), sort_keys=True)
    with pytest.raises(ValueError, match="saved with other anomaly rules"):
        target.load_state_dict(saved.state_dict())
    assert json.dumps(target.state_dict(), sort_keys=True) == before


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda s: s.update(version=99), "version 1"),
        (lambda s: s.pop("tags"), "malformed"),
        (lambda s: s["baselines"][0]["states"][1].pop("var"), "fields"),
        (lambda s: s["baselines"][0]["states"][1]["var"].append([1.0, 1.0]), "shape"),
        (lambda s: s["baselines"][0].update(ops=["norm"]), "shape"),
    ],
)
def test_a_malformed_state_is_refused_and_changes_nothing(make_record, mutate, needle):
    saved = rules_only(_rules(), rank=0)
    _feed(saved, make_record, range(5))
    state = json.loads(json.dumps(saved.state_dict()))
    mutate(state)
    target = rules_only(_rules(), rank=0)
    with pytest.raises(ValueError, match=needle):
        target.load_state_dict(state)
    assert target.state_dict()["tags"] == {}


def test_a_non_mapping_state_is_refused():
    with pytest.raises(ValueError, match="expected a mapping"):
        rules_only(_rules(), rank=0).load_state_dict([1, 2])


@pytest.mark.parametrize(
    ("ratios", "common"),
    [
        ((1e-3, 1e-3, 1e-3, 10.0), 1e-3),  # clipping shrank every gradient but one: together
        ((1000.0, 1000.0, 1200.0, 900.0), 1000.0),  # a loss spike: together
        ((1.0, 1.1, 0.9, 483.0), 1.0),  # one moved, the rest stayed: together, at 1
        ((2.2, 0.83, 483.0), math.nan),  # three pieces under ZeRO, one corrupted: no common move
        ((2.2, 1.5, 483.0), math.nan),  # two that agree are not a data type moving as a whole
        ((2.0, 3.0), math.nan),  # too few to say
    ],
)
def test_a_data_types_common_move_is_there_only_when_its_tensors_moved_together(ratios, common):
    from monitor.anomaly.moves import common_move

    got = math.exp(common_move(np.log(np.array(ratios))))
    assert got == pytest.approx(common, rel=0.06, nan_ok=True)
