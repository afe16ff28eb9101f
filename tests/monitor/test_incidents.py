"""Records once per tag, incidents per cause, and the root of an incident (framework-free).

Steps are driven through the real Detector and IncidentTracker with hand-made records whose
numbers say exactly what happened, so each expectation can be read off the series.
"""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest

from monitor.anomaly.detector import Detector
from monitor.anomaly.incident_files import merge
from monitor.anomaly.incidents import CLOSE_AFTER, FRESH_AFTER, MAX_UNJUDGED_STEPS, AnomalySink
from monitor.anomaly.root import choose_root, describe_root
from monitor.anomaly.rules import AnomalyTurbulence, AnomalyZScore
from monitor.record import RowSet, StepRecord

NAMES = ("layers.0.fc", "layers.1.fc", "layers.2.fc", "layers.3.fc")


class Run:
    """One rank's detector and sink, fed one dict of records per step."""

    def __init__(
        self, rules=None, rank: int = 0, names: tuple[str, ...] = NAMES, world_size: int | None = None
    ) -> None:
        detector = Detector(rules if rules is not None else [AnomalyZScore()], rank=rank)
        self.sink = AnomalySink(detector, world_size=world_size)
        self.rank = rank
        self.names = names
        self._rows: dict[str, RowSet] = {}

    def step(self, step: int, records: dict[str, np.ndarray], ops=("norm",)) -> None:
        names = self.names
        for task, values in records.items():
            rows = self._rows.setdefault(task, RowSet.build([0] * len(names), list(names), self.rank, task))
            array = np.asarray(values, dtype=np.float64).reshape(len(names), len(ops))
            self.sink.write(StepRecord(task, step, tuple(ops), rows, array, np.arange(len(names))))
        self.sink.end_step(step)

    @property
    def records(self):
        return self.sink.found

    @property
    def incidents(self):
        return self.sink.tracker.incidents


def _noise(rng, scale=1.0):
    return scale * rng.lognormal(0.0, 0.05, len(NAMES))


def _clean(run: Run, rng, steps, tasks=("actv", "acc_grad", "post_grad")) -> None:
    for step in steps:
        run.step(step, {task: _noise(rng) for task in tasks})


def test_a_nan_that_stays_is_one_incident_with_one_record_per_tag(caplog):
    rng = np.random.default_rng(0)
    run = Run()
    _clean(run, rng, range(20))
    with caplog.at_level(logging.INFO, logger="trainmon"):
        for step in range(20, 60):  # layer 1's output is NaN from step 20 on, and everything after it
            actv = _noise(rng)
            actv[1:] = math.nan
            run.step(
                step, {"actv": actv, "acc_grad": np.full(4, math.nan), "post_grad": np.full(4, math.nan)}
            )
    (incident,) = run.incidents
    assert incident.onset_step == 20 and incident.state == "open"
    assert incident.root["tag_name"] == "0:layers.1.fc/rank0/actv" and incident.root["rule"] == "NonFinite"
    tags = [r.tag_name for r in run.records]
    assert len(tags) == len(set(tags)) == 3 + 4 + 4
    assert incident.abnormal_steps == 40
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "incident 1 at step 20" in warnings[0].getMessage()


def test_an_incident_prints_as_one_line():
    rng = np.random.default_rng(1)
    run = Run()
    _clean(run, rng, range(15))
    values = _noise(rng)
    values[2] = math.nan
    run.step(15, {"actv": values, "acc_grad": values, "post_grad": values})
    (incident,) = run.incidents
    text = repr(incident)
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith("Incident(1, step 15, rank 0, open, root 0:layers.2.fc") and "3 records)" in text


@pytest.mark.parametrize(
    "tag, said",
    [
        ("0:.input:1/rank0/actv", " [the model's own input] "),
        ("0:.output_grad_0:0/rank0/actv_grad", " [the model's own output's gradient] "),
        ("0:layers.0.fc.input:0/rank0/actv", None),
    ],
)
def test_the_root_modules_rows_are_named_for_what_they_are_in_console_lines(tag, said):
    line = describe_root({"tag_name": tag, "op": "norm", "value": 5.0, "baseline": 1.0, "rule": "R"})
    assert line.startswith(f"root {tag}")
    assert (said in line) if said else ("model's own" not in line), line


@pytest.mark.parametrize("stage", [0, 2])
def test_a_root_in_a_later_pipeline_stage_says_its_layers_count_anew(stage):
    """Megatron numbers each stage's layers from 0: layers.0 on stage 2 is not the model's first."""
    root = {"tag_name": "0:layers.0.mlp.output:0/rank5/actv", "op": "norm", "value": 5.0, "pp_stage": stage}
    line = describe_root({**root, "baseline": 1.0, "rule": "R"})
    assert ("[pipeline stage 2, whose layers count from 0]" in line) == (stage == 2), line


def test_a_tag_that_stays_abnormal_is_one_record_and_a_new_episode_is_another():
    run = Run(rules=[AnomalyTurbulence(0.5, warmup=1, noise=0, floor=0)])
    values = [1.0] * 5 + [10.0, 100.0, 1000.0] + [1.0] * 10 + [1e6] + [1.0] * 10
    for step, value in enumerate(values):
        run.step(step, {"post_grad": [1.0, value, 1.0, 1.0]})
    assert [(r.step, r.tag_name) for r in run.records] == [
        (5, "0:layers.1.fc/rank0/post_grad"),
        (18, "0:layers.1.fc/rank0/post_grad"),
    ]
    first, second = run.incidents
    assert (first.onset_step, first.state, first.closed_step) == (5, "closed", 7 + CLOSE_AFTER)
    assert (second.onset_step, second.state) == (18, "closed")


def test_a_nan_that_stays_is_not_recorded_again_after_a_step_without_its_row():
    """The last step of an epoch may have fewer micro-batches: a tag of the missing micro-step has
    no row there, which is no return to normal."""
    rng = np.random.default_rng(0)
    run = Run()
    _clean(run, rng, range(20), tasks=("actv",))
    short = RowSet.build([0, 0], list(NAMES[:2]), 0, "actv")
    for step in range(20, 30):
        if step == 24:  # only layers 0 and 1 have rows at this step
            values = np.array([[1.0], [math.nan]])
            run.sink.write(StepRecord("actv", step, ("norm",), short, values, np.arange(2)))
            run.sink.end_step(step)
        else:
            run.step(step, {"actv": [1.0, math.nan, math.nan, math.nan]})
    assert sorted(r.tag_name for r in run.records) == [f"0:{name}/rank0/actv" for name in NAMES[1:]]
    (incident,) = run.incidents
    assert incident.abnormal_steps == 10


def test_a_tag_absent_after_its_incident_closed_is_judged_afresh_when_it_returns():
    """An expert routed no tokens for a while: its NaN coming back long after the incident closed
    is a new fault, with a record and an incident of its own."""
    rng = np.random.default_rng(0)
    run = Run()
    _clean(run, rng, range(20), tasks=("actv",))
    short = RowSet.build([0] * 3, list(NAMES[:3]), 0, "actv")
    for step in range(20, 46):
        if 22 <= step < 45:  # layer 3 has no row
            run.sink.write(StepRecord("actv", step, ("norm",), short, _noise(rng)[:3, None], np.arange(3)))
            run.sink.end_step(step)
        else:
            actv = _noise(rng)
            actv[3] = math.nan
            run.step(step, {"actv": actv})
    assert [(r.step, r.tag_name) for r in run.records] == [
        (20, "0:layers.3.fc/rank0/actv"),
        (45, "0:layers.3.fc/rank0/actv"),
    ]
    assert [(i.onset_step, i.state) for i in run.incidents] == [(20, "closed"), (45, "open")]


def test_a_spike_that_turns_into_nan_is_one_record():
    """A rule's hit followed by NaN on the same tag is one event: the NaN steps are counted by the
    incident, not recorded again."""
    run = Run(rules=[AnomalyTurbulence(0.5, warmup=1, noise=0, floor=0)])
    values = [1.0] * 5 + [1000.0] + [math.nan] * 5
    for step, value in enumerate(values):
        run.step(step, {"acc_grad": [1.0, value, 1.0, 1.0]})
    assert [(r.step, r.tag_name) for r in run.records] == [(5, "0:layers.1.fc/rank0/acc_grad")]
    (incident,) = run.incidents
    assert (incident.onset_step, incident.abnormal_steps, incident.state) == (5, 6, "open")


def test_the_first_abnormal_forward_activation_is_the_root_nearest_the_input():
    rng = np.random.default_rng(1)
    run = Run()
    _clean(run, rng, range(15))
    actv = _noise(rng)
    actv[2:] *= 1e4  # layer 2 blows up, layer 3 follows
    run.step(15, {"actv": actv, "acc_grad": _noise(rng, 1e4), "post_grad": _noise(rng, 1e4)})
    (incident,) = run.incidents
    assert incident.root["tag_name"] == "0:layers.2.fc/rank0/actv"
    assert "forward activations" in incident.evidence[0]


def test_under_clipping_the_tensor_that_moved_alone_is_the_root():
    """One element of layer 1's gradient is corrupted after backward; clipping then shrinks every
    reduced gradient by 1e-3 and all of them are flagged, but only layer 1 rose against the rest."""
    rng = np.random.default_rng(2)
    run = Run()
    _clean(run, rng, range(15), tasks=("acc_grad", "post_grad"))
    reduced = _noise(rng, 1e-3)
    reduced[1] = 10.0
    run.step(15, {"acc_grad": _noise(rng), "post_grad": reduced})
    (incident,) = run.incidents
    assert incident.root["tag_name"] == "0:layers.1.fc/rank0/post_grad"
    assert any("moved x" in line and "together" in line for line in incident.evidence)
    assert any("no local gradient was" in line for line in incident.evidence)


def test_the_one_tensor_that_stayed_while_every_other_rose_is_not_a_culprit():
    """Every gradient but one grew x30 (a learning rate blowing up, say): a common rise has no
    clipping or scaling behind it, so the tensor that stayed is not recorded as MovedAlone."""
    rng = np.random.default_rng(8)
    run = Run()
    _clean(run, rng, range(15), tasks=("acc_grad", "post_grad"))
    rose = _noise(rng) * np.array([30.0, 30.0, 30.0, 1.0])
    run.step(15, {"acc_grad": rose, "post_grad": rose})
    assert run.incidents and all(r.rule != "MovedAlone" for r in run.records), [r.rule for r in run.records]
    assert "layers.3.fc" not in str([r.tag_name for r in run.records])


def test_the_one_local_gradient_still_moving_while_every_other_fell_is_not_a_culprit():
    """Every local gradient but one fell x1e-6 (the network's units died): local gradients are
    read before clipping, so their common fall is no clipping and the one that moved otherwise
    is not recorded as MovedAlone."""
    rng = np.random.default_rng(9)
    run = Run()
    _clean(run, rng, range(15), tasks=("acc_grad",))
    run.step(15, {"acc_grad": _noise(rng) * np.array([1e-6, 1e-6, 1e-6, 1.4])})
    assert run.incidents and all(r.rule != "MovedAlone" for r in run.records), [r.rule for r in run.records]


def test_a_fault_long_after_an_open_incident_last_grew_is_an_incident_of_its_own(caplog):
    """One layer's gradient turns NaN at step 15 and stays NaN (its incident stays open); a spike
    of another layer at step 30, FRESH_AFTER steps and more after anything new joined the first,
    is a second incident with its own console line, the first staying open; a record two steps
    after an onset is its echo and joins it."""
    rng = np.random.default_rng(12)
    run = Run()
    _clean(run, rng, range(15), tasks=("acc_grad",))
    for step in range(15, 40):
        values = _noise(rng)
        values[0] = np.nan
        values[2] *= 1000.0 if step == 30 else 1.0
        values[3] *= 1000.0 if step == 32 else 1.0
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            run.step(step, {"acc_grad": values})
    first, second = run.incidents
    assert (first.onset_step, first.state) == (15, "open")
    assert (second.onset_step, second.root["tag_name"]) == (30, "0:layers.2.fc/rank0/acc_grad")
    assert {r["tag_name"] for r in second.records} >= {"0:layers.3.fc/rank0/acc_grad"}  # its echo
    assert [line for line in caplog.messages if "incident 2 at step 30" in line]
    assert FRESH_AFTER <= 30 - 15


def test_three_pieces_that_did_not_move_together_are_not_said_to_have_been_rescaled():
    """A rank holding three pieces of a sharded model, one corrupted (x483) while the other two
    wobble as usual (x1.5, x2.2): no clipping or loss scaling is claimed for the rest."""
    names = NAMES[:3]
    rng = np.random.default_rng(4)
    run = Run(names=names)
    for step in range(15):
        run.step(step, {"post_grad": 1.0 * rng.lognormal(0.0, 0.05, len(names))})
    run.step(15, {"post_grad": np.array([1.5, 2.2, 483.0])})
    (incident,) = run.incidents
    assert incident.root["tag_name"] == "0:layers.2.fc/rank0/post_grad"
    assert not any("clipping or loss scaling" in line for line in incident.evidence), incident.evidence


def test_a_second_spike_is_measured_against_the_level_before_the_first():
    """Two x1000 spikes of every gradient, ten steps apart: the first is not taken into the
    tensors' levels, so the second's ratio (and its data type's common move) is still ~1000
    where blending it in had made it about 770."""
    rng = np.random.default_rng(5)
    run = Run()
    _clean(run, rng, range(30), tasks=("acc_grad",))
    for step in range(30, 45):
        run.step(step, {"acc_grad": _noise(rng, 1000.0 if step in (32, 42) else 1.0)})
    onsets = [incident.onset_step for incident in run.incidents]
    assert onsets == [32, 42], onsets
    second = [r for r in run.incidents[1].records]
    assert all(800 < r["ratio"] < 1250 and 800 < r["common"] < 1250 for r in second), second


def test_parameters_the_step_started_from_come_before_its_forward():
    rng = np.random.default_rng(3)
    run = Run()
    _clean(run, rng, range(15), tasks=("param_origin", "actv"))
    params, actv = _noise(rng), _noise(rng)
    params[3], actv[3] = 1e4, 1e4  # a flipped weight in layer 3 and its output
    run.step(15, {"param_origin": params, "actv": actv})
    assert run.incidents[0].root["tag_name"] == "0:layers.3.fc/rank0/param_origin"


@pytest.mark.parametrize("rules", [None, [AnomalyTurbulence(0.5)]], ids=["zscore", "turbulence"])
def test_a_norm_that_drops_to_zero_is_an_incident(rules):
    rng = np.random.default_rng(4)
    run = Run(rules)
    _clean(run, rng, range(25), tasks=("acc_grad",))
    for step in range(25, 35):
        grads = _noise(rng)
        grads[0] = 0.0  # layer 0's gradients died
        run.step(step, {"acc_grad": grads})
    (incident,) = run.incidents
    assert (incident.onset_step, incident.root["tag_name"]) == (25, "0:layers.0.fc/rank0/acc_grad")
    assert len(run.records) == 1


@pytest.mark.parametrize("rules", [None, [AnomalyTurbulence(0.5)]], ids=["zscore", "turbulence"])
def test_a_norm_of_rounding_noise_that_rounds_to_zero_is_no_incident(rules):
    """A weight the data leaves mathematically without gradient (ZeRO-3's piece of Q/K rows on
    identical tokens): its norm is rounding noise, 1e-9 of the others', and now and then exactly
    zero; only a norm at a visible level that vanishes is a dead layer."""
    rng = np.random.default_rng(4)
    run = Run(rules)
    for step in range(35):
        grads = _noise(rng)
        grads[0] = 1e-9 * grads[0] if step < 25 or step % 2 else 0.0
        run.step(step, {"acc_grad": grads})
    assert run.incidents == [] and run.records == []


@pytest.mark.parametrize("rules", [[], [AnomalyTurbulence(0.5)]])
def test_non_finite_is_an_anomaly_whatever_the_rules(rules):
    run = Run(rules=rules)
    for step in range(5):
        run.step(step, {"acc_grad": [1.0, math.inf if step == 3 else 1.0, 1.0, 1.0]})
    assert [(r.step, r.rule) for r in run.records] == [(3, "NonFinite")]


def test_a_clean_noisy_run_opens_no_incident():
    rng = np.random.default_rng(5)
    run = Run(rules=[AnomalyZScore()])  # the recommended template
    for step in range(500):
        run.step(step, {"actv": rng.lognormal(0, 0.3, 4), "post_grad": rng.lognormal(0, 0.3, 4)})
    assert run.incidents == [] and run.records == []


def _rank_incidents(step, faulty_rank, ranks=4):
    """Per-rank incidents as each rank writes them: the faulty rank's local gradient is abnormal
    (and then, through the all-reduce, every rank's reduced gradient)."""
    out = []
    for rank in range(ranks):
        run = Run(rank=rank)
        rng = np.random.default_rng(10 + rank)
        _clean(run, rng, range(15), tasks=("acc_grad", "post_grad"))
        local = _noise(rng)
        if rank == faulty_rank:
            local[2] *= 1e4
        reduced = _noise(rng)
        reduced[2] *= 1e4 / ranks
        run.step(step, {"acc_grad": local, "post_grad": reduced})
        out += [incident.to_json() for incident in run.incidents]
    return out


def test_merged_across_ranks_the_rank_whose_local_gradient_broke_is_named():
    (merged,) = merge(_rank_incidents(15, faulty_rank=2))
    assert merged.ranks == [0, 1, 2, 3]
    assert merged.root["tag_name"] == "0:layers.2.fc/rank2/acc_grad"
    assert any("only rank 2 shows it" in line for line in merged.evidence)


@pytest.mark.parametrize("world_size", [1, 4, None], ids=["one process", "four ranks", "older files"])
def test_merged_the_run_size_its_ranks_recorded_words_a_gradient_changed_after_backward(world_size):
    """A reduced gradient abnormal with no local one: merged, a one-process run's evidence names
    neither the reduction nor a peer (nothing was reduced); the merged record keeps the size."""
    run = Run(rank=0)
    rng = np.random.default_rng(40)
    _clean(run, rng, range(15), tasks=("acc_grad", "post_grad"))
    edited = _noise(rng)
    edited[1] *= 1e4
    run.step(15, {"acc_grad": _noise(rng), "post_grad": edited})
    incidents = [incident.to_json() for incident in run.incidents]
    for incident in incidents:
        incident["world_size"] = world_size  # as a rank writes it (MonitorCore knows the run's size)
    (merged,) = merge(incidents)
    (said,) = [line for line in merged.evidence if "changed after backward" in line]
    assert ("reduction" in said) == (world_size != 1), said
    assert merged.to_json(1)["world_size"] == world_size


def test_a_merged_incident_is_abnormal_from_its_onset_to_its_last_abnormal_step_on_any_rank():
    incidents = _rank_incidents(15, faulty_rank=2)
    incidents[-1]["last_abnormal_step"] = 19
    (merged,) = merge(incidents)
    assert merged.last_abnormal_step == 19
    assert [s for s in range(13, 23) if merged.abnormal_at(frozenset({s}))] == list(range(15, 20))
    assert merged.abnormal_at(frozenset({3, 17})) and not merged.abnormal_at(frozenset({14, 20}))


def test_merged_the_tensor_that_moved_against_clipping_on_every_rank_is_the_root():
    """A reduced gradient edited after the all-reduce, then clipped: every rank sees the same
    tensor rise while clipping shrank the others; each rank's copy of it must not count as a
    rival that hides it."""
    incidents = []
    for rank in range(4):
        run = Run(rank=rank)
        rng = np.random.default_rng(30)  # the same reduced gradients on every rank
        _clean(run, rng, range(15), tasks=("post_grad",))
        clipped = _noise(rng) / 300.0
        clipped[1] = 8.0 * _noise(rng)[1]
        run.step(15, {"post_grad": clipped})
        incidents += [incident.to_json() for incident in run.incidents]
    (merged,) = merge(incidents)
    assert re.fullmatch(r"0:layers\.1\.fc/rank[0-3]/post_grad", merged.root["tag_name"]), (
        merged.root,
        merged.evidence,
    )
    assert any("moved x" in line for line in merged.evidence)


def test_merged_with_every_rank_abnormal_the_rank_far_from_its_peers_is_the_root():
    """A cause every rank shares (a learning-rate jump, say) lifts one activation x30 on each of
    four ranks, and rank 3's x3000: no rank is alone in the phase, so the one whose value lies far
    from its peers' median is named (the others' records come first in the computed order)."""
    incidents = []
    for rank in range(4):
        run = Run(rank=rank)
        rng = np.random.default_rng(40 + rank)
        _clean(run, rng, range(15), tasks=("actv",))
        values = _noise(rng)
        values[1] *= 3000.0 if rank == 3 else 30.0
        run.step(15, {"actv": values})
        incidents += [incident.to_json() for incident in run.incidents]
    (merged,) = merge(incidents)
    assert merged.ranks == [0, 1, 2, 3]
    assert merged.root["tag_name"] == "0:layers.1.fc/rank3/actv", (merged.root, merged.evidence)
    (peer_line,) = [line for line in merged.evidence if "off its peers' median" in line]
    factor = float(re.search(r"x([0-9.]+) off", peer_line).group(1))
    assert 50 < factor < 200, peer_line  # about 3000 / 30


def test_merged_the_rank_abnormal_first_is_the_root_though_another_shows_an_earlier_phase_later():
    """Rank 0's reduced gradient breaks at step 15; rank 1's activations only at step 16 (within
    the merge window): the root is rank 0's at step 15, not rank 1's earlier phase a step later."""
    incidents = []
    for rank, step, task in ((0, 15, "post_grad"), (1, 16, "actv")):
        run = Run(rank=rank)
        rng = np.random.default_rng(20 + rank)
        _clean(run, rng, range(step), tasks=("actv", "post_grad"))
        values = {"actv": _noise(rng), "post_grad": _noise(rng)}
        values[task][1] *= 1e4
        run.step(step, values)
        incidents += [incident.to_json() for incident in run.incidents]
    (merged,) = merge(incidents)
    assert merged.ranks == [0, 1] and merged.onset_step == 15
    assert merged.root["tag_name"] == "0:layers.1.fc/rank0/post_grad", merged.root
    assert merged.root["step"] == 15 and merged.onset_rank == 0
    as_json = merged.to_json(1)
    assert (as_json["onset_rank"], as_json["onset_micro_step"]) == (0, 0)
    assert as_json["data_types"] == {"actv": 1, "post_grad": 1}, as_json["data_types"]


def test_choose_root_prefers_non_finite_within_the_first_phase():
    records = [
        {
            "rank": 0,
            "step": 4,
            "micro_step": 0,
            "call_id": 0,
            "tag_name": "0:a/rank0/actv",
            "rule": "X",
            "ratio": 50.0,
            "common": 1.0,
        },
        {
            "rank": 0,
            "step": 4,
            "micro_step": 0,
            "call_id": 1,
            "tag_name": "0:b/rank0/actv",
            "rule": "NonFinite",
            "ratio": "nan",
            "common": "nan",
        },
    ]
    root, evidence = choose_root(records)
    assert root["tag_name"] == "0:b/rank0/actv"
    assert any("non-finite" in line for line in evidence)


@pytest.mark.parametrize(
    "ranks, world_size",
    [((1,), None), ((1,), 2), ((0, 1), 2), ((0,), 1)],
    ids=["one rank's own records", "one of two ranks", "merged", "one process"],
)
def test_reduced_gradients_abnormal_with_no_local_one_say_where_they_may_have_changed(ranks, world_size):
    """A rank's own records cannot tell a peer's gradient received in the reduction from a fault
    of its own; merged over the ranks, no local gradient anywhere was abnormal; in one process
    nothing was reduced."""
    records = [
        {"rank": r, "step": 4, "micro_step": 0, "call_id": 0, "tag_name": f"0:a/rank{r}/post_grad",
         "rule": "X", "ratio": 50.0, "common": 1.0}
        for r in ranks
    ]  # fmt: skip
    _, evidence = choose_root(records, world_size)
    (said,) = [line for line in evidence if "changed after backward" in line]
    assert ("another rank's gradient reached it" in said) == (len(ranks) == 1 and world_size != 1), said
    assert ("reduction" in said) == (world_size != 1), said
    together = [{**r, "common": 8.0, "ratio": 9.0} for r in records]  # every reduced gradient moved
    _, evidence = choose_root(together, world_size)
    (said,) = [line for line in evidence if "rescaled after backward" in line]
    assert ("reduction" in said) == (world_size != 1), said
    assert ("another rank's gradients reached them" in said) == (len(ranks) == 1 and world_size != 1), said


def test_without_local_gradients_recorded_a_reduced_one_is_not_said_to_have_changed_after_backward():
    """FSDP reducing at every micro-batch leaves no local gradient to record: a reduced gradient
    abnormal at a step with none recorded may have begun anywhere before the reduction, on any
    rank; said so by the rank's incident and by the incidents merged over ranks."""
    rng = np.random.default_rng(6)
    run = Run(world_size=2)
    _clean(run, rng, range(15), tasks=("post_grad",))
    spiked = _noise(rng)
    spiked[2] = 500.0
    run.step(15, {"post_grad": spiked})
    (incident,) = run.incidents
    assert incident.root["tag_name"] == "0:layers.2.fc/rank0/post_grad"
    assert not any("changed after backward" in line for line in incident.evidence), incident.evidence
    assert any("local gradients (before reduction) were not recorded" in line for line in incident.evidence)
    (merged,) = merge([incident.to_json()])
    assert any("were not recorded" in line for line in merged.evidence), merged.evidence
    recorded = {**incident.to_json(), "local_gradients_recorded": True}
    (merged,) = merge([recorded])
    assert any("changed after backward" in line for line in merged.evidence), merged.evidence


def test_a_non_finite_root_on_several_ranks_says_the_rank_named_may_not_be_where_it_began():
    """A NaN that tensor parallelism's all-reduce spread: both ranks show the activation NaN at
    the same place, so naming the lowest is said to tell nothing; on one rank alone it does."""
    nan = {"rule": "NonFinite", "value": "nan", "ratio": "nan", "common": "nan"}
    spread = [_record(f"0:fc2.input:0/rank{r}/actv", 3, rank=r, **nan) for r in (0, 1)]
    _, evidence = choose_root(spread, 2)
    assert any("ranks 0, 1 show it non-finite" in line for line in evidence), evidence
    _, evidence = choose_root(spread[1:], 2)
    assert not any("non-finite at the same place" in line for line in evidence), evidence


def _record(tag: str, call_id: int = 0, **fields) -> dict:
    return {"rank": 0, "step": 4, "micro_step": 0, "call_id": call_id, "tag_name": tag, "rule": "X"} | fields


@pytest.mark.parametrize("task, first_stage", [("actv_grad", 1), ("actv", 0)])
def test_merged_over_pipeline_stages_backward_starts_at_the_last_stage(task, first_stage):
    """A loss spike: every stage's activation gradients moved at one step, each rank computing its
    own in the same order (same call ids). Backward starts at the last stage, so its tensor
    nearest the loss is the root; forward starts at the first."""
    records = [
        _record(f"0:layers.1.output_grad:0/rank{stage}/{task}", 7, rank=stage, pp_stage=stage, ratio=1e3)
        for stage in (0, 1)
    ]
    root, _ = choose_root(records, 2)
    assert root["rank"] == root["pp_stage"] == first_stage


def test_a_lone_record_whose_data_type_moved_as_a_whole_is_said_to_share_its_cause():
    """A learning rate x100 moved every parameter (median x3.8); only one was flagged."""
    lone = [_record("0:wte.weight/rank0/param_updated", ratio=4.2, common=3.8)]
    _, evidence = choose_root(lone)
    assert any("moved x3.8 as a whole" in line for line in evidence), evidence
    against = [_record("0:wte.weight/rank0/param_updated", ratio=0.3, common=3.8)]
    _, evidence = choose_root(against)
    assert not any("as a whole" in line for line in evidence), evidence


def test_a_lone_record_that_moved_far_beyond_its_data_types_common_move_is_not_said_to_share_it():
    """One weight x1e4 while the biases, growing from zero, lifted the median to x2.1: the cause
    is that weight's, not one shared by its data type."""
    lone = [_record("0:layers.1.fc1.weight/rank1/param_origin", ratio=1.0035e4, common=2.11)]
    _, evidence = choose_root(lone)
    assert not any("cause is shared" in line for line in evidence), evidence
    assert any("moved x1e+04, far beyond its data type's common move (x2.11)" in line for line in evidence)
    against = [_record("0:wte.weight/rank0/param_updated", ratio=0.001, common=3.8)]
    _, evidence = choose_root(against)
    assert any("moved x0.001, against its data type's common move (x3.8)" in line for line in evidence)
    quiet = [_record("0:layers.1.fc1.weight/rank1/param_origin", ratio=1.0035e4, common=1.01)]
    _, evidence = choose_root(quiet)
    assert any("while the rest of its data type stayed (x1.01)" in line for line in evidence), evidence


def test_a_value_merged_across_ranks_says_the_rank_named_is_not_where_it_came_from():
    """ZeRO with shard_reduce: rank 1's piece of exp_avg was corrupted, and the merged row is the
    same on both ranks: rank 0 is named only as the lowest, which the evidence says; a value
    only one rank shows names that rank without it."""
    merged = [
        _record(f"0:net.2.weight/rank{r}/exp_avg", rank=r, op="norm", value=2130.0, ratio=1e4, common=1.0)
        for r in (0, 1)
    ]
    root, evidence = choose_root(merged)
    assert root["rank"] == 0
    assert any(line.startswith("ranks 0, 1 show the same value") for line in evidence), evidence
    pieces = [{**merged[0], "value": 3.0}, merged[1]]
    _, evidence = choose_root(pieces)
    assert not any("show the same value" in line for line in evidence), evidence
    spread = [{**merged[0], "value": float("nan")}, {**merged[1], "value": float("nan"), "step": 5}]
    _, evidence = choose_root(spread)  # a NaN that reached rank 1 a step later: no replica
    assert not any("show the same value" in line for line in evidence), evidence


def test_a_loss_computed_in_the_model_is_the_activation_that_moved_alone_and_its_gradients_followed():
    """A x1000 loss the model computes in its forward: the model's own output jumps while every
    other activation stays; the activation gradients then move x1000 as a whole. No clipping or
    loss scaling is at work, and the evidence must not say so."""
    loss = [_record("0:.output_1:0/rank0/actv", 9, ratio=962.0, common=1.01)]
    others = [_record(f"0:{n}.output:0/rank0/actv", i, ratio=1.1, common=1.01) for i, n in enumerate("abc")]
    grads = [
        _record(f"0:{n}.output_grad:0/rank0/actv_grad", 10 + i, ratio=990.0, common=1000.0)
        for i, n in enumerate("abc")
    ]
    root, evidence = choose_root([*others, *loss, *grads])
    assert root["tag_name"] == "0:.output_1:0/rank0/actv"
    assert any("moved x962 while the rest of its data type stayed (x1.01)" in line for line in evidence)
    assert not any("clipping" in line for line in evidence), evidence
    assert any("activation gradients that followed moved x1e+03 as a whole" in line for line in evidence)
    # the same pattern follows weights moved far by the last update: the wording names both
    assert any("a loss computed inside the model" in line and "learning rate" in line for line in evidence)


def test_of_a_tensor_that_moved_alone_at_two_micro_steps_the_earlier_is_the_root():
    """A bad loss for a whole step on one rank: micro-step 1 moved a little more than micro-step
    0, which came first."""
    records = [
        _record("0:.output:0/rank1/actv", 5, rank=1, ratio=946.0, common=1.0),
        _record("0:.output:1/rank1/actv", 30, rank=1, micro_step=1, ratio=969.0, common=1.0),
        *(
            _record(f"0:{n}.output:0/rank1/actv", i, rank=1, ratio=1.05, common=1.0)
            for i, n in enumerate("abc")
        ),
    ]
    root, _ = choose_root(records)
    assert root["tag_name"] == "0:.output:0/rank1/actv"


@pytest.mark.parametrize(
    "task, why", [("post_grad", "clipping or loss scaling"), ("acc_grad", "loss scaling")]
)
def test_a_tensor_that_moved_against_its_rescaled_data_type_names_what_can_rescale_it(task, why):
    """Reduced gradients may have been clipped or loss-scaled; local ones, read before clipping,
    only loss-scaled."""
    records = [_record(f"0:{n}/rank0/{task}", i, ratio=0.01, common=0.01) for i, n in enumerate("abc")]
    records.append(_record(f"0:d/rank0/{task}", 3, ratio=5.0, common=0.01))
    root, evidence = choose_root(records)
    assert root["tag_name"] == f"0:d/rank0/{task}"
    assert any(f"({why} rescales every tensor alike)" in line for line in evidence), evidence


def test_reduced_gradients_rescaled_together_with_no_local_one_flagged_are_said_clipped():
    """Local gradients rose x18 unflagged (a noisy history), clipping cut every reduced one x0.2."""
    records = [_record(f"0:{n}/rank0/post_grad", i, ratio=0.21, common=0.2) for i, n in enumerate("abc")]
    _, evidence = choose_root(records)
    (said,) = [line for line in evidence if "no local gradient" in line]
    assert "moved x0.2 together" in said and "clipping" in said and "edited in place" not in said, said
    assert not any("the learning rate" in line for line in evidence), evidence


def test_gradients_turned_non_finite_at_once_say_that_the_one_named_is_only_nearest_the_loss():
    records = [
        _record(f"0:{n}/rank0/acc_grad", i, rule="NonFinite", value="nan", ratio="nan", common="nan")
        for i, n in enumerate("abcd")
    ]
    root, evidence = choose_root(records)
    assert root["tag_name"] == "0:a/rank0/acc_grad"
    assert any("4 tensors turned NaN/Inf at once" in line for line in evidence), evidence
    _, evidence = choose_root(records[:1])
    assert not any("at once" in line for line in evidence), evidence
    one_tensor = [{**r, "tag_name": f"0:a/rank{i}/acc_grad", "rank": i} for i, r in enumerate(records)]
    _, evidence = choose_root(one_tensor)  # one tensor NaN on four ranks: not four tensors
    assert not any("at once" in line for line in evidence), evidence


def test_an_incident_quiet_at_the_end_of_monitoring_is_closed_and_one_still_abnormal_stays_open():
    quiet, stuck = Run(), Run()
    for run, last in ((quiet, 1.0), (stuck, math.nan)):
        for step in range(12):
            run.step(
                step, {"acc_grad": [1.0, math.nan if step == 10 else (last if step == 11 else 1.0), 1, 1]}
            )
        run.sink.close()
    assert (quiet.incidents[0].state, quiet.incidents[0].closed_step) == ("closed", 11)
    assert (stuck.incidents[0].state, stuck.incidents[0].closed_step) == ("open", None)


@pytest.mark.parametrize(
    "broken",
    [
        {"micro_step": None},
        {"call_id": "3"},
        {"step": 2.5},
    ],
)
def test_a_malformed_incident_record_is_skipped_not_fatal(tmp_path, broken):
    import json

    from monitor.anomaly.incident_files import load_incidents

    good = _rank_incidents(15, faulty_rank=2)
    bad = json.loads(json.dumps(good[0]))
    bad["records"][0].update(broken)
    path = tmp_path / "incidents.json"
    path.write_text(json.dumps({"version": 1, "rank": 0, "incidents": [bad, *good[1:]]}))
    loaded = load_incidents([str(path)])
    assert len(loaded) == len(good) - 1
    assert merge(loaded)[0].onset_step == 15


def test_step_batch_ids_keys_that_are_not_step_numbers_are_left_out(tmp_path):
    """A hand-edited or damaged ``step_batch_ids`` never breaks the merge: keys that are not
    ASCII step numbers are left out, the rest are read and ordered by step."""
    import json

    from monitor.anomaly.incident_files import load_incidents

    good = _rank_incidents(15, faulty_rank=2)
    edited = json.loads(json.dumps(good))
    edited[0]["step_batch_ids"] = {"16": [[3]], "07": [[1]], "²": [[2]], "x": [[4]]}
    edited[1]["step_batch_ids"] = ["not", "a", "mapping"]
    path = tmp_path / "incidents.json"
    path.write_text(json.dumps({"version": 1, "rank": 0, "incidents": edited}))
    (merged,) = merge(load_incidents([str(path)]))
    rank = edited[0]["rank"]
    assert merged.to_json(1)["step_batch_ids"] == [
        {"rank": rank, "step": 7, "ids": [[1]]},
        {"rank": rank, "step": 16, "ids": [[3]]},
    ]


class _ScalerVerdict:
    """A loss scaler's say on a step's gradients, given when the step returns (as DeepSpeed's is)."""

    def __init__(self) -> None:
        self.settled, self._judged = False, True

    def settle(self, judged: bool) -> None:
        self._judged, self.settled = judged, True

    def __call__(self) -> bool:
        return self._judged


def _gradients(step: int, value: float, judged) -> StepRecord:
    rows = RowSet.build([0] * len(NAMES), list(NAMES), 0, "acc_grad")
    values = np.full((len(NAMES), 1), value)
    return StepRecord("grad_unreduced", step, ("norm",), rows, values, np.arange(len(NAMES)), judged=judged)


def test_a_skipped_steps_gradients_wait_for_its_end_and_are_left_to_the_scaler():
    """Gradients whose verdict comes when their step returns are held until the step ends; an
    overflow the scaler skipped is no record, until it has skipped MAX_UNJUDGED_STEPS collected
    steps in a row: a scale that never finds a finite gradient is a fault."""
    sink = AnomalySink(Detector([AnomalyZScore()], rank=0))
    for step in range(MAX_UNJUDGED_STEPS + 3):
        verdict = _ScalerVerdict()
        sink.write(_gradients(step, math.inf, verdict))
        assert sink.found == [] or step > MAX_UNJUDGED_STEPS  # held while the step runs
        verdict.settle(False)  # the scaler found the overflow and skipped the update
        sink.end_step(step)
    assert {record.step for record in sink.found} == {MAX_UNJUDGED_STEPS}
    assert {record.tag_name.split("/")[0] for record in sink.found} == {f"0:{name}" for name in NAMES}


def test_skips_between_ordinary_steps_are_never_judged():
    rng = np.random.default_rng(0)
    sink = AnomalySink(Detector([AnomalyZScore()], rank=0))
    for step in range(4 * MAX_UNJUDGED_STEPS):
        skipped = step % 3 == 0
        sink.write(_gradients(step, math.inf if skipped else rng.lognormal(0.0, 0.05), not skipped))
        sink.end_step(step)
    assert sink.found == []


def test_held_gradients_of_a_step_that_never_returned_are_judged():
    """A step that raised never settles its verdict: its held gradients are judged when a later
    step ends, and at close."""
    sink = AnomalySink(Detector([AnomalyZScore()], rank=0))
    sink.write(_gradients(0, math.nan, _ScalerVerdict()))
    sink.end_step(0)
    assert {record.step for record in sink.found} == {0}
    closing = AnomalySink(Detector([AnomalyZScore()], rank=0))
    closing.write(_gradients(5, math.nan, _ScalerVerdict()))
    closing.close()
    assert {record.step for record in closing.found} == {5}


def test_a_forward_root_is_said_to_have_reached_the_gradients_only_where_they_moved_its_way():
    """Activations up x962 and reduced gradients cut x0.1 (clipping): no shared cause is claimed;
    a weight's forward effect moving the other activations is not a gradient phase."""
    loss = _record("0:.output_1:0/rank0/actv", 9, ratio=962.0, common=1.01)
    others = [_record(f"0:{n}.output:0/rank0/actv", i, ratio=1.1, common=1.01) for i, n in enumerate("abc")]
    clipped = [_record(f"0:{n}/rank0/post_grad", 20 + i, ratio=0.1, common=0.1) for i, n in enumerate("abc")]
    _, evidence = choose_root([*others, loss, *clipped])
    assert not any("followed" in line for line in evidence), evidence
    weight = _record("0:a.weight/rank0/param_origin", 1, ratio=100.0, common=1.0)
    moved = [
        _record(f"0:{n}.output:0/rank0/actv", 2 + i, ratio=100.0, common=100.0) for i, n in enumerate("abc")
    ]
    _, evidence = choose_root([weight, *moved])
    assert not any("followed" in line for line in evidence), evidence


def test_a_norm_flagged_step_after_step_enters_its_level():
    """A rule that flags a steadily growing norm at every step must not freeze its level: the
    ratio of a tensor growing 3% a step to its level stays near its few steps' growth."""
    from monitor.anomaly.detector import Detector

    run = Run()
    growing = Detector([AnomalyZScore(threshold=0.0, warmup=1, min_ratio=1.0)], rank=0)
    run.sink = AnomalySink(growing)  # every value after the first is flagged
    for step in range(60):
        run.step(step, {"acc_grad": np.full(len(NAMES), 1.03**step)})
    level, _ = growing._level_arrays("acc_grad")
    assert np.allclose(np.exp(level), 1.03**59, rtol=0.5), np.exp(level)
