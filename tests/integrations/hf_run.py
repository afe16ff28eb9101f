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
    """The test's reads at the Trainer's own hooks; steps keyed as the Trainer logs them."""

    def __init__(self, reads: StepReads) -> None:
        self.reads = reads

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.reads.before_update(state.global_step + 1)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.reads.after_update(state.global_step + 1, optimizer.optimizer)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def train(workdir: str, monitor_config: dict | None = None) -> tuple[StepReads, TrainmonCallback, Trainer]:
    """Train 2 epochs; returns the test's reads, the callback and the trainer."""
    model = tiny_gpt2()
    reads = StepReads(model)
    callback = TrainmonCallback(monitor_config or CONFIG)
    trainer = build_trainer(workdir, model, [callback, ReadEachStep(reads)])
    trainer.train()
    reads.remove()
    return reads, callback, trainer


def build_trainer(workdir: str, model: torch.nn.Module, callbacks: list) -> Trainer:
    """The Trainer of ``train``: 2 epochs of 13 samples, accumulation 2, clipping, on this rank's data."""
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
        save_strategy="no",
        disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
    )
    rank = int(os.environ.get("RANK", "0"))
    return Trainer(model=model, args=args, train_dataset=TokenData(seed=rank), callbacks=callbacks)
