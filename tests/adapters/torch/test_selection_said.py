"""What would give no rows, or misnumbered ones, is said, not left silent: a container module
that is never called, an attention module whose calls carry no Q and K, an optimizer restored
from a checkpoint while steps are numbered from 0."""

from __future__ import annotations

import pytest
import torch

from monitor import TrainerMon
from tests.training import MLP


def _said(trainmon_log, words: str) -> list[str]:
    return [m for r in trainmon_log.records if words in (m := r.getMessage())]


def _one_step(config: dict) -> dict:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({**config, "format": "api"}).set_monitor(model, 1, optimizer)
    for _ in range(2):
        model(torch.randn(3, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    rows = {prefix: mon._latest(prefix) for prefix in ("actv", "attention_hook")}
    mon.stop()
    return rows


def test_a_container_named_in_targets_is_said_to_be_never_called(trainmon_log):
    rows = _one_step({"xy_distribution": True, "targets": {"layers": {}, "norm": {}}})
    assert {tag.split(":")[1] for tag in rows["actv"]} == {"norm.input", "norm.output"}
    (said,) = _said(trainmon_log, "never called")
    assert said.startswith("trainmon: targets layers: never called (a container such as ModuleList")


@pytest.mark.parametrize("whole_model", [{"all_xy": True}, {"targets": {}}], ids=["all_xy", "empty targets"])
def test_the_whole_model_takes_containers_without_a_word(trainmon_log, whole_model):
    assert _one_step({"xy_distribution": True, **whole_model})["actv"]
    assert not _said(trainmon_log, "never called")


def test_an_attention_module_called_without_q_and_k_is_said_once(trainmon_log):
    l2 = {"attention_hook": ["layers.0"], "linear_hook": []}
    rows = _one_step({"recording_l2_features": True, "l2_targets": l2})
    assert not rows["attention_hook"]
    (said,) = _said(trainmon_log, "not two 4-D ones")
    assert said.startswith(
        "trainmon: attention_hook layers.0: its first two positional tensors are not two 4-D ones (Q and K"
    )


def test_attaching_to_an_optimizer_that_already_stepped_asks_for_start_iteration(trainmon_log):
    """A run resumed from a checkpoint numbers its steps from 0 unless told: said, with the count."""
    for given, warned in ((0, True), (2, False)):
        trainmon_log.records.clear()
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):  # the updates a checkpoint would have restored
            model(torch.randn(3, 6)).sum().backward()
            optimizer.step()
        mon = TrainerMon({"wg_distribution": True, "format": "api"})
        mon.set_monitor(model, 1, optimizer, start_iteration=given)
        mon.stop()
        said = _said(trainmon_log, "start_iteration=2")
        assert len(said) == warned, said
