"""DeepSpeed ZeRO stages 0-3 on two real gloo ranks: every statistic against DeepSpeed's own tensors.

Each case trains a small model (odd sizes, two parameter groups, so that parameters straddle
partitions and ZeRO-3's last partition is padded) for a few steps under three monitors at once:
whole values (``shard_reduce``, attached with the engine), pieces with element counts (attached
with ``engine.optimizer``), a ``targets`` selection (attached with the torch optimizer inside)
and each micro-batch's own unreduced gradient (``monitor_mbs_grad``).
The references are full tensors from DeepSpeed (``safe_get_full_grad`` / ``_fp32_param`` /
``_optimizer_state`` on every rank; stage 0 keeps whole tensors, read directly) and, for the
unreduced gradient, a replica of the model run on the rank's own batch. The pieces are merged
here with numpy. A second run without monitors must end with bit-identical parameters.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os

import numpy as np
import pytest
import torch

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import (
    ALL_OPS,
    MLP,
    assert_stats_close,
    latest_rows,
    merge_piece_rows,
    read_histograms,
    update_histogram_reference,
)
from tests.shared_configs import DATA_TYPES

if importlib.util.find_spec("deepspeed") is None:  # not imported here: the test process stays DeepSpeed-free
    pytest.skip("deepspeed is not installed (pip install trainmon[deepspeed])", allow_module_level=True)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, MICRO, GAS = 3, 2, 2  # steps, micro-batch size, micro-batches per step
SIZES = (6, 15, 12, 5)  # odd element counts: ZeRO-3 pads the last rank's partition
TARGETS = ("layers.1.weight", "norm.bias")  # layers.1.weight straddles the ZeRO-1/2 partitions
PREFIXES = {
    "grad_reduced": "post_grad",
    "param_origin": "param_origin",
    "param_updated": "param_updated",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "other": "mg_direction",
    "grad_unreduced": "acc_grad",
}
#: (stage, precision): precision "bf16acc" is bf16 with fp32 gradient accumulation (BF16_Optimizer).
CASES = {
    0: [(0, "fp32"), (0, "bf16")],
    1: [(1, "fp32"), (1, "bf16"), (1, "bf16acc")],
    2: [(2, "fp32"), (2, "bf16")],
    3: [(3, "fp32"), (3, "bf16")],
}
BACKENDS = {
    (0, "fp32"): "TorchBackend",
    (0, "bf16"): "UnfusedBackend",
    (1, "bf16acc"): "FragmentBackend",
    (3, "fp32"): "Stage3Backend",
    (3, "bf16"): "Stage3Backend",
}


# -- the ranks -------------------------------------------------------------------------------


def _engine(stage: int, precision: str):
    import deepspeed

    torch.manual_seed(0)
    model = MLP(SIZES)
    replica = copy.deepcopy(model)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    others = [p for n, p in model.named_parameters() if all(p is not w for w in weights)]
    optimizer = torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}], lr=0.05
    )
    config = {
        "train_batch_size": 2 * MICRO * GAS,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
    }
    if precision != "fp32":
        config["bf16"] = {"enabled": True}
    if precision == "bf16acc":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return engine, replica.to(dtype), dtype


def _batch(rank: int, step: int, micro: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, SIZES[0], generator=generator).to(dtype)


def _frees_each_micro_batch(stage: int, precision: str) -> bool:
    """DeepSpeed reduces each micro-batch's gradient into its own buffers and frees it under ZeRO-2
    and 3 and with fp32 gradient accumulation; otherwise ``.grad`` accumulates until the step."""
    return stage >= 2 or precision == "bf16acc"


def _train_step(engine, rank: int, step: int, dtype: torch.dtype, before_update=None) -> None:
    """GAS micro-batches (DeepSpeed divides each loss by GAS); ``before_update()`` runs after the
    last backward, before the step that updates."""
    for micro in range(GAS):
        engine.backward(engine(_batch(rank, step, micro, dtype)).float().pow(2).mean())
        if micro == GAS - 1 and before_update is not None:
            before_update()
        engine.step()


def _full(engine, param, kind: str) -> np.ndarray | None:
    """The whole tensor (flattened) as DeepSpeed holds it: kind 'grad', 'param' or a moment key."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # ZeRO 1-3 and BF16_Optimizer
        if kind == "grad":
            tensor = safe_get_full_grad(param)
        elif kind == "param":
            tensor = safe_get_full_fp32_param(param)
        else:
            tensor = safe_get_full_optimizer_state(param, kind)
    else:  # stage 0: whole tensors on every rank (fp32: the torch optimizer; bf16: an fp32 copy)
        wrapper = engine.optimizer
        master = param
        if hasattr(wrapper, "fp32_groups"):
            pairs = zip(wrapper.fp16_groups, wrapper.fp32_groups)
            master = next(c for lp, hp in pairs for p, c in zip(lp, hp) if p is param)
        inner = getattr(wrapper, "optimizer", wrapper)
        if kind == "grad":
            tensor = param.grad
        elif kind == "param":
            tensor = master
        else:
            tensor = inner.state[master][kind]
    return tensor.detach().float().numpy().ravel().copy()


def _relink_moments(engine) -> None:
    """DeepSpeed's ZeRO-1/2 links each parameter to its moments once, after the first group's first
    update, when later groups have no state yet, so its safe_get_full_optimizer_state fails for
    them; link again with DeepSpeed's own code (a map only: the training is not touched)."""
    wrapper = engine.optimizer
    if type(wrapper).__name__ == "DeepSpeedZeroOptimizer":
        wrapper._hp_optimizer_states_linked = False
        wrapper._lazy_init_hp_params_optimizer_state()


def _clip_like_the_engine(engine, grads: dict[str, list]) -> None:
    """In stage 0 with fp32 the engine clips the gradients (DeepSpeed's default gradient_clipping is
    1.0) and then calls the torch optimizer, whose pre-step hook sees the clipped gradients."""
    total = np.sqrt(sum((np.asarray(g, dtype=np.float64) ** 2).sum() for g in grads.values()))
    coefficient = min(1.0, engine.gradient_clipping() / (total + 1e-6))
    for name, grad in grads.items():
        grads[name] = (np.asarray(grad) * coefficient).tolist()


def _agreement(grad: np.ndarray, moment: np.ndarray | None) -> float:
    if moment is None:
        return 1.0
    return float(((np.sign(grad.astype(np.float64)) * np.sign(moment)).sum() / moment.size + 1) / 2)


def _monitors(engine):
    from monitor import TrainerMon

    config = {**DATA_TYPES["all"], "ops": ALL_OPS, "format": "api"}
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer
    return {
        "merged": TrainerMon({**config, "shard_reduce": True}).set_monitor(engine.module, GAS, engine),
        "pieces": TrainerMon(config).set_monitor(engine.module, GAS, engine.optimizer),
        "targets": TrainerMon({**config, "targets": {t: {} for t in TARGETS}}).set_monitor(
            engine.module, GAS, inner
        ),
        "micro": TrainerMon(
            {"wg_distribution": True, "monitor_mbs_grad": True, "ops": ALL_OPS, "format": "api"}
        ).set_monitor(engine.module, GAS, engine),
        # grad_acc_steps too small: the first micro-batch is taken for the step's last
        "too_few": TrainerMon({"wg_distribution": True, "ops": ALL_OPS, "format": "api"}).set_monitor(
            engine.module, 1, engine
        ),
    }


def _final_params(engine) -> list[np.ndarray]:
    return [_full(engine, p, "param") for p in engine.module.parameters()]


def _unreduced_reference(replica, rank: int, step: int, dtype, stage: int, precision: str) -> dict:
    """This rank's gradient of the step (losses divided by GAS, as DeepSpeed does), accumulated as
    DeepSpeed leaves it: the fp32 sum of each micro-batch's gradient where DeepSpeed frees them,
    else autograd's accumulation in ``.grad`` ("total"); and each micro-batch's own ("micro")."""
    names = [name for name, _ in replica.named_parameters()]
    total: dict[str, np.ndarray] = {}
    replica.zero_grad()
    for micro in range(GAS):
        if _frees_each_micro_batch(stage, precision):
            replica.zero_grad()
        (replica(_batch(rank, step, micro, dtype)).float().pow(2).mean() / GAS).backward()
        for name, q in zip(names, replica.parameters()):
            grad = q.grad.float().numpy().ravel().astype(np.float32)
            if _frees_each_micro_batch(stage, precision):
                total[name] = grad if name not in total else total[name] + grad
            else:
                total[name] = grad
    per_micro = []
    for micro in range(GAS):  # each micro-batch's own gradient (monitor_mbs_grad)
        replica.zero_grad()
        (replica(_batch(rank, step, micro, dtype)).float().pow(2).mean() / GAS).backward()
        per_micro.append(
            {n: q.grad.float().numpy().ravel().tolist() for n, q in zip(names, replica.parameters())}
        )
    return {"total": {name: grad.tolist() for name, grad in total.items()}, "micro": per_micro}


def _case(rank: int, stage: int, precision: str) -> dict:
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("trainmon").addHandler(handler)
    engine, replica, dtype = _engine(stage, precision)
    monitors = _monitors(engine)
    backends = {key: type(mon._session.backend).__name__ for key, mon in monitors.items()}
    named = list(engine.module.named_parameters())
    steps = []
    for step in range(STEPS):
        ref = {"grad_reduced": {}, "param_origin": {}, "other": {}, "grad_unreduced": {}}

        def capture(step: int = step, ref: dict = ref) -> None:
            """After the step's last backward: DeepSpeed's tensors and the replica's gradients."""
            for name, p in named:
                grad, origin = _full(engine, p, "grad"), _full(engine, p, "param")
                ref["grad_reduced"][name], ref["param_origin"][name] = (
                    grad.ravel().tolist(),
                    origin.ravel().tolist(),
                )
                moment = _full(engine, p, "exp_avg") if step or (stage == 0 and precision != "fp32") else None
                ref["other"][name] = _agreement(grad, moment)
            if isinstance(engine.optimizer, torch.optim.Optimizer):  # stage 0 fp32: the generic back-end
                _clip_like_the_engine(engine, ref["grad_reduced"])
            with torch.no_grad():
                for (name, p), q in zip(named, replica.parameters()):  # the weights the forward used
                    lp = p if p.numel() else torch.tensor(ref["param_origin"][name])  # ZeRO-3: fp32 master
                    q.copy_(lp.detach().reshape(q.shape).to(dtype))
            ref["grad_unreduced"] = _unreduced_reference(replica, rank, step, dtype, stage, precision)

        _train_step(engine, rank, step, dtype, before_update=capture)
        _relink_moments(engine)
        for kind, prefix in (
            ("param", "param_updated"),
            ("exp_avg", "exp_avg"),
            ("exp_avg_sq", "exp_avg_sq"),
        ):
            ref[prefix] = {name: _full(engine, p, kind).tolist() for name, p in named}
        got = {key: {prefix: mon._latest(prefix) for prefix in PREFIXES} for key, mon in monitors.items()}
        steps.append({"ref": ref, "got": got})
    trained = _final_params(engine)
    for mon in monitors.values():
        mon.stop()
    logging.getLogger("trainmon").removeHandler(handler)
    unsummed = sum("the first micro-batch was taken for the step's last and not kept" in m for m in said)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    restored = "step" not in vars(engine.optimizer) and "step" not in vars(inner)
    plain, _, dtype = _engine(stage, precision)
    for step in range(STEPS):
        _train_step(plain, rank, step, dtype)
    identical = all(np.array_equal(a, b) for a, b in zip(trained, _final_params(plain)))
    return {
        "steps": steps,
        "backends": backends,
        "identical": identical,
        "restored": restored,
        "unsummed_said": unsummed,
    }


def _worker(rank: int, world_size: int, workdir: str, cases: list) -> None:
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # skip a JIT compile
    save_result(workdir, rank, {f"{s}-{p}": _case(rank, s, p) for s, p in cases})


# -- the checks ------------------------------------------------------------------------------


def _check_case(key: str, per_rank: list[dict], sharded: bool) -> None:
    stage, precision = key.split("-")
    for result in per_rank:  # the lost sum of too small a grad_acc_steps, said once
        assert result["unsummed_said"] == _frees_each_micro_batch(int(stage), precision), key
        assert result["identical"], f"{key}: training changed by the monitors"
        assert result["restored"], f"{key}: the optimizer's step was not restored"
    for step in range(STEPS):
        ref = per_rank[0]["steps"][step]["ref"]
        names = list(ref["param_origin"])
        for prefix in PREFIXES:
            pieces = [latest_rows(r["steps"][step]["got"]["pieces"], prefix) for r in per_rank]
            for rank, result in enumerate(per_rank):
                got = result["steps"][step]["got"]
                merged, targets = latest_rows(got["merged"], prefix), latest_rows(got["targets"], prefix)
                what = f"{key} step {step} rank {rank} {prefix}"
                selected = {name for name in TARGETS if name in pieces[rank]}  # held on this rank
                assert set(targets) == selected, f"{what}: targets rows {sorted(targets)}"
                for name in selected:  # a selection gives the same numbers as the full run
                    assert targets[name] == pieces[rank][name], f"{what} {name}: targets differ"
                if prefix == "grad_unreduced":  # each rank's own gradient, whole, and per micro-batch
                    own = result["steps"][step]["ref"]["grad_unreduced"]
                    for name in names:
                        want = np.array(own["total"][name])
                        assert_stats_close(merged[name], want, what=f"{what} {name}")
                        assert_stats_close(pieces[rank][name], want, what=f"{what} {name}")
                    # too small a grad_acc_steps: where DeepSpeed freed the first micro-batch's
                    # gradient, no rows at the first step (not the last micro-batch's as the sum),
                    # then the sum: every later step sums from its first micro-batch on
                    too_few = latest_rows(got["too_few"], prefix)
                    lost = step == 0 and _frees_each_micro_batch(int(stage), precision)
                    assert set(too_few) == (set() if lost else set(names)), f"{what}: {sorted(too_few)}"
                    for name in too_few:
                        assert_stats_close(too_few[name], np.array(own["total"][name]), what=f"{what} {name}")
                    micro_rows = latest_rows(got["micro"], prefix)
                    assert len(micro_rows) == GAS * len(names), f"{what}: {sorted(micro_rows)}"
                    for micro, grads in enumerate(own["micro"]):
                        for name in names:
                            row = micro_rows[f"{name}:{micro}"]
                            assert_stats_close(
                                row, np.array(grads[name]), what=f"{what} {name} micro {micro}"
                            )
                    continue
                assert set(merged) == set(names), f"{what}: rows {sorted(merged)}"
                for name in names:
                    if prefix == "other":
                        assert merged[name]["mean"] == pytest.approx(ref["other"][name], abs=1e-12), what
                        continue
                    want = np.array(ref[prefix][name])
                    assert_stats_close(merged[name], want, what=f"{what} {name} merged")
                    if sharded:
                        assert merged[name]["numel"] == want.size and merged[name]["partial"] == 0, what
            if prefix == "grad_unreduced":
                continue
            for name in names:
                rows = [p[name] for p in pieces if name in p]
                what = f"{key} step {step} {prefix} {name} pieces"
                if not sharded:
                    assert len(rows) == len(per_rank), what
                    rows = rows[:1]
                else:
                    size = len(ref["param_origin"][name])
                    assert all(r["partial"] == (r["numel"] < size) for r in rows), f"{what}: {rows}"
                whole = merge_piece_rows(rows) if sharded else rows[0]
                if prefix == "other":
                    want = ref["other"][name]
                    if sharded:
                        n = np.array([r["numel"] for r in rows])
                        got_share = (np.array([r["mean"] for r in rows]) * n).sum() / n.sum()
                    else:
                        got_share = whole["mean"]
                    assert got_share == pytest.approx(want, abs=1e-12), what
                    continue
                want = np.array(ref[prefix][name])
                if sharded:
                    assert whole["numel"] == want.size, what
                assert_stats_close(whole, want, what=what)


@pytest.mark.parametrize("stage", sorted(CASES))
def test_every_statistic_equals_deepspeeds_full_tensors(tmp_path, stage):
    cases = CASES[stage]
    per_rank = run_ranks(functools.partial(_worker, cases=cases), 2, str(tmp_path))
    for case in cases:
        key = f"{case[0]}-{case[1]}"
        results = [r[key] for r in per_rank]
        expected = BACKENDS.get(case, "FragmentBackend")
        for result in results:
            assert set(result["backends"].values()) == {expected}, f"{key}: {result['backends']}"
        _check_case(key, results, sharded=expected not in ("TorchBackend", "UnfusedBackend"))


HISTOGRAM_CASES = [(0, "bf16"), (2, "fp32"), (3, "fp32")]


def _histogram_case(rank: int, stage: int, precision: str) -> dict:
    """ur_distribution, whole (shard_reduce) and in pieces, and the references from DeepSpeed's
    full optimizer state after each step."""
    from monitor import TrainerMon

    engine, _, dtype = _engine(stage, precision)
    config = {"ur_distribution": True, "format": "tensorboard"}
    monitors = {
        "merged": TrainerMon({**config, "shard_reduce": True}).set_monitor(engine.module, GAS, engine),
        "pieces": TrainerMon(config).set_monitor(engine.module, GAS, engine.optimizer),
    }
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    group = inner.param_groups[0]
    expected = {}
    for step in range(STEPS):
        _train_step(engine, rank, step, dtype)
        _relink_moments(engine)
        count = float(next(iter(inner.state.values()))["step"])
        for name, p in engine.module.named_parameters():
            found = update_histogram_reference(
                _full(engine, p, "exp_avg"),
                _full(engine, p, "exp_avg_sq"),
                count,
                group["betas"],
                group["eps"],
            )
            for kind, (counts, nans) in found.items():
                expected[f"{name}/{kind}/{step}"] = (counts.tolist(), nans)
    for mon in monitors.values():
        mon.stop()
    return {"expected": expected, "dirs": {key: mon.output_dir for key, mon in monitors.items()}}


def _histogram_worker(rank: int, world_size: int, workdir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    save_result(workdir, rank, {f"{s}-{p}": _histogram_case(rank, s, p) for s, p in HISTOGRAM_CASES})


def _histogram_key(tag: str, step: int) -> str:
    return f"{tag.split('/')[0].split(':', 1)[1]}/{tag.split('/')[-1]}/{step}"


def test_update_histograms_equal_deepspeeds_optimizer_state(tmp_path):
    """ur_distribution through the back-ends: whole histograms on every rank with shard_reduce,
    pieces' histograms that add up to them (whole ones on each rank where nothing is sharded)."""
    env = {"MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    per_rank = run_ranks(_histogram_worker, 2, str(tmp_path), env=env)
    for stage, precision in HISTOGRAM_CASES:
        results = [r[f"{stage}-{precision}"] for r in per_rank]
        expected = results[0]["expected"]
        pieces: dict[str, list] = {}
        for rank, result in enumerate(results):
            merged = read_histograms(result["dirs"]["merged"])
            assert {_histogram_key(t, s) for t, s in merged} == set(expected), f"stage {stage} rank {rank}"
            for (tag, step), (counts, nans) in merged.items():
                want = expected[_histogram_key(tag, step)]
                assert (counts.tolist(), nans) == (want[0], want[1]), (
                    f"stage {stage} rank {rank} {tag} {step}"
                )
            for (tag, step), (counts, nans) in read_histograms(result["dirs"]["pieces"]).items():
                total = pieces.setdefault(_histogram_key(tag, step), [np.zeros(len(counts)), 0])
                total[0] += counts
                total[1] += nans
        assert set(pieces) == set(expected), f"stage {stage}: every histogram has its pieces"
        ranks_per_whole = 1 if stage else len(results)  # stage 0: every rank holds the whole state
        for key, (counts, nans) in pieces.items():
            assert (counts / ranks_per_whole).tolist() == expected[key][0], f"stage {stage} {key}"
            assert nans / ranks_per_whole == expected[key][1], f"stage {stage} {key}"


def _attached_before_initialize_worker(rank: int, world_size: int, workdir: str) -> None:
    import logging

    import deepspeed

    from monitor import TrainerMon

    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    said = {}
    for stage in (0, 1, 3):
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("trainmon").addHandler(handler)
        torch.manual_seed(0)
        model = MLP(SIZES)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        config = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
        mon = TrainerMon({**config, "format": "api"})
        mon.set_monitor(model, grad_acc_steps=GAS, optimizer=optimizer)  # too early: before initialize
        config = {
            "train_batch_size": 2 * MICRO * GAS,
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        _train_step(engine, rank, 0, torch.float32)
        written = sorted(p for p in PREFIXES if p != "other" and mon._core.latest.latest(p))
        values = [v for p in written for row in mon._core.latest.latest(p).values() for v in row.values()]
        assert np.isfinite(values).all(), f"stage {stage}: rows of what describes nothing: {written}"
        mon.stop()
        logging.getLogger("trainmon").removeHandler(handler)
        messages = [r.getMessage() for r in records if "describe none of this training" in r.getMessage()]
        said[stage] = {"said": messages, "written": written}
    said["caveat"] = _collectives_caveat_said()
    save_result(workdir, rank, said)


def _collectives_caveat_said() -> list[str]:
    """ZeRO-3 attached as it should be, with cc_distribution: what is said about its padding."""
    import logging

    import deepspeed

    from monitor import TrainerMon

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("trainmon").addHandler(handler)
    mon = TrainerMon({"cc_distribution": {"enable": True}, "format": "api"})
    torch.manual_seed(0)
    model = MLP(SIZES)
    config = {"train_batch_size": 2 * MICRO, "train_micro_batch_size_per_gpu": MICRO}
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        config={**config, "zero_optimization": {"stage": 3}},
    )
    mon.set_monitor(engine.module, grad_acc_steps=1, optimizer=engine)
    mon.stop()
    logging.getLogger("trainmon").removeHandler(handler)
    return [r.getMessage() for r in records if "pads the last rank's partition" in r.getMessage()]


def test_attaching_before_deepspeed_initialize_is_said_where_it_makes_the_rows_wrong(tmp_path):
    """ZeRO-1/2 give the torch optimizer flat partitions in place of the model's parameters, and
    ZeRO-3 partitions the parameters themselves: a monitor attached before initialize reads
    neither, which is said before the first update, and the rows that would describe nothing of
    the training (ZeRO-3's empty placeholders: NaN rows) are not written. ZeRO-0 updates the
    parameters themselves: silent."""
    everything = sorted(p for p in PREFIXES if p != "other")
    for said in run_ranks(_attached_before_initialize_worker, 2, str(tmp_path)):
        assert said["0"] == {"said": [], "written": everything}
        (message,) = said["1"]["said"]
        assert "AdamW updates none of the monitored parameters" in message
        assert "under DeepSpeed ZeRO-2" in message  # the stage cannot be told: ZeRO-1 keeps .grad
        assert ": grad_reduced, exp_avg, exp_avg_sq, param_updated would describe none" in message  # asked
        assert said["1"]["written"] == ["grad_unreduced", "param_origin"]
        (message,) = said["3"]["said"]
        assert "DeepSpeed ZeRO-3 partitioned" in message and "would hold the last one's only" in message
        assert (
            ": grad_unreduced, grad_reduced, exp_avg, exp_avg_sq, param_updated, param_origin would describe"
            in message
        )
        assert said["3"]["written"] == [], said["3"]  # GAS micro-batches, each gradient freed: not written
        assert len(said["caveat"]) == 1, said["caveat"]  # with cc_distribution, its padding is said
