"""TrainmonCallback for the Hugging Face Trainer (transformers, on accelerate).

    from monitor.integrations.hf import TrainmonCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[TrainmonCallback("monitor_config.json")])

At ``on_train_begin`` the callback attaches to the Trainer's model and its optimizer (accelerate's
``AcceleratedOptimizer``, whose ``GradientState`` tells which micro-batch ends a step, also the
shorter last step of an epoch) with ``gradient_accumulation_steps``; at ``on_train_end`` it
closes the outputs. A ``train()`` that raised is never told to the callbacks: its session is
closed when the next ``train()`` begins.

Step numbers: the Trainer logs the loss of an update under ``global_step`` after that update
(the first update is logged as step 1), so the monitor's steps are numbered the same way: the
statistics of the update the Trainer logs as step ``s`` are written as step ``s``. A step whose
update the loss scaler skipped (fp16 overflow) is counted by the Trainer, and so by the monitor.

With ``torch_compile`` the Trainer runs the model compiled but hands the callbacks the model it
compiled: the callback says so to ``set_monitor``, so that the steps whose activations are
measured run eagerly from the first one.

Checkpoints: each rank keeps the anomaly rules' history in every checkpoint directory the Trainer
saves (``trainmon_state_rank{R}.json``), and a run resumed from one reads it back, so that its
first steps are judged against the history instead of starting a new warm-up. The resumed
checkpoint is found as the Trainer finds it in ``output_dir`` (``checkpoint-<step>``) or at
``args.resume_from_checkpoint``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from transformers import TrainerCallback

from monitor.files import atomic_write_text
from monitor.integrations import MonitorCallback

logger = logging.getLogger("trainmon")

#: the monitor's state in a checkpoint directory, one file per rank (each has its own history)
STATE_FILE = "trainmon_state_rank{rank}.json"


class TrainmonCallback(MonitorCallback, TrainerCallback):
    """Attach trainmon to a Hugging Face Trainer run: ``TrainmonCallback(config,
    **trainer_mon_kwargs)`` (see ``MonitorCallback``); ``callback.monitor`` is the TrainerMon."""

    for_trainer = "the Hugging Face Trainer"

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step > 0:  # resumed from a checkpoint
            self._read_state(args, state.global_step)
        self.attach(
            "Hugging Face Trainer",
            model=kwargs.get("model"),
            grad_acc_steps=args.gradient_accumulation_steps,
            optimizer=kwargs.get("optimizer"),
            start_iteration=state.global_step + 1,
            compiled=bool(getattr(args, "torch_compile", False)),  # accelerate compiles the model it is given
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.keep_pace(state.global_step + 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.detach()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        saved = self.checkpoint_state()
        if saved is None:
            return
        path = _state_path(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), args)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write_text(path, json.dumps({"global_step": state.global_step, **saved}))
        except (OSError, TypeError, ValueError) as exc:
            logger.error("trainmon: the monitor's state was not saved with the checkpoint (%r)", exc)

    def _read_state(self, args: Any, step: int) -> None:
        """The state kept in the checkpoint the run resumes from (saved at ``step``), if trainmon
        kept one there; where none is found, the places looked at are said."""
        named = getattr(args, "resume_from_checkpoint", None)
        candidates = [named] if isinstance(named, str) else []
        candidates.append(os.path.join(args.output_dir, f"checkpoint-{step}"))
        paths = [_state_path(directory, args) for directory in candidates]
        for path in paths:
            if not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8") as handle:
                    saved = json.load(handle)
            except (OSError, ValueError) as exc:
                logger.error(
                    "trainmon: cannot read %s (%r); the anomaly rules start their history anew", path, exc
                )
                return
            if isinstance(saved, dict) and saved.get("global_step") == step:
                self.restore_state(saved, path)
                return
        logger.warning(  # a fault in the new warm-up's steps goes unjudged: worth a warning
            "trainmon: the run resumes at step %d and no state of the monitor saved at that step is at "
            "%s: the anomaly rules start their history anew (a checkpoint outside output_dir: set "
            "args.resume_from_checkpoint to it)",
            step,
            " or ".join(paths),
        )


def _state_path(checkpoint: str, args: Any) -> str:
    """This rank's state file in a checkpoint directory."""
    return os.path.join(checkpoint, STATE_FILE.format(rank=args.process_index))
