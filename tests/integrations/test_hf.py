"""The Hugging Face Trainer with TrainmonCallback: right numbers for every data type, ragged
last steps and clipping included, in one process and on 2 gloo ranks; never a crash."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("transformers")

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.integrations.reads import CONFIG, compare, ddp_rank_result, watch_ddp_verdicts, written_rows


def test_every_data_type_matches_the_trainers_tensors(tmp_path):
    from tests.integrations.hf_run import GRAD_ACC, train

    reads, callback, trainer = train(str(tmp_path))
    rows = written_rows(callback.monitor.output_dir)
    compared = compare(reads.steps, rows, "hf")
    assert compared == len(reads.steps) * 6 * len(reads.named_parameters()) * 6
    assert 1 in reads.micro_batches and GRAD_ACC in reads.micro_batches  # ragged last steps were run
    logged = {entry["step"] for entry in trainer.state.log_history if "loss" in entry}
    assert logged == set(reads.steps)  # the monitor's steps are the Trainer's logged step numbers


def test_a_step_shorter_than_grad_acc_steps_is_said_once(tmp_path, trainmon_log):
    from tests.integrations.hf_run import train

    train(str(tmp_path))
    said = [r.getMessage() for r in trainmon_log.records if "micro-batch" in r.getMessage()]
    assert len(said) == 1 and "had 1 micro-batch(es)" in said[0], said


def test_a_model_the_trainer_compiles_has_eager_activations_from_the_first_step(
    tmp_path, trainmon_log, monkeypatch
):
    """torch_compile: the Trainer hands the callback the model it runs compiled; the callback says
    so, so the first collected step runs eagerly with every activation row, as the later ones do
    (uncollected steps between run the compiled code)."""
    from adapters.torch.compiled import COMPILED_CODE
    from tests.integrations.hf_run import train
    from tests.integrations.reads import written_micro_rows

    monkeypatch.setattr(COMPILED_CODE, "ran_hooks", False)  # no compiled code of earlier tests
    config = {**CONFIG, "xy_distribution": True, "all_xy": True, "start_step": 1, "step_interval": 2}
    rows = {}
    for backend in (None, "aot_eager"):
        _, callback, _ = train(str(tmp_path / str(backend)), config, compile_backend=backend)
        rows[backend] = written_micro_rows(callback.monitor.output_dir, "actv")
    eager, compiled = rows[None], rows["aot_eager"]
    assert min(step for _, step, _ in eager) == 1  # the Trainer's first step is collected
    assert compiled.keys() == eager.keys()
    for key, ops in eager.items():
        np.testing.assert_allclose(list(compiled[key].values()), list(ops.values()), rtol=1e-4, atol=1e-6)
    assert COMPILED_CODE.ran_hooks  # the steps between ran the compiled code
    assert not [r for r in trainmon_log.records if "compiled code ran the monitor's hooks" in r.getMessage()]


def test_one_callback_listed_twice_is_said_and_its_rows_are_right(tmp_path, trainmon_log):
    """Each event comes twice: the second beginning of the same run is said as such (it was taken
    for an earlier run that had ended without its end of training)."""
    from monitor.integrations.hf import TrainmonCallback
    from tests.integrations.hf_run import ReadEachStep, StepReads, build_trainer, tiny_gpt2

    model = tiny_gpt2()
    reads = StepReads(model)
    callback = TrainmonCallback(CONFIG)
    build_trainer(str(tmp_path), model, [callback, callback, ReadEachStep(reads)]).train()
    reads.remove()
    said = [r.getMessage() for r in trainmon_log.records]
    assert len([m for m in said if "began the same run twice with this callback" in m]) == 1, said
    assert not [m for m in said if "ended without reaching its end of training" in m], said
    compare(reads.steps, written_rows(callback.monitor.output_dir), "hf")


def test_two_callbacks_on_one_model_keep_their_own_anomaly_files(tmp_path, trainmon_log, monkeypatch):
    """Two configs at once: the second monitor renamed the first's fresh anomaly files as an
    earlier run's, then both overwrote the same files. Each now writes its own directory, which
    anomaly-analyse reads together, and each records its own rows."""
    from monitor.anomaly.analyse import main as analyse
    from monitor.integrations.hf import TrainmonCallback
    from tests.integrations.hf_run import ReadEachStep, StepReads, build_trainer, tiny_gpt2

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    msprobe_like = {"threshold": 0.01, "warmup": 1, "noise": 0, "floor": 0}  # flags nearly every move
    alert = {"rules": [{"rule_name": "AnomalyTurbulence", "args": msprobe_like}], "dump": True}
    model = tiny_gpt2()
    reads = StepReads(model)
    first = TrainmonCallback({**CONFIG, "alert": alert})
    second = TrainmonCallback({"xy_distribution": True, "ops": ["norm"], "format": "csv", "alert": alert})
    build_trainer(str(tmp_path), model, [first, second, ReadEachStep(reads)]).train()
    reads.remove()
    said = [r.getMessage() for r in trainmon_log.records]
    assert not [m for m in said if "earlier run" in m], said
    (moved,) = [m for m in said if "another monitor of this process writes the anomaly files" in m]
    anomaly_dir = tmp_path / "out" / "anomaly_detected"
    assert sorted(p.name for p in anomaly_dir.iterdir()) == ["rank0", "rank0-2"], moved
    tasks = {
        directory: {
            key.rsplit("/", 1)[1].split("_", 1)[0]
            for key in json.loads((anomaly_dir / directory / "anomaly.json").read_text())
        }
        for directory in ("rank0", "rank0-2")
    }
    assert tasks["rank0"] and tasks["rank0"] <= {"acc", "post", "param", "exp"}, tasks
    assert tasks["rank0-2"] == {"actv"}, tasks
    assert analyse(["-d", str(tmp_path / "out"), "-k", "100000"]) == 0
    ranked = json.loads((anomaly_dir / "anomaly_analyse.json").read_text())
    assert {r["tag_name"].rsplit("/", 1)[1] for r in ranked.values()} > {"actv"}  # ranked together
    compare(reads.steps, written_rows(first.monitor.output_dir), "hf")


def test_a_failure_to_attach_is_reported_and_training_goes_on(tmp_path, trainmon_log, monkeypatch):
    from monitor.session.trainer import TrainerMon
    from tests.integrations.hf_run import train

    def refuse(self, *args, **kwargs):
        raise RuntimeError("simulated attach failure")

    monkeypatch.setattr(TrainerMon, "set_monitor", refuse)
    reads, callback, trainer = train(str(tmp_path))
    assert trainer.state.global_step == len(reads.steps) > 0
    assert not callback.attached
    assert any("training continues unmonitored" in r.getMessage() for r in trainmon_log.records)


def test_a_train_that_raised_is_closed_when_the_next_train_begins(tmp_path, trainmon_log, monkeypatch):
    """The Trainer calls no callback when train() raises: the session stays attached until the
    next train(), which must close it rather than count its steps on under the new numbering."""
    from transformers import TrainerCallback

    from monitor.integrations.hf import TrainmonCallback
    from tests.integrations.hf_run import ReadEachStep, build_trainer, tiny_gpt2
    from tests.integrations.reads import StepReads

    class FailOnce(TrainerCallback):
        failed = False

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3 and not self.failed:
                self.failed = True
                raise RuntimeError("simulated failure at step 3")

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model, callback = tiny_gpt2(), TrainmonCallback(CONFIG)
    failing = StepReads(model)
    trainer = build_trainer(str(tmp_path), model, [callback, ReadEachStep(failing), FailOnce()])
    with pytest.raises(RuntimeError, match="simulated failure"):
        trainer.train()
    failing.remove()
    first_dir = callback.monitor.output_dir
    assert callback.attached  # nothing told it the run ended

    reads = StepReads(model)
    trainer.remove_callback(ReadEachStep)
    trainer.add_callback(ReadEachStep(reads))
    trainer.train()
    reads.remove()
    assert any("ended without reaching its end of training" in r.getMessage() for r in trainmon_log.records)
    assert callback.monitor.output_dir != first_dir and not callback.attached
    first = written_rows(first_dir)
    assert {step for _, _, step in first} == {1, 2, 3}  # closed at step 3, nothing after
    second = written_rows(callback.monitor.output_dir)
    assert (
        compare(reads.steps, second, "after a failed train()")
        == len(reads.steps) * 6 * len(reads.named_parameters()) * 6
    )
    assert sorted(reads.steps) == sorted({step for _, _, step in second})


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_steps_whose_update_the_loss_scaler_skipped_keep_the_trainers_numbers(tmp_path, optim):
    """fp16 with a loss scale far too large: the first updates overflow and are skipped, by the
    scaler not calling the optimizer (which the callback tells the monitor) or by the fused
    optimizer itself (which says so to its hooks). The Trainer counts those steps and so does the
    monitor; what they measured is written, and an overflow the scaler handles is no incident."""
    from tests.integrations.hf_run import train

    config = {**CONFIG, "alert": {"rules": [{"rule_name": "AnomalyZScore"}]}}
    reads, callback, trainer = train(str(tmp_path), config, optim=optim, init_scale=2.0**127)
    inf_steps = sorted(
        step
        for (kind, _, step), row in written_rows(callback.monitor.output_dir).items()
        if kind == "grad_unreduced" and not np.isfinite(row["max"])
    )
    assert len(set(inf_steps)) >= 2
    rows = written_rows(callback.monitor.output_dir)
    compare(reads.steps, rows, f"hf fp16 {optim}", skipped=tuple(reads.skipped))
    assert bool(reads.skipped) == (optim == "adamw_torch")
    logged = {entry["step"] for entry in trainer.state.log_history if "loss" in entry}
    assert logged == set(reads.steps) and callback.monitor.step == trainer.state.global_step + 1
    assert callback.monitor.incidents == []


def test_a_bad_config_fails_when_the_callback_is_built():
    from monitor import ConfigError
    from monitor.integrations.hf import TrainmonCallback

    with pytest.raises(ConfigError, match="ops"):
        TrainmonCallback({**CONFIG, "ops": ["nrom"]})


def test_an_unknown_keyword_argument_is_named_with_what_the_callback_takes():
    from monitor.integrations.hf import TrainmonCallback

    with pytest.raises(
        TypeError, match=r"unexpected keyword argument\(s\) grad_acc_steps: it takes the config"
    ):
        TrainmonCallback(CONFIG, grad_acc_steps=2)


def test_the_lightning_callback_handed_to_the_trainer_names_the_one_to_use():
    """Transformers' own callback handler calls every event on every callback: a Lightning
    callback there fails with a message that names the Hugging Face one."""
    pytest.importorskip("lightning")
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler

    from monitor.integrations.lightning import TrainmonCallback

    handler = CallbackHandler([TrainmonCallback(CONFIG)], None, None, None, None)
    with pytest.raises(
        AttributeError, match=r"callback for Lightning .*monitor\.integrations\.hf\.TrainmonCallback"
    ):
        handler.on_init_end(TrainingArguments(output_dir="unused"), TrainerState(), TrainerControl())
    assert not hasattr(TrainmonCallback(CONFIG), "on_init_end")  # probing stays an AttributeError


def _ddp_worker(rank: int, world_size: int, workdir: str) -> None:
    from tests.integrations.hf_run import train

    os.environ.update(LOCAL_RANK=str(rank), MONITOR_OUTPUT_DIR=os.path.join(workdir, "out"))
    verdicts, found = watch_ddp_verdicts()
    reads, callback, trainer = train(os.path.join(workdir, f"run{rank}"))
    save_result(
        workdir,
        rank,
        {
            **ddp_rank_result(reads, callback.monitor.output_dir, f"hf rank {rank}", verdicts),
            "micro_batches": reads.micro_batches,
            "ddp": type(trainer.model_wrapped).__name__,
            "found_the_trainers_wrapper": [any(w is trainer.model_wrapped for w in f or ()) for f in found],
        },
    )


@pytest.mark.distributed
def test_two_ddp_ranks_each_record_their_own_gradients(tmp_path):
    results = run_ranks(_ddp_worker, 2, str(tmp_path))
    assert all(r["ddp"] == "DistributedDataParallel" for r in results)
    assert results[0]["steps"] == results[1]["steps"]
    assert all(r["compared"] > 0 for r in results)
    assert all(1 in r["micro_batches"] and 2 in r["micro_batches"] for r in results)  # ragged last steps
    differing = [k for k, v in results[0]["norms"].items() if v != results[1]["norms"][k]]
    assert differing, "each rank's unreduced gradient is its own, so they differ"
    # the model handed to the callback is inside the DDP wrapper, which is found: the gradients
    # are measured together at the backward pass's end, not in a hook each
    assert all(r["measured_at_pass_end"] == [True] for r in results)
    assert all(r["found_the_trainers_wrapper"] == [True] for r in results)


def test_a_resumed_run_judges_its_first_steps_against_the_history_kept_in_the_checkpoint(
    tmp_path, monkeypatch
):
    """Reduced gradients x1000 two steps after resuming from checkpoint-12: with the rules'
    history kept in the checkpoint (one file per rank) the step is an incident; with that file
    gone the resumed run starts a new warm-up of 10 values and cannot see it."""
    import torch
    from transformers import TrainerCallback

    from monitor.integrations.hf import STATE_FILE, TrainmonCallback
    from tests.integrations.hf_run import build_trainer, tiny_gpt2

    class Spike(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 == 14:  # after clipping: the update the Trainer logs as 14
                with torch.no_grad():
                    for param in model.parameters():
                        param.grad.mul_(1000.0)

    rules = [{"rule_name": "AnomalyZScore", "args": {"threshold": 6.0, "warmup": 10, "min_ratio": 4.0}}]
    config = {**CONFIG, "alert": {"rules": rules}}
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    first = build_trainer(
        str(tmp_path),
        tiny_gpt2(),
        [TrainmonCallback(config)],
        max_steps=12,
        save_strategy="steps",
        save_steps=12,
    )
    first.train()
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-12")
    saved = os.path.join(checkpoint, STATE_FILE.format(rank=0))
    assert os.path.isfile(saved)

    def resumed_onsets() -> list[int]:
        callback = TrainmonCallback(config)
        trainer = build_trainer(str(tmp_path), tiny_gpt2(), [callback, Spike()], max_steps=16)
        trainer.train(resume_from_checkpoint=checkpoint)
        return [incident.onset_step for incident in callback.monitor.incidents]

    assert resumed_onsets() == [14]
    os.remove(saved)
    assert resumed_onsets() == []
