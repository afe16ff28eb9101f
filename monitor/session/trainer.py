"""TrainerMon: the one object users attach. Framework-free; the adapter is picked at set_monitor.

``from monitor import TrainerMon`` never imports torch or mindspore: the adapter for the model's
framework is imported lazily when ``set_monitor`` sees the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from monitor.config.schema import MonitorConfig, load_config
from monitor.session.attach_arguments import (
    check_compilation,
    check_counts,
    framework_of,
    msprobe_argument_order,
)
from monitor.session.dynamic import DynamicControl, dynamic_mode
from monitor.session.old_names import MsprobeOldNames
from monitor.session.resume import restore_step

logger = logging.getLogger("trainmon")
#: ``{tag: {op: value}}`` of one data type, as the accessors return it
Metrics = dict[str, dict[str, float]]


class TrainerMon(MsprobeOldNames):
    """Training-state monitor with msprobe's TrainerMon interface.

    Args:
        config_file_path: JSON or YAML config file (msprobe's keys), or a dict / MonitorConfig.
        process_group: the pipeline-parallel group, used for anomaly records (pp_stage, group_mates).
        params_have_main_grad: where gradients are read: True ``main_grad``, False ``.grad``, None
            (default) per parameter, ``main_grad`` where it exists, else ``.grad``.
        opt_ty: accepted for source compatibility with older msprobe versions and ignored.

    Raises:
        ConfigError: the config cannot be read or a value is invalid.
    """

    def __init__(
        self,
        config_file_path: str | os.PathLike | Mapping[str, Any] | MonitorConfig,
        process_group: Any = None,
        params_have_main_grad: bool | None = None,
        opt_ty: Any = None,
    ) -> None:
        self.config: MonitorConfig = load_config(config_file_path)
        self.config_file_path = config_file_path if isinstance(config_file_path, (str, os.PathLike)) else None
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self._wrapped_optimizer: Any = None
        self._session: Any = None
        #: whether set_monitor was given start_iteration (a loaded state's step then renumbers nothing)
        self._numbered = False
        #: stop() was called since the last attach or start(): set_monitor may attach again
        self._stopped = False
        self._dynamic: DynamicControl | None = None
        self._dynamic_running = False
        self._incident_callbacks: list[Callable[[dict], Any]] = []
        self._checkpoint_function: Callable[[int, str], Any] | None = None
        if dynamic_mode():
            if self.config_file_path is None:
                logger.warning("trainmon: DYNAMIC_MONITOR needs a config file to watch; using static mode")
            else:
                self._dynamic = DynamicControl(self.config_file_path)
        self._early_collectives = self._wrap_collectives_early()

    def _wrap_collectives_early(self) -> Any:
        """With cc_distribution on, wrap torch.distributed now, before libraries cache its functions.

        Only when torch is already imported by the application (never imported from here).
        """
        if not self.config.cc_distribution.enable or "torch" not in sys.modules:
            return None
        from adapters.torch.collectives import CollectiveMonitor

        collectives = CollectiveMonitor(self.config)
        collectives.install()
        return collectives

    # -- attaching ---------------------------------------------------------------------------

    def set_monitor(
        self,
        model: Any,
        grad_acc_steps: Any = 1,
        optimizer: Any = None,
        tp_group: Any = None,
        dp_group: Any = None,
        start_iteration: int | None = None,
        *,
        graph_mode: bool | None = None,
        compiled: bool = False,
    ) -> TrainerMon:
        """Attach to a model (or a list of virtual-pipeline chunks) and its optimizer.

        Both argument orders of msprobe are accepted: ``(model, grad_acc_steps, optimizer)`` (1.2.2)
        and ``(model, optimizer, grad_acc_steps)`` (later versions). MindSpore only:
        ``graph_mode=True`` for a training step compiled with ``mindspore.jit`` in PyNative mode,
        where no hook runs: nothing is hooked, and the loop calls ``step_end()`` after each step,
        as in ``GRAPH_MODE`` (the default: the context's mode; without it, the hooks leave such a
        step alone, record nothing in it, and say so).
        PyTorch only: ``compiled=True`` for a model passed uncompiled that runs as compiled code
        (``torch.compile`` of it, or of its ``forward``, made elsewhere, as the Hugging Face Trainer
        and Lightning do), so that the first step measured inside it runs eagerly too.

        Raises:
            ValueError / TypeError: a bad argument (named in the message).
        """
        grad_acc_steps, optimizer = msprobe_argument_order(grad_acc_steps, optimizer)
        self._numbered = start_iteration is not None
        start_iteration = 0 if start_iteration is None else start_iteration
        check_counts(grad_acc_steps, start_iteration)
        if self._session is not None and not self._stopped:
            raise RuntimeError("set_monitor: this TrainerMon is already attached; call stop() first")
        framework = framework_of(model)
        check_compilation(framework, graph_mode, compiled)
        if framework == "torch":
            from adapters.torch.session import TorchSession as Session
        else:
            from adapters.mindspore.session import MindSporeSession as Session
        from monitor.session.lifecycle import Attachment  # the sessions' machinery loads when attaching

        dynamic = self._dynamic is not None
        if self._session is not None and dynamic:  # attached again after stop(): a fresh watch
            self._dynamic = DynamicControl(self._dynamic.path)
        self._session = Session(
            Attachment(
                config=self.config,
                model=model,
                optimizer=optimizer if optimizer is not None else self._wrapped_optimizer,
                grad_acc_steps=grad_acc_steps,
                process_group=self.process_group,
                params_have_main_grad=self.params_have_main_grad,
                tp_group=tp_group,
                dp_group=dp_group,
                start_iteration=start_iteration,
                dormant=dynamic,
                on_step_end=self._poll_dynamic if dynamic else None,
                early_collectives=self._early_collectives,
                graph_mode=graph_mode,
                compiled=compiled,
            )
        )
        self._stopped = False
        for callback in self._incident_callbacks:
            self._session.add_incident_callback(callback)
        self._session.checkpoint_function = self._checkpoint_function
        if self._dynamic is not None:
            world_size = getattr(self._session, "world_size", 1)
            started = self._dynamic.attach(self._session.rank, world_size, self._session.schedule_channel())
            self._follow_dynamic(started, self._session.step)
        return self

    def on_incident(self, callback: Callable[[dict], Any]) -> TrainerMon:
        """Call ``callback(message)`` for each new incident of this rank.

        ``message`` is the JSON-ready dict the alert sinks receive (step, rank, tag, op, rule,
        value, summary, ...). The callback runs on its own thread, never the training thread; an
        exception it raises is logged once and the run goes on. Call before or after set_monitor.
        """
        if not callable(callback):
            raise TypeError(f"on_incident: callback: expected a callable, got {type(callback).__name__}")
        self._incident_callbacks.append(callback)
        if self._session is not None:
            self._session.add_incident_callback(callback)
        return self

    def on_checkpoint(self, function: Callable[[int, str], Any]) -> TrainerMon:
        """The function the ``checkpoint`` action calls as ``function(step, reason)``: on the
        training thread, at the end of an optimizer step, on every rank at the same step (so it
        may save a sharded checkpoint with collectives), before ``stop`` if that is configured
        too. Its exception is logged and the run goes on. Call before or after set_monitor."""
        if not callable(function):
            raise TypeError(f"on_checkpoint: function: expected a callable, got {type(function).__name__}")
        self._checkpoint_function = function
        if self._session is not None:
            self._session.checkpoint_function = function
        return self

    def set_batch_ids(self, ids: Any) -> None:
        """Name the micro-batch about to run: sample indices, shard and offset, any JSON-ready value
        (a tensor or array of indices is turned into a list: pass the indices the data loader
        gives, on the CPU, since reading a tensor on an accelerator makes the host wait for it).
        Call once per micro-batch, before its forward; incidents, their alert messages and
        ``skip_batches.json`` name the micro-batches where they began.

        Raises:
            TypeError: ``ids`` cannot be written as JSON.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        try:
            ids = json.loads(json.dumps(ids, allow_nan=False))  # a copy the caller cannot change
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"set_batch_ids: ids: expected JSON-ready values (lists, numbers, strings), "
                f"got {type(ids).__name__} ({exc})"
            ) from None
        if self._session is not None:
            self._session.set_batch_ids(ids)

    def set_last_micro_batch(self, last: bool) -> None:
        """Say, before a micro-batch's backward, whether it ends its step, where the monitor cannot
        see it: a loop that may end a step early (an epoch's shorter last step) and changes gradients
        before ``optimizer.step`` (clipping) or runs the last backward outside it (Lightning with a
        loss scaler). Elsewhere micro-batches are counted and this is not needed. PyTorch only."""
        if not isinstance(last, bool):
            raise TypeError(f"set_last_micro_batch: last: expected true or false, got {last!r}")
        told = getattr(self._session, "set_last_micro_batch", None)
        if told is not None:
            told(last)

    def micro_batch_begins(self) -> None:
        """Say that a micro-batch's forward begins, where the model given to set_monitor is not
        called once per micro-batch (Lightning's training_step calling submodules; the Lightning
        callback does this): activation rows then take their micro-step from these calls. PyTorch only."""
        begins = getattr(self._session, "micro_batch_begins", None)
        if begins is not None:
            begins()

    def update_skipped(self) -> None:
        """This step ended without ``optimizer.step`` (a loss scaler found Inf/NaN and skipped the
        update): the monitor's step numbers keep pace with the loop's, what the step measured is
        written, and its gradients' Inf/NaN is left to the scaler, not judged by the rules."""
        if self._session is not None:
            self._session.update_skipped()

    # -- live control ------------------------------------------------------------------------

    def _poll_dynamic(self, step: int) -> None:
        """Dynamic mode, once per step: (re)start on an edit with dynamic_on, write back when done."""
        self._follow_dynamic(self._dynamic.poll(step), step)

    def _follow_dynamic(self, config: MonitorConfig | None, step: int) -> None:
        if config is not None and config.dynamic_on:
            first = max(step, config.start_step)  # the first step the new collection may take
            config = dataclasses.replace(config, start_step=first)  # step_interval counts from it
            logger.info("trainmon: config %s updated; collecting from step %d", self.config_file_path, first)
            if self._session.start_or_go_back(config, f"config {self.config_file_path}"):
                self.config = config
                self._dynamic_running = True
        elif config is not None and self._session.active:  # dynamic_on: false, written in by hand
            logger.info(
                "trainmon: config %s says dynamic_on: false; collecting ended at step %d",
                self.config_file_path,
                step,
            )
            self._session.end_collection()
            self._dynamic_running = False
        elif self._dynamic_running and not self._session.active:
            self._dynamic_running = False
            self._dynamic.finish()

    def start(self, step: int | None = None) -> None:
        """Start (or restart) collecting from the next step, with the current config.

        For training loops that switch monitoring on themselves, e.g. when the loss jumps. After
        ``stop()`` no hook sees the optimizer, so the step counter continues from the optimizer's
        own count of updates (Adam-like optimizers keep one) or from ``step`` when given.

        Raises:
            RuntimeError: set_monitor was not called.
        """
        if self._session is None:
            raise RuntimeError("start: call set_monitor first")
        self._stopped = False
        if not self._session.active:
            self._session.resume_step_count(step)
            self._session.start(self.config)

    def step_end(self) -> None:
        """MindSpore graph mode: call after each training step, as a compiled step runs no hook
        (``monitor.integrations.mindspore`` calls it for ``Model.train``). Parameters and Adam's
        moments are then read from the host. Elsewhere the optimizer's hooks mark the steps and
        this does nothing."""
        step_end = getattr(self._session, "step_end", None)
        if step_end is not None:
            step_end()

    def _restart_with(self, **changes: Any) -> None:
        """Validate a changed config and, when monitoring, continue with it from the current step."""
        self.config = load_config({**self.config.to_dict(), **changes})
        if self._session is not None and self._session.active:
            self._session.start(self.config)

    @property
    def ops(self) -> list[str]:
        """The statistics computed; setting it is validated like the config key ``ops``."""
        return list(self.config.ops)

    @ops.setter
    def ops(self, value: list[str]) -> None:
        self._restart_with(ops=value)

    # -- reading -----------------------------------------------------------------------------

    @property
    def _core(self) -> Any:
        """The session's MonitorCore; None before set_monitor and on ranks outside module_ranks."""
        return self._session.core if self._session is not None else None

    def _latest(self, prefix: str) -> Metrics:
        return self._core.latest.latest(prefix) if self._core is not None else {}

    def generate_wgrad_metrics(
        self, *_: Any
    ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """``(reduced, unreduced)`` weight-gradient statistics of the last collected step, each
        ``{tag: {op: float}}`` with plain Python floats (msprobe returns 0-dim tensors)."""
        return self._latest("grad_reduced"), self._latest("grad_unreduced")

    def generate_mv_metrics(self, *_: Any) -> Metrics:
        """exp_avg and exp_avg_sq statistics of the last collected step, ``{tag: {op: float}}``."""
        return {**self._latest("exp_avg"), **self._latest("exp_avg_sq")}

    def generate_param_metrics(self, *_: Any) -> Metrics:
        """param_origin and param_updated statistics of the last collected step."""
        return {**self._latest("param_origin"), **self._latest("param_updated")}

    @property
    def anomalies(self) -> list:
        """Anomaly records so far, one per tag when it turns abnormal (after the writer has
        processed them; see ``flush``)."""
        return list(self._core.anomalies) if self._core is not None else []

    @property
    def incidents(self) -> list:
        """Incidents so far: anomalies that started together, each with its onset, root and
        evidence (``monitor.anomaly.incidents.Incident``); after ``flush`` for the latest."""
        return self._core.incidents if self._core is not None else []

    @property
    def output_dir(self) -> str | None:
        """This rank's output directory (None for format api or before set_monitor)."""
        return self._core.output_dir if self._core is not None else None

    @property
    def monitoring(self) -> bool:
        return self._session is not None and self._session.active

    @property
    def step(self) -> int:
        """The optimizer-step counter (the step the next optimizer.step() will be)."""
        return self._session.step if self._session is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """Saveable monitor state: the step counter and the anomaly detector's baselines.

        Plain Python data (fine for ``torch.save`` and JSON), so a resumed job keeps its baselines.
        """
        detector = self._core.detector if self._core is not None else None
        if detector is not None:
            self._core.flush()  # the detector runs on the writer thread: let it catch up first
        return {
            "step": self._session.step if self._session is not None else 0,
            "detector": detector.state_dict() if detector is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() saved (call after set_monitor, before training resumes): the
        detector's baselines, and the step counter where set_monitor was given no
        ``start_iteration`` (``monitor.session.resume``).

        Raises:
            ValueError: the state was saved with other anomaly rules, or is malformed.
        """
        detector = self._core.detector if self._core is not None else None
        if detector is not None and state.get("detector") is not None:
            self._core.flush()
            detector.load_state_dict(state["detector"])
        if self._session is not None:
            restore_step(self._session, state.get("step"), self._numbered)

    def flush(self) -> None:
        """Wait until every collected step so far is written."""
        if self._core is not None:
            self._core.flush()

    def stop(self) -> None:
        """Remove every hook and close the outputs; model and optimizer behave as before attaching."""
        if self._session is not None:
            self._session.stop()
            self._stopped = True
        self._dynamic_running = False
        if self._early_collectives is not None:
            self._early_collectives.remove()
            self._early_collectives = None  # a later attach wraps the collectives anew
