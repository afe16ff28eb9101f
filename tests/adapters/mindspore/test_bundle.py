"""Evidence bundles on MindSpore (PyNative): a NaN in one gradient at step AT opens an incident;
the bundle holds that parameter and its Adam moments as the test's own copies of the step it was
written at, MindSpore's generator state and the topology."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import numpy as np
from mindspore import nn

from monitor import TrainerMon
from monitor.alerts.bundle import load_bundle
from tests.adapters.mindspore.helpers import Net, make_batches

STEPS, AT, FAULTY = 8, 4, "layers.1.weight"


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def test_the_bundle_holds_the_faulty_parameter_its_moments_and_the_generators(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.01)
    names = [p.name for p in optimizer.parameters]
    faulty = names.index(FAULTY)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, optimizer.parameters)
    config = {
        "wg_distribution": True,
        "mv_distribution": True,
        "ops": ["norm", "nans"],
        "alert": {"bundle": {"incidents": 1}},
    }
    mon = TrainerMon(config).set_monitor(net, 1, optimizer)
    copies = {}
    for step, (x,) in enumerate(make_batches(STEPS, 1)):
        _, grads = grad_fn(ms.Tensor(x))
        if step == AT:
            grads = list(grads)
            bad = grads[faulty].asnumpy().copy()
            bad[0, 0] = np.nan
            grads[faulty] = ms.Tensor(bad)
            grads = tuple(grads)
        ms.manual_seed(100 + step)  # a new generator state every step (its random ops leave it on CPU)
        optimizer(grads)
        copies[step] = {
            "value": optimizer.parameters[faulty].asnumpy().copy(),
            "exp_avg": optimizer.moment1[faulty].asnumpy().copy(),
            "exp_avg_sq": optimizer.moment2[faulty].asnumpy().copy(),
            "mindspore": ms.get_rng_state().asnumpy().copy(),
        }
    mon.stop()
    rank_dir = tmp_path / "anomaly_detected" / "rank0"
    bundle = load_bundle(rank_dir / "bundle_incident1")
    m = bundle.manifest
    assert m["incident"]["onset_step"] == AT and m["incident"]["root"]["tag_name"].startswith(f"0:{FAULTY}/")
    written = m["written_at_step"]
    assert written == AT  # the end of the step where the incident began
    for part in ("value", "exp_avg", "exp_avg_sq"):
        assert _same(bundle.tensors[f"0:{FAULTY} {part}"], copies[written][part]), part
    assert not any(name.endswith(" grad") for name in bundle.tensors)  # MindSpore keeps no gradient
    assert _same(bundle.tensors["rng.mindspore"], copies[written]["mindspore"])
    assert "rng.numpy" in bundle.tensors and m["rng"]["mindspore_seed"] == ms.get_seed()
    assert m["topology"] == {
        "rank": 0,
        "world_size": 1,
        "pp_stage": 0,
        "group_mates": [0],
        "chunks": ["Net"],
        "graph_mode": False,
        "groups": {"tp_group": None, "dp_group": None},
    }
    assert m["versions"]["mindspore"] == ms.__version__
