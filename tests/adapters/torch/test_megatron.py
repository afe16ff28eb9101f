"""Real megatron-core (0.16.1) on two gloo ranks on CPU, fed different data.

Each spawned job runs several configurations one after another (to keep the spawn and import
cost low): a monitored Megatron DDP model with its optimizer from ``get_megatron_optimizer``
(always a ChainedOptimizer), and an identical unmonitored one on the same data. Megatron's CUDA
literals are bent to the CPU by the test-only ``megatron_cpu_shim``, installed in the workers.

Every recorded number is checked in the worker against an independent computation
(``megatron_reference``): a plain-torch replica's gradients, their mean over the ranks, and
Megatron's own handles on master copies, shards and moments, gathered into whole tensors.
"""

from __future__ import annotations

import faulthandler
import itertools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from adapters.torch.params import ParamRegistry
from monitor.config.schema import load_config
from tests.adapters.torch import megatron_cpu_shim
from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import (
    ALL_OPS,
    assert_stats_close,
    read_histograms,
    update_histogram_reference,
)
from tests.adapters.torch.megatron_reference import (
    agreement,
    gather_whole,
    local_grads,
    mean_over_ranks,
    train_step,
    truth,
)
from tests.shared_configs import DATA_TYPES

pytestmark = pytest.mark.distributed

STEPS, GRAD_ACC = 3, 2

#: one spawned job per key; each runs its configurations in order on the same two ranks.
JOBS = {
    "replicated": [
        # FP32Optimizer; tp_group given: rank 1 records reduced gradients of TP-split params only.
        {"bf16": False, "dist_opt": False, "overlap": False, "groups": "tp"},
        # Float16OptimizerWithFloat16Params; dp_group given: rank 1 records no reduced gradient.
        {"bf16": True, "dist_opt": False, "overlap": True, "groups": "dp"},
    ],
    "distributed": [
        {"bf16": False, "dist_opt": True, "overlap": True, "shard_reduce": False, "groups": "dp"},
        {"bf16": True, "dist_opt": True, "overlap": False, "shard_reduce": True, "groups": "dp"},
    ],
    "chunks": [
        # two virtual-pipeline chunks, a ChainedOptimizer over one DistributedOptimizer per chunk.
        {"bf16": True, "dist_opt": True, "overlap": True, "shard_reduce": True, "chunks": 2, "groups": "dp"},
    ],
}

#: layer sizes of each chunk: one chunk, or the same network cut into two chunks.
_SIZES = {1: [(6, 16, 4)], 2: [(6, 16), (16, 8, 4)]}


class _Layers(torch.nn.Module):
    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _build(spec: dict, seed: int) -> tuple[list, object, list[_Layers]]:
    """Megatron DDP chunks, their ChainedOptimizer, and plain replicas of the chunks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if spec["bf16"] else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=spec["bf16"], params_dtype=dtype
    )
    torch.manual_seed(seed)
    modules = [_Layers(sizes).to(dtype) for sizes in _SIZES[spec.get("chunks", 1)]]
    # marks one weight as split across tensor-parallel ranks (what ColumnParallelLinear does)
    set_tensor_model_parallel_attributes(modules[0].layers[0].weight, True, 0, 1)
    replicas = [_Layers(sizes).to(dtype) for sizes in _SIZES[spec.get("chunks", 1)]]
    chunks = [
        DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                use_distributed_optimizer=spec["dist_opt"],
                overlap_grad_reduce=spec["overlap"],
                grad_reduce_in_fp32=True,
                bucket_size=40 if spec["overlap"] else None,
            ),
            module,
            disable_bucketing=index > 0,
        )
        for index, module in enumerate(modules)
    ]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=0.05,
        bf16=spec["bf16"],
        use_distributed_optimizer=spec["dist_opt"],
        clip_grad=1.0,
    )
    if len(chunks) == 1:
        optimizer = get_megatron_optimizer(opt_config, chunks)
    else:
        parts = [get_megatron_optimizer(opt_config, [chunk]).chained_optimizers[0] for chunk in chunks]
        optimizer = ChainedOptimizer(parts)
    return chunks, optimizer, replicas


def _expected(spec, rank, key, grad, own_before, own_after, whole_before, whole_after, tp_split) -> dict:
    """task -> the array its statistics must equal, or None where this rank must not record it."""
    if spec["dist_opt"] and not spec.get("shard_reduce", False):
        piece = own_before.get(key)
        if piece is None:
            return dict.fromkeys(("post_grad", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"))
        start, end, value, _, _ = piece
        _, _, updated, exp_avg, exp_avg_sq = own_after[key]
        grad_piece = grad[start:end]
    else:
        (value, _, _), (updated, exp_avg, exp_avg_sq) = whole_before[key], whole_after[key]
        kept = rank == 0 or spec["dist_opt"] or (spec["groups"] == "tp" and key in tp_split)
        grad_piece = grad if kept else None
    return {
        "post_grad": grad_piece,
        "param_origin": value,
        "param_updated": updated,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }


def _check_step(spec, rank, mon, keys, local, mean, own_before, own_after, whole, tp_split) -> dict:
    """Every recorded statistic of one step against the independent numbers."""
    got_reduced, got_unreduced = mon.generate_wgrad_metrics()
    got = {**got_reduced, **mon.generate_param_metrics(), **mon.generate_mv_metrics()}
    got_other = mon._session.core.latest.latest("other")
    hooked = [t for t in got_unreduced if not t.endswith("/pre_grad")]
    assert not hooked, "hook-based rows present next to the bucket rows"
    assert len(got_unreduced) == len(keys)
    merged = spec["dist_opt"] and spec.get("shard_reduce", False)
    seen = {"unreduced": {}, "reduced": {}, "pieces": {}, "full": {}}
    for key in keys:
        base = f"{key[0]}:{key[1]}/rank{rank}"
        assert_stats_close(got_unreduced[f"{base}/pre_grad"], local[key], what=f"{base} pre_grad")
        seen["unreduced"][base.split("/")[0]] = got_unreduced[f"{base}/pre_grad"]
        grad = mean[key].reshape(-1)
        expected = _expected(spec, rank, key, grad, own_before, own_after, *whole, tp_split)
        for task, array in expected.items():
            if array is None:
                assert f"{base}/{task}" not in got, f"{base}/{task} recorded"
                continue
            row = got[f"{base}/{task}"]
            assert_stats_close(row, array, what=f"{base} {task}")
            if spec["dist_opt"]:
                assert row["numel"] == array.size, f"{base}/{task} numel"
                assert row["partial"] == float(array.size < grad.size), f"{base}/{task} partial"
        # mg_direction: the reduced gradient (this rank's piece) against exp_avg before the update
        piece = own_before.get(key)
        if merged:
            share, count = agreement(grad, whole[0][key][1]), grad.size
        elif piece is not None:
            share, count = agreement(grad[piece[0] : piece[1]], piece[3]), piece[1] - piece[0]
        else:
            share = count = None
        if share is None:
            assert f"{base}/mg_direction" not in got_other
        else:
            row = got_other[f"{base}/mg_direction"]
            assert row["mean"] == pytest.approx(share, abs=1e-12), f"{base} mg_direction"
            if spec["dist_opt"]:
                assert (row["numel"], row["partial"]) == (count, float(count < grad.size))
        if expected["post_grad"] is not None:
            norm = got[f"{base}/post_grad"]["norm"]
            if expected["post_grad"].size == grad.size:
                seen["reduced"][key[1]] = norm
            else:
                seen["pieces"][key[1]] = [norm, expected["post_grad"].size]
        seen["full"][key[1]] = [float(np.linalg.norm(grad)), grad.size]
    return seen


def _run_config(spec: dict, rank: int) -> dict:
    from monitor import TrainerMon

    chunks, optimizer, replicas = _build(spec, seed=0)
    plain_chunks, plain_optimizer, _ = _build(spec, seed=0)
    group = dist.new_group([0, 1])
    mon = TrainerMon(
        {
            **DATA_TYPES["all"],
            "ops": ALL_OPS,
            "format": "api",
            "shard_reduce": spec.get("shard_reduce", False),
        },
        params_have_main_grad=True,
    )
    groups = {"tp_group": group} if spec["groups"] == "tp" else {"dp_group": group}
    mon.set_monitor(chunks, GRAD_ACC, optimizer=optimizer, **groups)
    histograms = TrainerMon(
        {"ur_distribution": True, "format": "tensorboard", "shard_reduce": spec.get("shard_reduce", False)},
        params_have_main_grad=True,
    )
    histograms.set_monitor(chunks, GRAD_ACC, optimizer=optimizer, **groups)
    expected_histograms = {}
    named = [(c, n, p) for c, chunk in enumerate(chunks) for n, p in chunk.module.named_parameters()]
    keys = [(c, n) for c, n, _ in named]
    tp_split = {(c, n) for c, n, p in named if getattr(p, "tensor_model_parallel", False)}
    assert tp_split == {(0, "layers.0.weight")}
    numel = {(c, n): p.numel() for c, n, p in named}
    merged = spec["dist_opt"] and spec.get("shard_reduce", False)
    generator = torch.Generator().manual_seed(100 + rank)
    dtype = torch.bfloat16 if spec["bf16"] else torch.float32
    steps, failures = [], []
    for _ in range(STEPS):
        batches = [torch.randn(5, 6, generator=generator).to(dtype) for _ in range(GRAD_ACC)]
        local = local_grads(chunks, replicas, batches)
        train_step(chunks, optimizer, batches)
        train_step(plain_chunks, plain_optimizer, batches)
        mean = mean_over_ranks(local)
        own_before = truth(spec, chunks, optimizer)
        whole_before = (
            gather_whole(own_before, numel) if merged else {k: v[2:] for k, v in own_before.items()}
        )
        optimizer.step()
        plain_optimizer.step()
        own_after = truth(spec, chunks, optimizer)
        whole_after = gather_whole(own_after, numel) if merged else _values(own_after)
        whole = (whole_before, whole_after)
        expected_histograms.update(_histogram_reference(optimizer, whole_after, rank, len(steps)))
        checked = _deferred(failures, _check_step, spec, rank, mon, keys, local, mean, own_before, own_after)
        steps.append(checked(whole, tp_split))
    prefixes = sorted({tag.split(":", 1)[0] for tag in mon.generate_wgrad_metrics()[1]})
    mon.stop()
    histograms.stop()
    _deferred(failures, _check_histograms, read_histograms(histograms.output_dir), expected_histograms)()
    _deferred(failures, _check_restored, chunks, optimizer)()
    _deferred(failures, _check_same_training, chunks, optimizer, plain_chunks, plain_optimizer)()
    _raise_on_any_rank(failures)
    return {"steps": steps, "prefixes": prefixes, "rows": len(keys)}


def _histogram_reference(optimizer, tensors: dict, rank: int, step: int) -> dict:
    """ur_distribution's histograms of (value, exp_avg, exp_avg_sq) after a step: whole tensors,
    or this rank's pieces (a distributed optimizer without shard_reduce)."""
    inner = optimizer.chained_optimizers[0].optimizer
    group, count = inner.param_groups[0], float(next(iter(inner.state.values()))["step"])
    expected = {}
    for (chunk, name), (_, exp_avg, exp_avg_sq) in tensors.items():
        if exp_avg is None:
            continue
        found = update_histogram_reference(exp_avg, exp_avg_sq, count, group["betas"], group["eps"])
        for kind, (counts, nans) in found.items():
            expected[(f"{chunk}:{name}/rank{rank}/{kind}", step)] = (counts.tolist(), nans)
    return expected


def _check_histograms(found: dict, expected: dict) -> None:
    assert expected, "no Adam state to compare with"
    assert set(found) == set(expected), sorted(set(found) ^ set(expected))[:4]
    for key, (counts, nans) in found.items():
        assert (counts.tolist(), nans) == expected[key], key


def _values(pieces: dict) -> dict:
    """(value, exp_avg, exp_avg_sq) of pieces that are whole tensors already (replicated optimizers)."""
    return {key: piece[2:] for key, piece in pieces.items()}


def _deferred(failures: list, check, *args):
    """``check`` that records its failure instead of raising it (see _raise_on_any_rank)."""

    def run(*more):
        try:
            return check(*args, *more)
        except Exception as exc:  # a missing row (KeyError) fails the check as an assertion does
            failures.append(exc)
            return None

    return run


def _raise_on_any_rank(failures: list) -> None:
    """Every rank raises when any rank failed a check, so none is left waiting in a collective."""
    count = torch.tensor([len(failures)])
    dist.all_reduce(count)
    if failures:
        raise failures[0]
    if count.item():
        raise AssertionError("a check failed on another rank")


def _check_restored(chunks, optimizer) -> None:
    """After stop(): no instance attribute left on the optimizer or the bucket groups."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer import ChainedOptimizer

    assert "step" not in vars(optimizer)
    assert ChainedOptimizer.step.__qualname__ == "ChainedOptimizer.step"
    for chunk in chunks:
        for group in chunk.bucket_groups:
            assert "start_grad_sync" not in vars(group)
    assert _ParamAndGradBucketGroup.start_grad_sync.__qualname__ == "_ParamAndGradBucketGroup.start_grad_sync"


def _check_same_training(chunks, optimizer, plain_chunks, plain_optimizer) -> None:
    """Model parameters, fp32 masters and optimizer state bit-identical to the unmonitored run."""
    for chunk, plain in zip(chunks, plain_chunks):
        for (name, p), (_, q) in zip(chunk.module.named_parameters(), plain.module.named_parameters()):
            assert torch.equal(p, q), name
    for part, plain in zip(optimizer.chained_optimizers, plain_optimizer.chained_optimizers):
        mine = [p for g in part.optimizer.param_groups for p in g["params"]]
        theirs = [p for g in plain.optimizer.param_groups for p in g["params"]]
        assert len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs))
        for a, b in zip(mine, theirs):
            state_a, state_b = part.optimizer.state[a], plain.optimizer.state[b]
            assert state_a.keys() == state_b.keys()
            assert all(torch.equal(torch.as_tensor(state_a[k]), torch.as_tensor(state_b[k])) for k in state_a)


def _worker(rank: int, world_size: int, workdir: str) -> None:
    # a hang guard, not a timing check: a rank stuck in a collective dumps its stack and exits
    faulthandler.dump_traceback_later(int(os.environ.get("MEGATRON_TEST_HANG_S", "600")), exit=True)
    megatron_cpu_shim.install()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    results = [_run_config(spec, rank) for spec in JOBS[os.environ["MEGATRON_JOB"]]]
    parallel_state.destroy_model_parallel()
    save_result(workdir, rank, {"configs": results})


@pytest.mark.parametrize("job", sorted(JOBS))
def test_megatron_optimizers_record_what_megatron_holds(job, tmp_path):
    pytest.importorskip("megatron.core")
    env = {"MEGATRON_JOB": job, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    rank0, rank1 = run_ranks(_worker, 2, str(tmp_path), env=env)
    for spec, first, second in zip(JOBS[job], rank0["configs"], rank1["configs"]):
        assert first["prefixes"] == second["prefixes"] == [str(c) for c in range(spec.get("chunks", 1))]
        for step_a, step_b in zip(first["steps"], second["steps"]):
            assert len(step_a["unreduced"]) == first["rows"]
            for tag, stats in step_a["unreduced"].items():  # pre-reduce: each rank its own data
                other = step_b["unreduced"][tag]
                assert any(stats[op] != pytest.approx(other[op], rel=1e-3) for op in ALL_OPS), tag
            for name, norm in step_a["reduced"].items():  # reduced whole tensors agree
                if name in step_b["reduced"]:
                    assert norm == pytest.approx(step_b["reduced"][name], rel=1e-6), name
            if spec["dist_opt"] and not spec.get("shard_reduce", False):
                # the ranks' pieces cover each parameter once; their norms make the whole norm
                for name, (full_norm, size) in step_a["full"].items():
                    pieces = [s["pieces"][name] for s in (step_a, step_b) if name in s["pieces"]]
                    pieces += [[s["reduced"][name], size] for s in (step_a, step_b) if name in s["reduced"]]
                    assert sum(count for _, count in pieces) == size, name
                    merged = float(np.sqrt(sum(norm * norm for norm, _ in pieces)))
                    assert merged == pytest.approx(full_norm, rel=1e-5), name
                assert any(len(s["pieces"]) for s in (step_a, step_b)), "no parameter was split"


def test_a_parameter_in_two_chunks_is_registered_once():
    shared = torch.nn.Linear(3, 3)
    first = torch.nn.Sequential(torch.nn.Linear(3, 3), shared)
    second = torch.nn.Sequential(shared, torch.nn.Linear(3, 2))
    registry = ParamRegistry([first, second], load_config({}), main_grad=None)
    labels = [(entry.vpp_stage, entry.name) for entry in registry.params]
    assert labels == [
        (0, "0.weight"),
        (0, "0.bias"),
        (0, "1.weight"),
        (0, "1.bias"),
        (1, "1.weight"),
        (1, "1.bias"),
    ]
    assert len({id(entry.param) for entry in registry.params}) == len(labels)
