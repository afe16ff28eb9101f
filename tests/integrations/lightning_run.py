"""One Lightning run of a small GPT-like model with TrainmonCallback and the test's own reads.

Shared by the one-process test and the 2-rank DDP worker. 11 batches per epoch and gradient
accumulation 2 (or 1) give each epoch a last step of one micro-batch; clipping at 0.05 is
active on every step. Lightning runs the last micro-batch's forward, backward and clipping
inside ``optimizer.step(closure)``.
"""

from __future__ import annotations

import os

import lightning as L
import torch

from monitor.integrations.lightning import TrainmonCallback
from tests.integrations.reads import CONFIG, StepReads

BATCHES, EPOCHS, MAX_NORM = 11, 2, 0.05


class TinyGPT(L.LightningModule):
    """Embedding, one transformer encoder layer with a causal mask, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 64)
        self.reads: StepReads | None = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(batch.shape[1] - 1)
        logits = self.head(self.block(self.embed(batch[:, :-1]), src_mask=mask, is_causal=True))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
        if not torch.compiler.is_compiling():  # Lightning 2.6's log fails in torch 2.13's tracing
            self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.reads.before_update(self.trainer.global_step)  # the gradient the optimizer will use

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        scale = scaler.get_scale() if scaler is not None else None
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if scaler is not None and scaler.get_scale() < scale:  # the scaler found Inf/NaN: no update
            self.reads.update_skipped(self.trainer.global_step)
        else:
            self.reads.after_update(self.trainer.global_step, optimizer.optimizer)


def train(
    workdir: str,
    grad_acc: int,
    monitor_config: dict | None = None,
    loss_scaling: bool = False,
    streaming: bool = False,
    init_scale: float = 1024.0,
    callbacks: tuple = (),
    callback: TrainmonCallback | None = None,
    compile_backend: str | None = None,
):
    """Train 2 epochs; returns the test's reads, the callback and the trainer. With
    ``loss_scaling``, fp16 mixed precision with a loss scaler: Lightning then runs the closure
    itself and calls ``optimizer.step`` without it (and not at all where the scaler finds Inf/NaN,
    as a large ``init_scale`` makes it in the first steps). With ``streaming`` the batches come
    from an iterable dataset, so the epoch's length is unknown until its last batch.
    ``callbacks``: more of the run's callbacks; ``callback``: the TrainmonCallback to use (a new
    one by default); ``compile_backend``: fit the module compiled with that backend."""
    torch.manual_seed(0)
    module = TinyGPT()
    module.reads = reads = StepReads(module)
    rank = int(os.environ.get("RANK", "0"))
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 64, (BATCHES * 2, 9), generator=generator)
    data = torch.utils.data.DataLoader(_Stream(tokens) if streaming else tokens, batch_size=2)
    callback = callback or TrainmonCallback(monitor_config or CONFIG)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        accumulate_grad_batches=grad_acc,
        gradient_clip_val=MAX_NORM,
        callbacks=[callback, *callbacks],
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        logger=L.pytorch.loggers.CSVLogger(os.path.join(workdir, "logs")),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        plugins=[_loss_scaled_fp16(init_scale)] if loss_scaling else None,
    )
    trainer.fit(torch.compile(module, backend=compile_backend) if compile_backend else module, data)
    reads.remove()
    return reads, callback, trainer


class _Stream(torch.utils.data.IterableDataset):
    """The same rows as an iterable dataset: no ``len``, as a streaming dataset."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def _loss_scaled_fp16(init_scale: float):
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
