"""Every class of fault, injected into real training, is found at its step and named at its root.

A small MLP regression (AdamW, clipping 1.0) trains 50 steps with the recommended rules
(AnomalyNan, AnomalyZScore on norms) over every data type; one fault is injected at step 40,
after the first steps' fast changes. The first incident must start at step 40 (an LR blow-up:
40 or 41) and its root must name the
module the fault was injected into; one-rank faults run on 4 gloo ranks and must name the rank.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from monitor import TrainerMon
from monitor.anomaly.incident_files import merge
from tests.adapters.torch.distributed import run_ranks, save_result

STEPS, AT = 50, 40
CONFIG = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
    "format": "api",
    "alert": {
        "rules": [
            {"rule_name": "AnomalyNan"},
            {"rule_name": "AnomalyZScore", "args": {"threshold": 6.0, "warmup": 10, "min_ratio": 4.0}},
        ]
    },
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.hidden = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for layer in self.hidden:
            x = nn.functional.gelu(layer(x))
        return self.out(x)


@dataclass(frozen=True)
class Fault:
    """A fault, the module a root finder must name, and whether it happens on one rank only."""

    name: str
    module: str | None
    one_rank: bool = False


def _inject_forward(model: Net, fault: str, step: list[int]) -> None:
    """The fault in ``hidden.1``'s output at step AT (on the ranks that call this)."""

    def hook(module, args, output):
        if step[0] != AT:
            return None
        if fault == "nan_activation":
            output = output.clone()
            output[0, 0] = float("nan")
            return output
        return (output.to(torch.float16) * 6e4).to(output.dtype)  # fp16 overflows to Inf

    model.hidden[1].register_forward_hook(hook)


def _train(
    fault: str | None, rank: int = 0, world: int = 1, fault_rank: int = 0, config: dict = CONFIG
) -> TrainerMon:
    torch.manual_seed(0)
    model = Net()
    net = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    step = [0]
    here = rank == fault_rank
    if fault in ("nan_activation", "inf_overflow") and here:  # inside the module: its own output is bad
        _inject_forward(model, fault, step)
    mon = TrainerMon(config)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    generator = torch.Generator().manual_seed(100 + rank)
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    weight = model.hidden[1].weight
    if fault == "grad_before_reduce" and here:
        weight.register_hook(
            lambda g: (
                g.index_put((torch.tensor(0), torch.tensor(0)), g[0, 0] * 1e4) if step[0] == AT else None
            )
        )
    if fault == "dead_layer":
        weight.register_hook(lambda g: torch.zeros_like(g) if step[0] >= AT else None)
    for step[0] in range(STEPS):
        x = torch.randn(16, 8, generator=generator)
        if fault == "bad_batch" and here and step[0] == AT:
            x = x * 1e3
        if fault == "weight_flip" and here and step[0] == AT:  # a bit flip in one rank's copy
            with torch.no_grad():
                model.hidden[2].weight[0, 0] = 1e4
        if fault == "lr_x100" and step[0] == AT:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        loss = (net(x) - x @ target).pow(2).mean()
        if fault == "loss_x1000" and step[0] == AT:
            loss = loss * 1000
        loss.backward()
        if fault == "grad_after_backward" and step[0] == AT:
            with torch.no_grad():
                weight.grad[0, 0] *= 1e4
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    mon.stop()
    return mon


FAULTS = [
    Fault("loss_x1000", None),
    Fault("nan_activation", "hidden.1"),
    Fault("inf_overflow", "hidden.1"),
    Fault("grad_after_backward", "hidden.1.weight"),
    Fault("weight_flip", "hidden.2.weight"),
    Fault("lr_x100", None),
    Fault("dead_layer", "hidden.1.weight"),
]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_a_fault_is_the_first_incident_at_its_step_and_its_module_is_the_root(fault):
    incidents = _train(fault.name).incidents
    assert incidents, f"{fault.name}: no incident"
    first = incidents[0]
    onsets = (AT, AT + 1) if fault.name == "lr_x100" else (AT,)
    assert first.onset_step in onsets, f"{fault.name}: first incident at {first.onset_step}: {first.root}"
    if fault.module is not None:
        assert f":{fault.module}" in first.root["tag_name"], (first.root["tag_name"], first.evidence)


def test_a_nan_that_stays_is_one_incident_with_at_most_one_record_per_tensor():
    """The NaN activation reaches the weights through the update, so every later step is NaN:
    one incident, open to the end and counting those steps, and no tensor recorded twice."""
    mon = _train("nan_activation")
    (incident,) = mon.incidents
    assert (incident.onset_step, incident.state, incident.abnormal_steps) == (AT, "open", STEPS - AT)
    tags = [record.tag_name for record in mon.anomalies]
    assert tags and len(tags) == len(set(tags))
    assert any(record.step > AT for record in mon.anomalies)  # tensors that turned NaN later joined


def test_a_clean_run_opens_no_incident():
    assert _train(None).incidents == []


def test_integer_inputs_such_as_labels_are_recorded_but_never_judged():
    """A classifier fed its labels: a batch whose labels are all class 0 (here every 10th and the
    last) has a labels row of norm 0 and zeros share 1, the ordinary data of a classification run,
    not a layer that died; the clean run opens no incident."""

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Net()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.body(x), labels)

    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(CONFIG).set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    generator = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=generator)
        labels = torch.randint(0, 4, (4,), generator=generator)
        labels = torch.zeros_like(labels) if step % 10 == 9 else labels
        model(x, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    rows = mon._latest("actv")
    mon.stop()
    (labels_row,) = [row for tag, row in rows.items() if tag.startswith("0:.input_1")]
    assert (labels_row["norm"], labels_row["zeros"]) == (0.0, 1.0)  # recorded as it was fed
    assert mon.incidents == [], [incident.root for incident in mon.incidents]


@pytest.mark.parametrize("by_keyword", [True, False])
def test_an_attention_mask_of_minus_inf_is_recorded_but_not_an_incident(by_keyword):
    """nn.Transformer's causal mask is additive: 0 and -inf by design. A model that passes it on
    (by keyword, or by position) has a mask row with -inf in every collected step: recorded, not
    a NaN/Inf fault, so the clean run opens no incident, and a NaN put into the encoder's output
    at step AT is still one, there."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.layer(x, src_mask=src_mask) if by_keyword else self.layer(x, src_mask)
            return self.head(hidden).pow(2).mean()

    torch.manual_seed(0)
    model = Encoder()
    model.layer.register_forward_hook(lambda m, a, out: out * math.nan if poison[0] else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon({**CONFIG, "xy_distribution": True, "all_xy": True})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    poison = [False]
    for step in range(STEPS):
        poison[0] = step == AT
        model(torch.randn(2, 5, 8), mask).backward()
        optimizer.step()
        optimizer.zero_grad()
    rows = mon._latest("actv")
    mon.stop()
    assert any(row["min"] == -math.inf for tag, row in rows.items() if tag.startswith("0:.input_1")), rows
    roots = [incident.root["tag_name"] for incident in mon.incidents]
    assert [incident.onset_step for incident in mon.incidents] == [AT], roots
    assert "layer.output" in mon.incidents[0].root["tag_name"]


class TokenNormalised(nn.Module):
    """The Hugging Face Trainer's way: the model is handed the step's item count (a float
    tensor) and divides each micro-batch's summed loss by it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Net()

    def forward(self, x: torch.Tensor, target: torch.Tensor, num_items: torch.Tensor) -> torch.Tensor:
        return (self.body(x) - target).pow(2).sum() / num_items


def _epochs(batches_per_epoch: int, grad_acc: int, nan_at: int | None = None, spike_at: int | None = None):
    """Epochs of ``batches_per_epoch`` micro-batches, ``grad_acc`` a step: an epoch's last step
    of fewer micro-batches carries them at a larger scale each (its gradient sum at the usual
    one) and hands the model a smaller item count. Returns the monitor and the short steps."""
    torch.manual_seed(0)
    model = TokenNormalised()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(CONFIG).set_monitor(model, grad_acc_steps=grad_acc, optimizer=optimizer)
    generator = torch.Generator().manual_seed(5)
    weights = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    short, step = [], 0
    while step < STEPS:
        for start in range(0, batches_per_epoch, grad_acc):
            micro = min(grad_acc, batches_per_epoch - start)
            short += [step] if micro < grad_acc else []
            for _ in range(micro):
                x = torch.randn(16, 8, generator=generator)
                x = x * 1e3 if step == spike_at else x
                loss = model(x, x @ weights, torch.tensor(16.0 * micro))
                (loss * float("nan") if step == nan_at else loss).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
    mon.stop()
    return mon, short


def test_an_epochs_shorter_last_step_is_no_incident_and_a_nan_there_still_is():
    """With 8 micro-batches a step and 97 batches an epoch, every 13th step has one: its
    activation gradients are 8x those of a full step and its item count an eighth, which the
    rules are not to take for a fault (a false incident there would skip or stop the run with
    alert.actions); a NaN is still found at such a step, and a loop whose every step is
    shorter than grad_acc_steps is judged as usual."""
    mon, short = _epochs(97, 8)
    assert short and mon.incidents == [], [(i.onset_step, i.root["tag_name"]) for i in mon.incidents]
    mon, short = _epochs(97, 8, nan_at=short[-1])
    assert mon.incidents and mon.incidents[0].onset_step == short[-1]
    mon, _ = _epochs(2, 4, spike_at=AT)  # grad_acc_steps 4, yet 2 micro-batches every step
    assert [i.onset_step for i in mon.incidents][:1] == [AT]


@pytest.mark.parametrize("rules", [[], [{"rule_name": "AnomalyZScore"}]], ids=["no rules", "zscore"])
def test_alert_non_finite_decides_whether_a_nan_is_an_anomaly_whatever_the_rules(rules):
    """From the config through TrainerMon: by default a NaN is an incident at its step even with
    no rule (or one that skips non-finite values); ``non_finite: false`` keeps msprobe's
    behaviour, where only a configured rule can flag it."""

    def incidents(non_finite: bool) -> list:
        config = {**CONFIG, "alert": {"rules": rules, "non_finite": non_finite}}
        return _train("nan_activation", config=config).incidents

    flagged = incidents(True)
    assert flagged and flagged[0].onset_step == AT and flagged[0].root["rule"] == "NonFinite"
    assert ":hidden.1" in flagged[0].root["tag_name"]
    assert incidents(False) == []


def _rank_worker(rank: int, world_size: int, workdir: str) -> None:
    fault = os.environ["FAULT"]
    mon = _train(fault, rank=rank, world=world_size, fault_rank=2)
    save_result(workdir, rank, {"incidents": [incident.to_json() for incident in mon.incidents]})


@pytest.mark.distributed
@pytest.mark.parametrize(
    "fault", ["grad_before_reduce", "bad_batch", "nan_activation", "inf_overflow", "weight_flip"]
)
def test_a_one_rank_fault_names_its_rank(tmp_path, fault):
    results = run_ranks(_rank_worker, 4, str(tmp_path), env={"FAULT": fault})
    merged = merge([incident for result in results for incident in result["incidents"]])
    assert merged and merged[0].onset_step == AT, [m.to_json(1) for m in merged]
    root = merged[0].root
    assert root["rank"] == 2, (root, merged[0].evidence)
    module = {"grad_before_reduce": ":hidden.1.weight", "weight_flip": ":hidden.2"}.get(fault, ":hidden.1")
    if fault != "bad_batch":  # a bad batch is named at the input of the first module
        assert module in root["tag_name"], (root, merged[0].evidence)
