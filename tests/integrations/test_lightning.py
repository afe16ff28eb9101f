"""Lightning with TrainmonCallback: right numbers for every data type although the last
micro-batch runs inside ``optimizer.step(closure)``, ragged last steps and clipping included, in
one process and on 2 gloo ranks."""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("lightning")

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.integrations.reads import CONFIG, compare, ddp_rank_result, watch_ddp_verdicts, written_rows


@pytest.mark.parametrize("grad_acc", [1, 2])
def test_every_data_type_matches_the_trainers_tensors(tmp_path, grad_acc):
    from tests.integrations.lightning_run import train

    reads, callback, trainer = train(str(tmp_path), grad_acc)
    rows = written_rows(callback.monitor.output_dir)
    compared = compare(reads.steps, rows, f"lightning grad_acc {grad_acc}")
    assert compared == len(reads.steps) * 6 * len(reads.named_parameters()) * 6
    assert trainer.global_step == len(reads.steps)
    if grad_acc > 1:
        assert 1 in reads.micro_batches and grad_acc in reads.micro_batches
    logged = pd.read_csv(os.path.join(trainer.logger.log_dir, "metrics.csv"))
    assert set(logged["step"]) == set(reads.steps)  # the monitor's steps are the ones Lightning logs


@pytest.mark.parametrize("streaming", [False, True], ids=["sized", "streaming"])
def test_a_loss_scaler_running_the_closure_itself_keeps_the_short_steps_gradients(tmp_path, streaming):
    """fp16 with a loss scaler: Lightning calls the closure, then ``optimizer.step()`` without it,
    so the monitor learns from the callback which micro-batch ends each step (the shorter last
    step of an epoch included, also from a streaming dataset, whose length is unknown)."""
    from tests.integrations.lightning_run import train

    reads, callback, trainer = train(str(tmp_path), 2, loss_scaling=True, streaming=streaming)
    assert type(trainer.precision_plugin).__name__ == "MixedPrecision"
    assert trainer.num_training_batches == (float("inf") if streaming else 11)
    rows = written_rows(callback.monitor.output_dir)
    compared = compare(reads.steps, rows, "lightning fp16 loss-scaled")
    assert compared == len(reads.steps) * 6 * len(reads.named_parameters()) * 6
    assert 1 in reads.micro_batches  # short steps were there


def test_steps_whose_update_the_loss_scaler_skipped_keep_lightnings_numbers(tmp_path):
    """A loss scale far too large for fp16: the scaler finds Inf in the first steps' gradients
    and never calls ``optimizer.step``, whose hooks mark a step's end. Lightning counts those
    steps; the monitor, told by the callback, counts them too and writes what they measured (the
    unreduced gradients, with their Inf) and nothing of the update, with no incident: an
    overflow the scaler handles is no fault."""
    from tests.integrations.lightning_run import train

    config = {**CONFIG, "alert": {"rules": [{"rule_name": "AnomalyZScore"}]}}
    reads, callback, trainer = train(
        str(tmp_path), 2, monitor_config=config, loss_scaling=True, init_scale=2.0**30
    )
    assert len(reads.skipped) >= 2 and len(reads.skipped) < len(reads.steps)
    rows = written_rows(callback.monitor.output_dir)
    compared = compare(reads.steps, rows, "lightning fp16 skipped updates", skipped=tuple(reads.skipped))
    params = len(reads.named_parameters())
    assert compared == (6 * len(reads.steps) - 5 * len(reads.skipped)) * params * 6
    assert any(
        np.isinf(rows["grad_unreduced", name, step]["norm"])
        for name, _ in reads.named_parameters()
        for step in reads.skipped
    )
    logged = pd.read_csv(os.path.join(trainer.logger.log_dir, "metrics.csv"))
    assert set(logged["step"]) == set(reads.steps) and callback.monitor.step == trainer.global_step
    assert callback.monitor.incidents == []


def test_a_second_fit_with_the_same_callback_attaches_again(tmp_path):
    """The callback serves a second fit, in a new rank directory, with numbers that match that
    run's own reads; the first run's directory keeps its own steps."""
    from tests.integrations.lightning_run import train

    reads, callback, _ = train(str(tmp_path / "first"), 1)
    first_dir = callback.monitor.output_dir
    assert not callback.attached
    again, _, _ = train(str(tmp_path / "second"), 1, callback=callback)
    assert callback.monitor.output_dir != first_dir and not callback.attached
    rows = written_rows(callback.monitor.output_dir)
    compared = compare(again.steps, rows, "second fit")
    assert compared == len(again.steps) * 6 * len(again.named_parameters()) * 6
    assert {step for _, _, step in written_rows(first_dir)} == set(reads.steps)


def _note_incident(message: dict) -> None:
    """An on_incident function at module level: one that a copy of the callback can carry."""


def test_a_copied_callback_carries_its_config_and_attaches_on_its_own(tmp_path, trainmon_log):
    """Lightning's ddp_spawn pickles the callbacks into each process it starts: the copy (a
    config with l2_targets, which the config holds read-only) is not attached, has the same config,
    keeps the functions that can be pickled (a lambda is said and left out) and monitors a fit of
    its own with the right numbers, while the original's outputs are untouched."""
    import pickle

    from monitor.integrations.lightning import TrainmonCallback
    from tests.integrations.lightning_run import train

    config = {**CONFIG, "l2_targets": {"attention_hook": [], "linear_hook": []}}
    callback = TrainmonCallback(config)
    callback.monitor.on_incident(_note_incident).on_incident(lambda message: None)
    copy = pickle.loads(pickle.dumps(callback))
    assert not copy.attached and copy.monitor is not callback.monitor
    assert copy.monitor.config == callback.monitor.config
    changed = TrainmonCallback(config)
    changed.monitor.ops = ["norm", "nans"]  # a change made in Python, not in any file
    assert pickle.loads(pickle.dumps(changed)).monitor.config.ops == ("norm", "nans")
    assert copy.monitor._incident_callbacks == [_note_incident]
    assert any(
        "cannot be copied into the trainer's other processes" in r.getMessage() for r in trainmon_log.records
    )
    reads, _, _ = train(str(tmp_path), 2, callback=copy)
    rows = written_rows(copy.monitor.output_dir)
    assert compare(reads.steps, rows, "copied callback") > 0
    assert callback.monitor.output_dir is None or not os.path.exists(callback.monitor.output_dir)


def test_a_fit_that_failed_leaves_its_ended_steps_on_disk_and_detaches(tmp_path):
    """A fit that raises reaches the callback's ``on_exception``: the hooks go and the outputs are
    closed with every ended step in them."""
    import lightning as L

    from monitor.integrations.lightning import TrainmonCallback
    from tests.integrations.lightning_run import train

    class FailAtStep3(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                raise RuntimeError("simulated failure at step 3")

    callback = TrainmonCallback(CONFIG)
    with pytest.raises(RuntimeError, match="simulated failure"):
        train(str(tmp_path), 1, callbacks=(FailAtStep3(),), callback=callback)
    assert not callback.attached and not callback.monitor.monitoring
    assert {step for _, _, step in written_rows(callback.monitor.output_dir)} == {0, 1, 2}


def test_a_failure_to_attach_is_reported_and_fit_goes_on(tmp_path, trainmon_log, monkeypatch):
    from monitor.session.trainer import TrainerMon
    from tests.integrations.lightning_run import train

    def refuse(self, *args, **kwargs):
        raise RuntimeError("simulated attach failure")

    monkeypatch.setattr(TrainerMon, "set_monitor", refuse)
    reads, callback, trainer = train(str(tmp_path), 1)
    assert trainer.global_step == len(reads.steps) > 0 and not callback.attached
    assert any("training continues unmonitored" in r.getMessage() for r in trainmon_log.records)


def _ddp_worker(rank: int, world_size: int, workdir: str) -> None:
    from tests.integrations.lightning_run import train

    # what torchrun sets: Lightning then joins the existing process group instead of launching
    os.environ.update(
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID="trainmon-test",
        MONITOR_OUTPUT_DIR=os.path.join(workdir, "out"),
    )
    verdicts, found = watch_ddp_verdicts()
    reads, callback, trainer = train(os.path.join(workdir, f"run{rank}"), grad_acc=2)
    save_result(
        workdir,
        rank,
        {
            **ddp_rank_result(reads, callback.monitor.output_dir, f"lightning rank {rank}", verdicts),
            "strategy": type(trainer.strategy).__name__,
            # the strategy unwraps its model at the end of fit: the one wrapper found holds the module
            "found_the_trainers_wrapper": [
                len(f or ()) == 1 and any(m is trainer.lightning_module for m in f[0].modules())
                for f in found
            ],
        },
    )


def test_a_bad_config_fails_when_the_callback_is_built():
    from monitor import ConfigError
    from monitor.integrations.lightning import TrainmonCallback

    with pytest.raises(ConfigError, match="nrom"):
        TrainmonCallback({**CONFIG, "ops": ["nrom"]})


@pytest.mark.distributed
def test_two_ddp_ranks_each_record_their_own_gradients(tmp_path):
    results = run_ranks(_ddp_worker, 2, str(tmp_path))
    assert all(r["strategy"] == "DDPStrategy" for r in results)
    assert results[0]["steps"] == results[1]["steps"]
    assert all(r["compared"] > 0 for r in results)
    differing = [k for k, v in results[0]["norms"].items() if v != results[1]["norms"][k]]
    assert differing, "each rank's unreduced gradient is its own, so they differ"
    # the model handed to the callback is inside the DDP wrapper, which is found: the gradients
    # are measured together at the backward pass's end, not in a hook each
    assert all(r["measured_at_pass_end"] == [True] for r in results)
    assert all(r["found_the_trainers_wrapper"] == [True] for r in results)


def test_per_micro_batch_rows_are_each_micro_batchs_own_gradient(tmp_path):
    """``monitor_mbs_grad`` under Lightning, whose last micro-batch runs inside
    ``optimizer.step(closure)``: a row per micro-batch each step really had (the short last step
    of an epoch included), equal to the gradient autograd handed over for that micro-batch."""
    from tests.integrations.lightning_run import train
    from tests.integrations.reads import CONFIG, written_micro_rows
    from tests.reference_stats import assert_stats_close

    reads, callback, _ = train(str(tmp_path), 2, monitor_config={**CONFIG, "monitor_mbs_grad": True})
    rows = written_micro_rows(callback.monitor.output_dir, "grad_unreduced")
    expected = {
        (name, step, micro): grad
        for step, micro_batches in reads.own.items()
        for micro, grads in enumerate(micro_batches)
        for name, grad in grads.items()
    }
    assert 1 in reads.micro_batches and 2 in reads.micro_batches
    assert expected and set(rows) == set(expected)
    for key, grad in expected.items():
        assert_stats_close(rows[key], grad, what=f"micro-batch row {key}")


def test_activations_take_their_micro_step_from_lightnings_micro_batches(tmp_path):
    """training_step calls the submodules, never the LightningModule itself: the callback says
    when each micro-batch begins, so the second micro-batch's rows are micro-step 1 (not an extra
    call of each module at micro-step 0), and each row is the norm of that micro-batch's output."""
    import lightning as L

    from tests.integrations.lightning_run import train
    from tests.integrations.reads import CONFIG

    class OwnRead(L.Callback):
        """The head's output norm per (step, micro-batch), read by a forward hook of the test's."""

        def __init__(self) -> None:
            self.norms: dict[tuple[int, int], float] = {}
            self._micro, self._step = 0, -1

        def on_train_start(self, trainer, pl_module) -> None:
            pl_module.head.register_forward_hook(self._read)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._micro = self._micro + 1 if trainer.global_step == self._step else 0
            self._step = trainer.global_step

        def _read(self, module, args, output) -> None:
            if module.training:
                self.norms[(self._step, self._micro)] = float(output.detach().double().norm())

    own = OwnRead()
    config = {**CONFIG, "xy_distribution": True, "wg_distribution": False, "targets": {"head": {}}}
    _, callback, _ = train(str(tmp_path), 2, monitor_config=config, callbacks=(own,))
    rows = pd.concat(
        pd.read_csv(f) for f in glob.glob(os.path.join(callback.monitor.output_dir, "actv_[0-9]*.csv"))
    )
    outputs = rows[rows["name"].str.startswith("head") & rows["name"].str.contains("output")]
    assert set(outputs["name"]) == {"head.output"}, sorted(set(outputs["name"]))  # no extra calls
    written = {(int(r.step), int(r.micro_step)): float(r.norm) for r in outputs.itertuples()}
    assert {micro for _, micro in written} == {0, 1}
    assert written.keys() == own.norms.keys()
    for key, norm in own.norms.items():
        assert written[key] == pytest.approx(norm, rel=1e-5), key


def test_a_module_fit_compiled_has_eager_activations_from_the_first_step(tmp_path, trainmon_log, monkeypatch):
    """fit(torch.compile(module)): Lightning unwraps the module and compiles its methods; the
    callback says so, so the first collected step runs eagerly with every activation row, as the
    later ones do (uncollected steps between run the compiled code)."""
    from adapters.torch.compiled import COMPILED_CODE
    from tests.integrations.lightning_run import train
    from tests.integrations.reads import CONFIG, written_micro_rows

    monkeypatch.setattr(COMPILED_CODE, "ran_hooks", False)  # no compiled code of earlier tests
    config = {**CONFIG, "xy_distribution": True, "all_xy": True, "step_interval": 2}
    rows = {}
    for backend in (None, "aot_eager"):
        _, callback, _ = train(str(tmp_path / str(backend)), 2, config, compile_backend=backend)
        rows[backend] = written_micro_rows(callback.monitor.output_dir, "actv")
    eager, compiled = rows[None], rows["aot_eager"]
    assert min(step for _, step, _ in eager) == 0  # the first step is collected
    assert compiled.keys() == eager.keys()
    for key, ops in eager.items():
        np.testing.assert_allclose(list(compiled[key].values()), list(ops.values()), rtol=1e-4, atol=1e-6)
    assert COMPILED_CODE.ran_hooks  # the steps between ran the compiled code
    assert not [r for r in trainmon_log.records if "compiled code ran the monitor's hooks" in r.getMessage()]


def test_a_fit_resumed_from_a_checkpoint_judges_its_first_steps_against_the_kept_history(
    tmp_path, monkeypatch
):
    """A loss x1000 two steps after resuming from a checkpoint saved at step 12: with the rules'
    history kept as the callback's state the step is an incident; from a checkpoint without it
    the resumed fit starts a new warm-up of 10 values and cannot see it."""
    import lightning as L
    import torch

    from monitor.integrations.lightning import TrainmonCallback
    from tests.integrations.lightning_run import TinyGPT
    from tests.integrations.reads import StepReads

    class Spiky(TinyGPT):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1000.0 if self.trainer.global_step == 14 else loss

    rules = [{"rule_name": "AnomalyZScore", "args": {"threshold": 6.0, "warmup": 10, "min_ratio": 4.0}}]
    config = {**CONFIG, "alert": {"rules": rules}}
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    tokens = torch.randint(0, 64, (64, 9), generator=torch.Generator().manual_seed(0))

    def fit(steps: int, callback: TrainmonCallback, ckpt_path: str | None = None) -> L.Trainer:
        torch.manual_seed(0)
        module = Spiky()
        module.reads = StepReads(module)
        trainer = L.Trainer(
            max_steps=steps,
            callbacks=[callback],
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=2), ckpt_path=ckpt_path)
        module.reads.remove()
        return trainer

    fit(12, TrainmonCallback(config)).save_checkpoint(tmp_path / "kept.ckpt")
    fit(12, TrainmonCallback(config)).save_checkpoint(tmp_path / "bare.ckpt")
    bare = torch.load(tmp_path / "bare.ckpt", weights_only=False)
    bare["callbacks"] = {key: {} for key in bare["callbacks"]}  # as one saved without the monitor's state
    torch.save(bare, tmp_path / "bare.ckpt")
    for checkpoint, onsets in (("kept.ckpt", [14]), ("bare.ckpt", [])):
        callback = TrainmonCallback(config)
        fit(16, callback, str(tmp_path / checkpoint))
        assert [incident.onset_step for incident in callback.monitor.incidents] == onsets, checkpoint
