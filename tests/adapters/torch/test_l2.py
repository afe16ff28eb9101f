"""msprobe's l2 features against numpy: attention softmax_max / entropy and linear spectral norms.

A small GPT-like model (the demo's blocks, whose core attention takes (batch, seq, heads, dim)
tensors) trains with gradient accumulation 2, its block optionally under activation
checkpointing. The test copies Q and K at every forward call of the attention module (not in the
recomputation, not in eval mode) and every linear weight before each optimizer step, and
recomputes everything with numpy (softmax, entropy, numpy.linalg.svd).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from adapters.torch.demo import Block, GPTConfig
from monitor import TrainerMon
from tests.adapters.torch.helpers import measured_linear
from tests.reference_stats import expected_attention

CFG = GPTConfig(vocab=40, hidden=24, heads=3, layers=1, seq=7)
STEPS, MICRO = 5, 2


class Net(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(CFG.vocab, CFG.hidden)
        self.block = Block(CFG)
        self.head = nn.Linear(CFG.hidden, CFG.vocab)
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        x = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(x)


def _rows(directory: str, prefix: str) -> pd.DataFrame:
    return pd.concat(
        pd.read_csv(path) for path in sorted(glob.glob(os.path.join(directory, f"{prefix}_*.csv")))
    )


def _train(
    tmp_path,
    heads: str,
    checkpointed: bool,
    linear: list[str] | None = None,
    fmt: str = "csv",
    poison_step: int | None = None,
):
    torch.manual_seed(0)
    model = Net(checkpointed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = {
        "recording_l2_features": True,
        "l2_targets": {"attention_hook": ["block.attention"], "linear_hook": linear or []},
        "sa_order": "b,s,h,d",
        "l2_heads": heads,
        "format": fmt,
    }
    mon = TrainerMon(config).set_monitor(model, MICRO, optimizer)
    seen = {"forward": False, "qk": [], "weights": []}

    def copy_qk(module, args):
        if seen["forward"] and module.training:
            seen["qk"].append((args[0].detach().numpy().copy(), args[1].detach().numpy().copy()))
        if poison_step is not None and len(seen["weights"]) == poison_step and module.training:
            k = args[1].clone()
            k[0, 0, 0, 0] = float("nan")  # batch 0, head 0: the rows msprobe's layout reads
            return (args[0], k, *args[2:])
        return None

    model.block.attention.register_forward_pre_hook(copy_qk)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for _ in range(MICRO):
            tokens = torch.randint(0, CFG.vocab, (2, CFG.seq), generator=generator)
            seen["forward"] = True
            loss = model(tokens).pow(2).mean()
            seen["forward"] = False
            loss.backward()  # a checkpointed block runs its forward again here: not copied
        model.eval()
        with torch.no_grad():
            model(tokens)  # an evaluation forward in between: no rows
        model.train()
        seen["weights"].append(
            {
                n: m.weight.detach().numpy().copy()
                for n, m in model.named_modules()
                if isinstance(m, nn.Linear)
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    mon.stop()
    seen["incidents"] = mon.incidents
    return mon.output_dir, seen


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("heads", ["first", "all", "each"])
def test_attention_rows_equal_numpy_on_every_micro_step(tmp_path, monkeypatch, heads, checkpointed):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    directory, seen = _train(tmp_path, heads, checkpointed)
    frame = _rows(directory, "attention_hook")
    assert len(seen["qk"]) == STEPS * MICRO
    got = frame.sort_values(["step", "micro_step", "name"])
    expected_rows = []
    for call, (q, k) in enumerate(seen["qk"]):
        step, micro = divmod(call, MICRO)
        per_head = expected_attention(q, k)
        if heads == "first":
            expected_rows.append((step, micro, "block.attention.attention", *per_head[0]))
        elif heads == "all":
            mean = per_head.mean(axis=0)
            expected_rows.append(
                (step, micro, "block.attention.attention", *mean, per_head[:, 0].max(), per_head[:, 1].min())
            )
        else:
            expected_rows += [
                (step, micro, f"block.attention.attention.head{h}", *per_head[h]) for h in range(CFG.heads)
            ]
    columns = ["softmax_max", "entropy"] + (["softmax_max_top", "entropy_low"] if heads == "all" else [])
    assert list(frame.columns) == ["vpp_stage", "name", "step", "micro_step", *columns]
    expected = pd.DataFrame(expected_rows, columns=["step", "micro_step", "name", *columns])
    expected = expected.sort_values(["step", "micro_step", "name"])
    assert (
        got[["step", "micro_step", "name"]].values.tolist()
        == expected[["step", "micro_step", "name"]].values.tolist()
    )
    np.testing.assert_allclose(
        got[columns].to_numpy(float), expected[columns].to_numpy(float), rtol=1e-4, atol=1e-6
    )


def test_linear_spectral_norm_and_stable_rank_within_one_percent_of_svd(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    directory, seen = _train(tmp_path, "first", False)
    frame = _rows(directory, "linear_hook")
    linear = sorted(seen["weights"][0])
    assert sorted(frame["name"].unique()) == sorted(
        f"{n}.linear" for n in linear
    )  # every Linear, no embedding
    assert "micro_step" not in frame.columns
    for step, weights in enumerate(seen["weights"]):
        for name, weight in weights.items():
            row = frame[(frame["step"] == step) & (frame["name"] == f"{name}.linear")].iloc[0]
            sigma = np.linalg.svd(weight.astype(np.float64), compute_uv=False)[0]
            assert row["kernel_norm"] == pytest.approx(sigma, rel=0.01), (step, name)
            assert row["sr"] == pytest.approx(np.linalg.norm(weight) / sigma, rel=0.01), (step, name)


def test_listed_linear_modules_only_and_nothing_without_the_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    directory, _ = _train(tmp_path, "first", False, linear=["head", "block.qkv"])
    assert sorted(_rows(directory, "linear_hook")["name"].unique()) == ["block.qkv.linear", "head.linear"]
    model = Net(False)
    mon = TrainerMon({"l2_targets": {"linear_hook": []}, "format": "csv"}).set_monitor(
        model, 1, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    mon.stop()
    assert not glob.glob(os.path.join(mon.output_dir, "*_hook_*.csv"))


def _spectral_norms(shape: tuple[int, int], weights) -> list[tuple[float, float]]:
    """``(measured, exact)`` for each weight in turn, measured as a collection measures it
    (L2Features, its own start vectors), exact by numpy.linalg.svd of a copy."""
    weights = list(weights)
    measured = measured_linear(weights)
    return [
        (kernel_norm, np.linalg.svd(weight.double().numpy(), compute_uv=False)[0])
        for (kernel_norm, _), weight in zip(measured, weights)
    ]


@pytest.mark.parametrize("shape", [(96, 288), (288, 96), (256, 256)])
def test_spectral_norm_stays_within_one_percent_while_a_random_weight_moves(shape):
    """Gaussian matrices, whose largest singular values crowd together (the hard case for power
    iteration), moved by 5% of their scale between collected steps (training moves weights far
    less)."""
    generator = torch.Generator().manual_seed(7)

    def weights():
        weight = torch.randn(*shape, generator=generator)
        for _ in range(12):
            weight = weight + 0.05 * torch.randn(*shape, generator=generator)
            yield weight

    for step, (measured, exact) in enumerate(_spectral_norms(shape, weights())):
        assert measured == pytest.approx(exact, rel=0.01), step


@pytest.mark.parametrize("fmt", ["csv", "tensorboard"])
def test_the_dashboard_shows_both_features(tmp_path, monkeypatch, fmt):
    from tests.dashboards.conftest import Api

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    _, seen = _train(tmp_path, "first", False, fmt=fmt)
    api = Api(tmp_path)
    (run,) = api.runs().values()
    assert set(run["prefixes"]["attention_hook"]["ops"]) == {"softmax_max", "entropy"}
    assert set(run["prefixes"]["linear_hook"]["ops"]) == {"kernel_norm", "sr"}
    view = api.heatmap(run=run["id"], prefix="attention_hook", op="entropy", rank=0)
    assert view["rows"] == ["block.attention.attention:0", "block.attention.attention:1"]
    q, k = seen["qk"][-1]  # the last step's second micro-batch
    assert view["values"][1, -1] == pytest.approx(expected_attention(q, k)[0, 1], rel=1e-4)


def test_a_nan_in_the_attention_inputs_is_an_incident_rooted_there(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    _, seen = _train(tmp_path, "first", False, poison_step=3)
    first = seen["incidents"][0]
    assert first.onset_step == 3 and first.root["tag_name"] == "0:block.attention.attention:0/rank0/qkt"


def test_an_attention_collapse_is_an_incident_of_the_rules_that_judge_entropy(tmp_path, monkeypatch):
    """Keys scaled up 50x from step AT make the attention one-hot (entropy near 0): a rule given
    the l2 columns (``ops``) opens an incident at that step rooted at the attention rows."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    steps, at = 16, 12
    torch.manual_seed(0)
    model = Net(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rule = {"rule_name": "AnomalyZScore", "args": {"ops": ["norm", "entropy", "softmax_max"]}}
    config = {
        "recording_l2_features": True,
        "l2_targets": {"attention_hook": ["block.attention"], "linear_hook": []},
        "sa_order": "b,s,h,d",
        "wg_distribution": True,
        "alert": {"rules": [rule]},
    }
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    step = [0]

    def collapse(module, args):
        return (args[0], args[1] * 50, *args[2:]) if step[0] >= at else None

    model.block.attention.register_forward_pre_hook(collapse)
    generator = torch.Generator().manual_seed(1)
    for step[0] in range(steps):
        model(torch.randint(0, CFG.vocab, (2, CFG.seq), generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.stop()
    first = mon.incidents[0]
    assert first.onset_step == at and first.root["tag_name"] == "0:block.attention.attention:0/rank0/qkt"
    assert "entropy" in first.root["message"], first.root


def test_a_weight_held_in_pieces_is_not_measured_and_the_user_is_told(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    model = Net(False)
    model.block.proj.weight.tensor_model_parallel = True  # how Megatron marks a tensor-parallel shard
    config = {"recording_l2_features": True, "format": "csv"}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    optimizer.step()
    mon.stop()
    names = set(_rows(mon.output_dir, "linear_hook")["name"])
    assert "block.proj.linear" not in names and "head.linear" in names
    assert "1 of 5 linear weights are sharded" in caplog.text


@pytest.mark.parametrize("heads", ["all", "each"])
def test_grouped_query_attention_maps_query_heads_to_their_key_head(heads):
    from adapters.torch.l2 import attention_scores, summarise

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 3, generator=generator)  # (b, s, 4 query heads, d)
    k = torch.randn(2, 5, 2, 3, generator=generator)  # 2 key heads: query heads 0, 1 -> 0; 2, 3 -> 1
    got = summarise(attention_scores(q, k, "b,s,h,d", heads), heads).numpy()
    per_head = expected_attention(q.numpy(), np.repeat(k.numpy(), 2, axis=2))
    if heads == "each":
        np.testing.assert_allclose(got, per_head, rtol=1e-5)
    else:
        mean = per_head.mean(axis=0)
        np.testing.assert_allclose(got[0], [*mean, per_head[:, 0].max(), per_head[:, 1].min()], rtol=1e-5)


def test_an_all_zero_weight_has_stable_rank_zero_not_nan(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    model = Net(False)
    with torch.no_grad():
        model.head.weight.zero_()  # a freshly initialised LoRA B looks like this
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon({"recording_l2_features": True, "format": "csv"}).set_monitor(model, 1, optimizer)
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    optimizer.step()
    mon.stop()
    row = _rows(mon.output_dir, "linear_hook").set_index("name").loc["head.linear"]
    assert (row["kernel_norm"], row["sr"]) == (0.0, 0.0)
    assert mon.incidents == []  # no NaN, so no incident (and no stop action)


class SeqFirstAttention(nn.Module):
    """Core attention taking (seq, batch, heads, dim) Q and K, msprobe's default layout."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q * k).sum()


class SeqFirstNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)
        self.attention = SeqFirstAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (seq, batch, 8)
        q, k = self.qk(x).unflatten(-1, (2, 2, 4)).unbind(-3)  # each (seq, batch, 2 heads, 4)
        return self.attention(q, k)


def test_the_default_layout_is_sequence_first():
    """Without ``sa_order`` Q and K are read as (seq, batch, heads, dim): batch 0 is the second axis."""
    torch.manual_seed(0)
    model = SeqFirstNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"recording_l2_features": True, "l2_targets": {"attention_hook": ["attention"]}, "format": "api"}
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    seen = []
    model.attention.register_forward_pre_hook(lambda m, args: seen.append([a.detach().numpy() for a in args]))
    model(torch.randn(6, 3, 8)).backward()
    optimizer.step()
    rows = mon._latest("attention_hook")
    mon.stop()
    (q, k), (row,) = seen[0], rows.values()
    want = expected_attention(q.transpose(1, 0, 2, 3), k.transpose(1, 0, 2, 3))[0]  # batch 0, head 0
    np.testing.assert_allclose([row["softmax_max"], row["entropy"]], want, rtol=1e-5)


@pytest.mark.parametrize("shape", [(256, 512), (512, 256)])
def test_spectral_norm_finds_a_new_top_direction_the_last_vector_lacks(shape):
    """Early in a run from scratch a new, larger singular value can rise in a direction the last
    collected step's top vector barely holds. Here, at each collected step, a Gaussian weight's
    singular value in one direction deep in its bulk, orthogonal to every earlier top direction,
    becomes the largest, 3-7% above the one before (six Lanczos steps from the last top vector
    alone came out up to 10% low)."""
    generator = torch.Generator().manual_seed(3)
    u, singular, vh = torch.linalg.svd(torch.randn(*shape, generator=generator), full_matrices=False)

    def weights():
        for step in range(8):
            if step:
                singular[min(shape) // 2 + step] = (1.025 + 0.005 * step) * singular.max()
            yield u @ torch.diag(singular) @ vh

    for step, (measured, exact) in enumerate(_spectral_norms(shape, weights())):
        assert measured == pytest.approx(exact, rel=0.01), step


def test_the_top_eigenpairs_of_a_batch_equal_numpys_without_a_host_solver():
    """Repeated squaring on the device against numpy's eigh: random positive semi-definite
    matrices, top eigenvalues 0.1% apart, a rank-1 one, a zero one, one padded with zeros."""
    from adapters.torch.lanczos import top_eigenpairs

    rng = np.random.default_rng(4)
    matrices = []
    for _ in range(5):
        a = rng.normal(size=(16, 16))
        matrices.append(a @ a.T)
    q, _ = np.linalg.qr(rng.normal(size=(16, 16)))
    matrices.append(q @ np.diag(np.r_[1.0, 0.999, rng.uniform(0, 0.5, 14)]) @ q.T)
    v = rng.normal(size=16)
    matrices.append(np.outer(v, v))
    matrices.append(np.zeros((16, 16)))
    small = rng.normal(size=(5, 5))
    padded = np.zeros((16, 16))
    padded[:5, :5] = small @ small.T
    matrices.append(padded)
    values, vectors = top_eigenpairs(torch.tensor(np.stack(matrices)))
    for matrix, value, vector in zip(matrices, values.numpy(), vectors.numpy()):
        exact = np.linalg.eigvalsh(matrix)[-1]
        assert value == pytest.approx(exact, rel=1e-9, abs=1e-12)
        if exact > 0:
            assert np.linalg.norm(matrix @ vector - value * vector) <= 1e-3 * exact


def test_a_low_rank_weight_gets_its_spectral_norm_not_an_overestimate():
    """A weight of rank 2 whose smaller side is 10: Lanczos reaches an invariant space after two
    steps; going on from rounding noise overestimated the top singular value by 30% in float32."""
    from adapters.torch.lanczos import lanczos, top_eigenpairs

    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(12, 2, generator=generator) @ torch.randn(2, 10, generator=generator)
    start = torch.randn(10, generator=generator)
    _, tridiagonal = lanczos(lambda v: (weight.T @ (weight @ v.T)).T, start[None], 10)
    (theta,), _ = top_eigenpairs(tridiagonal)
    exact = np.linalg.svd(weight.double().numpy(), compute_uv=False)[0]
    assert theta.sqrt().item() == pytest.approx(exact, rel=1e-4)


def test_a_one_token_sequence_has_entropy_plus_zero_on_both_paths():
    """One key: probability 1, entropy 0, written as 0 (not -0) by the device and host paths."""
    from adapters.torch.l2 import head_scores
    from monitor.datatypes.l2 import attention_rows

    q = np.random.default_rng(0).standard_normal((1, 2, 4)).astype(np.float32)  # (seq, heads, dim)
    device = head_scores(torch.from_numpy(q[:, 0]), torch.from_numpy(q[:, 0]))
    host = attention_rows(q, q, "first")
    for softmax_max, entropy in (device.tolist(), np.ravel(host).tolist()):
        assert softmax_max == 1.0 and entropy == 0.0 and np.copysign(1.0, entropy) == 1.0


class _LoraLinear(nn.Module):
    """PEFT's LoRA layer in small: a frozen base layer, trained A and B, and the base layer's
    weight handed on as its own."""

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(6, 6).requires_grad_(False)
        self.lora_A = nn.Linear(6, 2, bias=False)
        self.lora_B = nn.Linear(2, 6, bias=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_every_linear_layer_means_those_that_train_each_weight_once():
    """An empty linear_hook list on a LoRA model: the frozen base weights never change (no row
    at every step for a constant), and the LoRA layer handing on its base layer's weight would
    repeat its row; listed by name, a frozen layer is measured as asked."""
    model = nn.Sequential(_LoraLinear(), nn.Linear(6, 3))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    names = {}
    for listed in ([], ["0.base_layer"]):
        config = {"recording_l2_features": True, "l2_targets": {"linear_hook": listed}, "format": "api"}
        mon = TrainerMon(config).set_monitor(model, 1, optimizer)
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        names[len(listed)] = {key.split(":")[1].rsplit(".linear", 1)[0] for key in mon._latest("linear_hook")}
        mon.stop()
    assert names == {0: {"0.lora_A", "0.lora_B", "1"}, 1: {"0.base_layer"}}
