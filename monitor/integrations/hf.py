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
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from monitor.integrations import MonitorCallback


class TrainmonCallback(MonitorCallback, TrainerCallback):
    """Attach trainmon to a Hugging Face Trainer run: ``TrainmonCallback(config,
    **trainer_mon_kwargs)`` (see ``MonitorCallback``); ``callback.monitor`` is the TrainerMon."""

    for_trainer = "the Hugging Face Trainer"

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
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
