"""One Hugging Face Trainer run of a tiny GPT-2 with TrainmonCallback and the test's own reads.

Shared by the one-process test and the 2-rank DDP worker. 13 samples per epoch (7 per rank on
2 ranks) and gradient accumulation 2 give each epoch a last step of one micro-batch; clipping at
0.05 is active on every step, so gradients before and after clipping differ.
"""

from __future__ import annotations

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from monitor.integrations.hf import TrainmonCallback
from tests.integrations.reads import CONFIG, StepReads

SAMPLES, GRAD_ACC, EPOCHS, MAX_NORM = 13, 2, 2, 0.05


class TokenData(torch.utils.data.Dataset):
    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (SAMPLES, 8), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ReadEachStep(TrainerCallback):
    """The test's reads at the Trainer's own hooks; steps keyed as the Trainer logs them. A step
    whose update the loss scaler skipped without calling the optimizer keeps only its unreduced
    gradients."""

    def __init__(self, reads: StepReads) -> None:
        self.reads = reads
        self.scale = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.reads.before_update(state.global_step + 1)
        scaler = getattr(optimizer, "scaler", None)
        self.scale = scaler.get_scale() if scaler is not None else None

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        scaler, fused = getattr(optimizer, "scaler", None), optimizer.optimizer.defaults.get("fused")
        if scaler is not None and scaler.get_scale() < self.scale and not fused:
            self.reads.update_skipped(state.global_step + 1)
        else:
            self.reads.after_update(state.global_step + 1, optimizer.optimizer)


class LossScaler(TrainerCallback):
    """fp16's loss scaler, which accelerate leaves out on CPU, put where accelerate keeps it on a
    GPU (the accelerator's and its optimizer wrapper's ``scaler``, and the step methods the wrapper
    swaps while the scaler steps): test-only, so that skipped updates can be had on this machine."""

    def __init__(self, init_scale: float) -> None:
        self.init_scale = init_scale
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        from accelerate.optimizer import patch_optimizer_step

        scaler = torch.amp.GradScaler("cpu", init_scale=self.init_scale)
        self.trainer.accelerator.scaler = optimizer.scaler = scaler
        optimizer._optimizer_original_step_method = optimizer.optimizer.step
        optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, optimizer.optimizer.step)
        optimizer._accelerate_step_called = optimizer._is_overflow = False


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def train(
    workdir: str,
    monitor_config: dict | None = None,
    optim: str | None = None,
    init_scale: float | None = None,
    compile_backend: str | None = None,
) -> tuple[StepReads, TrainmonCallback, Trainer]:
    """Train 2 epochs (with ``init_scale``: fp16 with a loss scaler starting there; with
    ``compile_backend``: the Trainer's torch_compile with that backend); returns the test's reads,
    the callback and the trainer."""
    model = tiny_gpt2()
    reads = StepReads(model)
    callback = TrainmonCallback(monitor_config or CONFIG)
    scaler = [LossScaler(init_scale)] if init_scale is not None else []
    options = {"optim": optim} if optim else {}
    if init_scale is not None:
        options["fp16"] = True
    if compile_backend is not None:
        options["torch_compile_backend"] = compile_backend  # which sets torch_compile
    trainer = build_trainer(workdir, model, [*scaler, callback, ReadEachStep(reads)], **options)
    for added in scaler:
        added.trainer = trainer
    trainer.train()
    reads.remove()
    return reads, callback, trainer


def build_trainer(workdir: str, model: torch.nn.Module, callbacks: list, **options) -> Trainer:
    """The Trainer of ``train``: 2 epochs of 13 samples, accumulation 2, clipping, on this rank's
    data; ``options``: more TrainingArguments."""
    options = {"save_strategy": "no", **options}
    args = TrainingArguments(
        output_dir=os.path.join(workdir, "hf"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=GRAD_ACC,
        num_train_epochs=EPOCHS,
        max_grad_norm=MAX_NORM,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
        **options,
    )
    rank = int(os.environ.get("RANK", "0"))
    return Trainer(model=model, args=args, train_dataset=TokenData(seed=rank), callbacks=callbacks)
