"""msprobe's l2 features on MindSpore (PyNative) against numpy, with the torch adapter's names.

A small network whose core attention Cell takes (batch, seq, heads, dim) Q, K, V trains with
gradient accumulation 2 (value_and_grad per micro-batch, gradients summed). The test copies Q and
K at every training call of the attention Cell and every Dense weight before each optimizer call,
and recomputes softmax_max / entropy and the spectral norms with numpy.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import glob
import os

import mindspore as ms
import numpy as np
import pandas as pd
from mindspore import nn, ops

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import DIM, HEADS, SEQ, AttentionNet
from tests.reference_stats import expected_attention

STEPS, MICRO = 4, 2


@pytest.mark.parametrize("heads", ["first", "all", "each"])
def test_attention_and_linear_rows_equal_numpy(tmp_path, monkeypatch, heads):
    """Every training call of the attention Cell, per micro-step; an evaluation call after each
    step (outside value_and_grad) gets no row."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = AttentionNet()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    config = {
        "recording_l2_features": True,
        "l2_targets": {"attention_hook": ["attention"], "linear_hook": []},
        "sa_order": "b,s,h,d",
        "l2_heads": heads,
        "format": "csv",
    }
    mon = TrainerMon(config).set_monitor(net, MICRO, optimizer)
    copies = {"qk": [], "weights": []}
    evaluating = [False]

    def copy_qk(cell, args):
        if not evaluating[0]:
            copies["qk"].append((args[0].asnumpy().copy(), args[1].asnumpy().copy()))

    net.attention.register_forward_pre_hook(copy_qk)
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        total = None
        for _ in range(MICRO):
            _, grads = grad_fn(ms.Tensor(rng.normal(size=(2, SEQ, HEADS * DIM)).astype(np.float32)))
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        copies["weights"].append(
            {"qkv": net.qkv.weight.asnumpy().copy(), "out": net.out.weight.asnumpy().copy()}
        )
        optimizer(total)
        evaluating[0] = True
        net(ms.Tensor(rng.normal(size=(2, SEQ, HEADS * DIM)).astype(np.float32)))  # evaluation: no row
        evaluating[0] = False
    mon.stop()
    frame = pd.concat(
        pd.read_csv(p) for p in sorted(glob.glob(os.path.join(mon.output_dir, "attention_hook_*.csv")))
    )
    assert len(copies["qk"]) == STEPS * MICRO
    assert len(frame) == STEPS * MICRO * (HEADS if heads == "each" else 1)  # no other rows
    for call, (q, k) in enumerate(copies["qk"]):
        step, micro = divmod(call, MICRO)
        per_head = expected_attention(q, k)
        if heads == "each":
            expected = {f"attention.attention.head{h}": per_head[h] for h in range(HEADS)}
        elif heads == "all":  # mean over heads, the top softmax_max and the lowest entropy
            top = [per_head[:, 0].max(), per_head[:, 1].min()]
            expected = {"attention.attention": np.concatenate([per_head.mean(axis=0), top])}
        else:
            expected = {"attention.attention": per_head[0]}
        columns = ["softmax_max", "entropy"] + (["softmax_max_top", "entropy_low"] if heads == "all" else [])
        for name, want in expected.items():
            row = frame[(frame["step"] == step) & (frame["micro_step"] == micro) & (frame["name"] == name)]
            assert len(row) == 1, (step, micro, name)
            np.testing.assert_allclose(row[columns].to_numpy(float)[0], want, rtol=1e-4)
    linear = pd.concat(
        pd.read_csv(p) for p in sorted(glob.glob(os.path.join(mon.output_dir, "linear_hook_*.csv")))
    )
    for step, weights in enumerate(copies["weights"]):
        for name, weight in weights.items():
            row = linear[(linear["step"] == step) & (linear["name"] == f"{name}.linear")].iloc[0]
            sigma = np.linalg.svd(weight.astype(np.float64), compute_uv=False)[0]
            assert row["kernel_norm"] == pytest.approx(sigma, rel=0.01)
            assert row["sr"] == pytest.approx(np.linalg.norm(weight) / sigma, rel=0.01)


class WgProjection(nn.Cell):
    """A projection whose weight is called ``wg``, as msprobe's linear features also read."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(5)
        self.wg = ms.Parameter(ms.Tensor(rng.normal(size=(3, 8)).astype(np.float32)), name="wg")

    def construct(self, x):
        return ops.matmul(x, self.wg.T)


def test_a_cell_with_a_wg_weight_is_a_linear_one():
    net = nn.SequentialCell([nn.Dense(4, 8), WgProjection()])
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    config = {"recording_l2_features": True, "l2_targets": {"linear_hook": []}, "format": "api"}
    mon = TrainerMon(config).set_monitor(net, 1, optimizer)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, optimizer.parameters)
    _, grads = grad_fn(ms.Tensor(np.ones((2, 4), np.float32)))
    weights = {"0": net[0].weight.asnumpy().astype(np.float64), "1": net[1].wg.asnumpy().astype(np.float64)}
    optimizer(grads)
    rows = mon._latest("linear_hook")
    mon.stop()
    assert set(rows) == {f"0:{name}.linear/rank0/sr" for name in weights}, rows
    for name, weight in weights.items():
        sigma = np.linalg.svd(weight, compute_uv=False)[0]
        assert rows[f"0:{name}.linear/rank0/sr"]["kernel_norm"] == pytest.approx(sigma, rel=0.01), name


def test_every_linear_cell_means_those_whose_weight_trains():
    """An empty linear_hook list: a frozen Dense (a LoRA model's base layer) never changes and
    gets no row at every step."""
    net = nn.SequentialCell([nn.Dense(4, 8), nn.Dense(8, 3)])
    net[0].weight.requires_grad = False
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    config = {"recording_l2_features": True, "l2_targets": {"linear_hook": []}, "format": "api"}
    mon = TrainerMon(config).set_monitor(net, 1, optimizer)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, optimizer.parameters)
    _, grads = grad_fn(ms.Tensor(np.ones((2, 4), np.float32)))
    optimizer(grads)
    rows = mon._latest("linear_hook")
    mon.stop()
    assert set(rows) == {"0:1.linear/rank0/sr"}, rows


def test_a_nan_or_inf_weight_gets_nan_or_inf_rows_and_the_other_weights_go_on(trainmon_log):
    """As on torch: a weight holding NaN gives NaN, one holding Inf an infinite norm and an
    undefined ratio; the feature stays on and the healthy weights are measured at every step."""
    net = nn.SequentialCell([nn.Dense(4, 8), nn.Dense(8, 6), nn.Dense(6, 3)])
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    config = {"recording_l2_features": True, "l2_targets": {"linear_hook": []}, "format": "api"}
    mon = TrainerMon(config).set_monitor(net, 1, optimizer)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, optimizer.parameters)
    measured = []
    for step in range(3):
        if step == 1:
            for cell, value in ((net[1], np.nan), (net[2], np.inf)):
                weight = cell.weight.asnumpy()
                weight[0, 0] = value
                cell.weight.set_data(ms.Tensor(weight))
        _, grads = grad_fn(ms.Tensor(np.ones((2, 4), np.float32)))
        healthy = np.linalg.svd(net[0].weight.asnumpy().astype(np.float64), compute_uv=False)[0]
        optimizer(tuple(ops.zeros_like(grad) for grad in grads))  # NaN gradients would spread the NaN
        measured.append((healthy, mon._latest("linear_hook")))
    mon.stop()
    assert not trainmon_log.errors()
    for step, (healthy, rows) in enumerate(measured):
        assert rows["0:0.linear/rank0/sr"]["kernel_norm"] == pytest.approx(healthy, rel=0.01), step
    nan_weight, inf_weight = (measured[-1][1][f"0:{name}.linear/rank0/sr"] for name in ("1", "2"))
    assert np.isnan(nan_weight["kernel_norm"]) and np.isnan(nan_weight["sr"])
    assert inf_weight["kernel_norm"] == np.inf and np.isnan(inf_weight["sr"])


def test_a_listed_cell_without_a_2d_weight_and_an_attention_cell_without_qk_are_said(trainmon_log):
    """``linear_hook`` naming a ReLU next to a Dense: the ReLU is said and skipped, the Dense is
    measured; ``attention_hook`` on a Cell called with 2-D tensors is said once, no rows."""
    net = nn.SequentialCell([nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3)])
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    l2 = {"linear_hook": ["1", "2"], "attention_hook": ["0"]}
    config = {"recording_l2_features": True, "l2_targets": l2, "format": "api"}
    mon = TrainerMon(config).set_monitor(net, 1, optimizer)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, optimizer.parameters)
    for _ in range(2):
        _, grads = grad_fn(ms.Tensor(np.ones((2, 4), np.float32)))
        weight = net[2].weight.asnumpy().astype(np.float64)
        optimizer(grads)
    rows, attention = mon._latest("linear_hook"), mon._latest("attention_hook")
    mon.stop()
    said = [r.getMessage() for r in trainmon_log.records]
    assert [m for m in said if "linear_hook 1: no 2-D weight" in m]
    assert len([m for m in said if "attention_hook 0: its first two positional tensors are not" in m]) == 1
    assert set(rows) == {"0:2.linear/rank0/sr"} and attention == {}
    sigma = np.linalg.svd(weight, compute_uv=False)[0]
    assert rows["0:2.linear/rank0/sr"]["kernel_norm"] == pytest.approx(sigma, rel=0.01)


class Recomputed(nn.Cell):
    """A block around the core attention, recomputed in the backward pass (``Cell.recompute()``)."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__()
        self.inner = inner

    def construct(self, *args):
        return self.inner(*args)


def test_a_recomputed_attention_cell_is_measured_without_set_train():
    """A recomputed block runs its Cells' forward without recording gradients, inside the root's
    training call, and again in the backward pass outside it: the first is measured (the root's
    call decides), the recomputation is not; no ``set_train`` needed."""
    net = AttentionNet()
    net.attention = Recomputed(net.attention)
    net.attention.recompute()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    config = {
        "recording_l2_features": True,
        "l2_targets": {"attention_hook": ["attention.inner"], "linear_hook": []},
        "sa_order": "b,s,h,d",
        "xy_distribution": True,
        "targets": {"attention.inner": {}},
        "format": "api",
    }
    mon = TrainerMon(config).set_monitor(net, 1, optimizer)
    seen = []
    net.attention.register_forward_pre_hook(
        lambda cell, args: seen.append((args[0].asnumpy(), args[1].asnumpy()))
    )
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    rng = np.random.default_rng(2)
    _, grads = grad_fn(ms.Tensor(rng.normal(size=(2, SEQ, HEADS * DIM)).astype(np.float32)))
    optimizer(grads)
    attention, activations = mon._latest("attention_hook"), mon._latest("actv")
    mon.stop()
    (row,) = attention.values()
    np.testing.assert_allclose(
        [row["softmax_max"], row["entropy"]], expected_attention(*seen[0])[0], rtol=1e-4
    )
    assert activations and all(":0/" in tag for tag in activations), activations  # one call, micro-step 0
