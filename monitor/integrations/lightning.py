"""TrainmonCallback for PyTorch Lightning (the ``lightning`` package, or ``pytorch_lightning``).

    from monitor.integrations.lightning import TrainmonCallback
    trainer = L.Trainer(callbacks=[TrainmonCallback("monitor_config.json")], ...)

At ``on_train_start`` the callback attaches to the LightningModule and the trainer's optimizer
with ``accumulate_grad_batches``; at ``on_train_end`` it closes the outputs. Lightning runs the
last micro-batch's forward, backward and gradient clipping inside ``optimizer.step(closure)``;
the monitor collects the step when that closure returns, so gradients are those the optimizer
uses (and the unreduced ones those before clipping). One optimizer is monitored: the first.

Step numbers: the monitor's step ``s`` is the update made when ``trainer.global_step`` was ``s``,
the number Lightning logs with the metrics that ``training_step`` logs for that update. A step
whose update the loss scaler skipped (fp16 overflow) is counted by Lightning, and so by the monitor.

Checkpoints: the anomaly rules' history is kept in Lightning's checkpoints as this callback's
state and read back by a run resumed from one (``fit(ckpt_path=...)``), so that its first steps
are judged against the history instead of starting a new warm-up. Lightning writes the callback
state of one process: with several ranks only that rank's history is kept, and the others start
theirs anew (said at the resume).
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from monitor.integrations import MonitorCallback

logger = logging.getLogger("trainmon")


class TrainmonCallback(MonitorCallback, Callback):
    """Attach trainmon to a Lightning run: ``TrainmonCallback(config, **trainer_mon_kwargs)`` (see
    ``MonitorCallback``); ``callback.monitor`` is the TrainerMon."""

    for_trainer = "Lightning"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            logger.warning(
                "trainmon: the run has %d optimizers; only the first is monitored", len(optimizers)
            )
        #: several optimizers step under one global step count (manual optimization): the
        #: monitor's steps cannot be matched to it, so skipped updates are not caught up
        self._one_optimizer = len(optimizers) == 1
        self.attach(
            "Lightning",
            model=pl_module,
            grad_acc_steps=trainer.accumulate_grad_batches,
            optimizer=optimizers[0] if optimizers else None,
            start_iteration=trainer.global_step,
            # fit(torch.compile(module)): Lightning unwraps the module and compiles its methods
            compiled=getattr(pl_module, "_compiler_ctx", None) is not None,
        )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Whether this micro-batch ends its step: the monitor cannot see it where a precision
        plugin (a loss scaler) runs the closure itself, before ``optimizer.step``, and an epoch's
        last step is shorter. Lightning ends a step every ``accumulate_grad_batches`` batches and
        at the epoch's last batch, which its data fetcher knows one batch ahead (``is_last_batch``,
        set before this hook runs) even where the epoch's length is not known (an iterable
        dataset); the batch index counts where the loop's progress cannot be read."""
        if self.attached:
            self.monitor.set_last_micro_batch(_ends_step(trainer, batch_idx))
            self.monitor.micro_batch_begins()  # training_step may never call the module itself

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if self._one_optimizer:
            self.keep_pace(trainer.global_step)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A failed fit: the hooks go and the outputs are closed, as at its end."""
        self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.detach()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """This process's rank, known before a checkpoint's states are restored."""
        self._global_rank = trainer.global_rank

    def state_dict(self) -> dict[str, Any]:
        saved = self.checkpoint_state()
        return {} if saved is None else {"ranks": {str(self._rank()): saved}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kept, rank = state_dict.get("ranks") or {}, self._rank()
        if str(rank) in kept:
            self.restore_state(kept[str(rank)], "the Lightning checkpoint")
        elif kept:
            logger.info(
                "trainmon: the checkpoint keeps the anomaly rules' history of rank %s only (Lightning "
                "saves the callback state of one process); rank %d starts its history anew",
                ", ".join(sorted(kept)),
                rank,
            )

    def _rank(self) -> int:
        return getattr(self, "_global_rank", 0)


def _ends_step(trainer: Any, batch_idx: int) -> bool:
    """Lightning's own rule for the optimizer step after this batch, from the epoch loop's progress."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    progress = getattr(epoch_loop, "batch_progress", None)
    ready = getattr(getattr(progress, "current", None), "ready", None)
    ready = batch_idx + 1 if not isinstance(ready, int) else ready
    total = trainer.num_training_batches
    return (
        ready % trainer.accumulate_grad_batches == 0
        or (isinstance(total, int) and ready >= total)
        or getattr(progress, "is_last_batch", False) is True
    )
