"""What every adapter's session shares: starting, stopping and ending steps of collections.

A session is one attached TrainerMon: it owns the step counter and the optimizer's two hooks
(before and after the update) for its whole life, while what is collected under a config lives
in a Collection that can be started, stopped and replaced while the run goes on (``start()``,
``stop()``, live control through ``on_step_end``). How the hooks are attached and what a
Collection is made of differ by framework; the order of what happens around them does not, and
lives here.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from monitor.alerts.bundle import write_bundle
from monitor.alerts.dispatch import Alerts
from monitor.collection import BaseCollection
from monitor.config import MonitorConfig
from monitor.errors import CollectivesLogged, StructurePrinted, TrainingStopped
from monitor.schedule import rank_enabled

logger = logging.getLogger("trainmon")

#: config switches named in the "monitoring ..." line when they are on.
_KINDS = ("wg_distribution", "mv_distribution", "param_distribution", "mg_direction", "xy_distribution")


def model_chunks(model: Any, chunk_type: type, type_name: str) -> list:
    """The model as set_monitor takes it (one module, or a list of pipeline chunks) as a list.

    Raises:
        TypeError: a chunk is not a ``chunk_type`` (called ``type_name`` in the message).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, chunk_type):
            raise TypeError(f"set_monitor: model[{i}]: expected a {type_name}, got {type(chunk).__name__}")
    return chunks


class SessionLifecycle(ABC):
    """Step counter, optimizer hooks and the current Collection of one attached TrainerMon.

    Adapters implement ``_attach_optimizer_hooks``, ``_optimizer_step_count``,
    ``_new_collection`` and ``_detach_after_this_step``, and call ``_attach(dormant)`` at the
    end of their ``__init__``.
    """

    #: what the "monitoring N ..." line counts.
    monitored = "parameters"

    def __init__(
        self, config: MonitorConfig, rank: int, step: int, on_step_end: Callable[[int], None] | None
    ) -> None:
        self.config = config
        self.rank = rank
        self.step = step
        self.on_step_end = on_step_end
        self.collection: BaseCollection | None = None
        self._output_dir: str | None = None
        self._core: Any = None
        self._hooks: list = []
        self._steps_at_stop: int | None = None
        #: sinks, callbacks and actions of new incidents (None while nothing asks for them).
        self.alerts: Alerts | None = None
        self._alerts_config: Any = None
        self.incident_callbacks: list[Callable[[dict], Any]] = []
        #: called as ``fn(step, reason)`` by the ``checkpoint`` action (``on_checkpoint``).
        self.checkpoint_function: Callable[[int, str], Any] | None = None
        #: ids of each micro-batch of the current step (``set_batch_ids``).
        self._step_batch_ids: list[Any] = []

    def _attach(self, dormant: bool) -> None:
        """Hook the optimizer (also when dormant: live control runs at the end of each step) and,
        unless dormant, start collecting; nothing on a rank outside module_ranks."""
        if not rank_enabled(self.config, self.rank):
            logger.info("trainmon: rank %d is not in module_ranks; nothing is monitored here", self.rank)
            return
        self._attach_optimizer_hooks()
        if not dormant:
            self.start(self.config)

    # -- public control ----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.collection is not None

    @property
    def core(self) -> Any:
        """The outputs of the current (or last) collection; None when nothing was ever collected."""
        return self.collection.core if self.collection is not None else self._core

    def start(self, config: MonitorConfig | None = None) -> None:
        """Collect with ``config`` (default: the current one) from the current step on."""
        if not rank_enabled(config or self.config, self.rank):
            return
        self._end_collection()
        self.config = config or self.config
        if not self._hooks:
            self._attach_optimizer_hooks()
        self.collection = self._new_collection()
        self._output_dir = self.collection.core.output_dir
        self._connect_alerts()
        kinds = [k for k in _KINDS if getattr(self.collection.config, k)]  # what this collection can see
        logger.info(
            "trainmon: monitoring %d %s (%s) on rank %d from step %d, output %s",
            len(self.collection.registry),
            self.monitored,
            ", ".join(kinds) or "nothing selected",
            self.rank,
            self.step,
            self.collection.core.output_dir or "in memory (format api)",
        )

    def stop(self) -> None:
        """Remove every hook and close the outputs (idempotent); queued alerts are delivered."""
        self._end_collection()
        if self._hooks:
            self._steps_at_stop = self._optimizer_step_count()
        self._detach_optimizer_hooks()
        self._close_alerts()

    def add_incident_callback(self, callback: Callable[[dict], Any]) -> None:
        """Call ``callback(message)`` for each new incident from now on (on its own thread)."""
        self.incident_callbacks.append(callback)
        if self.alerts is not None:
            self.alerts.add_callback(callback)
        elif self.collection is not None:
            self._connect_alerts()

    def set_batch_ids(self, ids: Any) -> None:
        """The ids of the micro-batch about to run (JSON-ready), for the incidents of this step."""
        self._step_batch_ids.append(ids)

    # -- incidents -----------------------------------------------------------------------------

    def _connect_alerts(self) -> None:
        """Hand the new collection's incidents to the alerts its config and the callbacks ask for."""
        alert = self.config.alert
        wanted = (alert.sinks, alert.actions, alert.bundle)
        if self.alerts is not None and self._alerts_config != wanted:
            self._close_alerts()
        if self.alerts is None and (alert.sinks or alert.actions or alert.bundle or self.incident_callbacks):
            self.alerts = Alerts(
                alert.sinks, alert.actions, self.rank, self.collection.core.root, alert.bundle
            )
            self._alerts_config = wanted
            for callback in self.incident_callbacks:
                self.alerts.add_callback(callback)
        if self.alerts is not None:
            core, alerts = self.collection.core, self.alerts
            core.on_incident(lambda incident: alerts.incident(incident, core.output_dir))

    def _close_alerts(self) -> None:
        if self.alerts is not None:
            self.alerts.close()
            self.alerts = None

    def _respond_to_incidents(self) -> None:
        """At a step end: the evidence bundles of incidents found since, then the actions."""
        if self.alerts is None:
            return
        for incident in self.alerts.take_bundles():
            self._write_bundle(incident)
        self._act_if_asked()

    def _write_bundle(self, incident: dict[str, Any]) -> None:
        """One incident's evidence bundle; a failure is logged and the run goes on."""
        try:
            info, tensors = self._bundle_contents(incident)
            directory = os.path.join(self.core.root, "anomaly_detected", f"rank{self.rank}")
            facts = {"written_at_step": self.step - 1, "config": self.config.to_dict(), **info}
            limit = int(self.config.alert.bundle.max_mb * 2**20)
            path = write_bundle(directory, incident, facts, tensors, limit)
            logger.warning("trainmon: evidence of incident %d kept in %s", incident["id"], path)
        except Exception as exc:
            logger.error("trainmon: writing the evidence of incident %s failed (%r)", incident.get("id"), exc)

    def _bundle_contents(self, incident: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(facts, tensors)`` of a bundle: topology, versions, RNG states and the records'
        tensors (see ``monitor.alerts.bundle.write_bundle``); adapters know their framework's."""
        return {"topology": {"rank": self.rank}}, {}

    def _act_if_asked(self) -> None:
        """The ``checkpoint`` and ``stop`` actions: every rank agrees at each step end whether an
        incident asked for them, so all act at the same step (a checkpoint function may itself
        use collectives). ``checkpoint`` calls the function of ``on_checkpoint`` (its failure is
        logged, the run goes on); ``stop`` then raises TrainingStopped."""
        alerts = self.alerts
        if alerts is None or not {"checkpoint", "stop"} & set(alerts.actions) or self.collection is None:
            return
        if not self._agree_on_stop(alerts.action_requested.is_set()):
            return
        alerts.action_requested.clear()
        reason = alerts.action_reason or "an incident on another rank"
        if "checkpoint" in alerts.actions:
            self._checkpoint(reason)
        if "stop" in alerts.actions:
            logger.error(
                "trainmon: stopping the run at step %d as alert.actions asks (%s)",
                self.step,
                reason.removeprefix("trainmon: "),
            )
            self._stop_as_asked()
            self._close_alerts()
            raise TrainingStopped(self.step, reason)

    def _checkpoint(self, reason: str) -> None:
        if self.checkpoint_function is None:
            logger.warning(
                "trainmon: alert.actions holds checkpoint but no function was given (on_checkpoint)"
            )
            return
        logger.warning(
            "trainmon: calling the checkpoint function at step %d as alert.actions asks", self.step
        )
        try:
            self.checkpoint_function(self.step, reason)
        except Exception as exc:
            logger.error("trainmon: the checkpoint function failed (%r); the run goes on", exc)

    def _agree_on_stop(self, asked_here: bool) -> bool:
        """Whether any rank was asked to act; adapters with several ranks agree through a collective."""
        return asked_here

    # -- what each framework provides --------------------------------------------------------

    @abstractmethod
    def _attach_optimizer_hooks(self) -> None:
        """Register the optimizer's hooks that call ``_before_update`` and ``_after_update``."""

    @abstractmethod
    def _optimizer_step_count(self) -> int | None:
        """The optimizer's own count of updates, None if it keeps none."""

    @abstractmethod
    def _new_collection(self) -> BaseCollection:
        """A Collection of ``self.config`` from ``self.step`` on, writing to ``self._output_dir``."""

    def _detach_optimizer_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @abstractmethod
    def _detach_after_this_step(self) -> None:
        """Monitoring ended inside the optimizer's hooks: see that they go, or stay inert."""

    # -- the optimizer's step ----------------------------------------------------------------

    def _begin_update(self, *collection_args: Any) -> None:
        """Optimizer pre-hook: collect what comes before the update. Our failures are contained;
        only print_struct's StructurePrinted leaves the hook (the user asked the run to stop)."""
        if self.collection is None:
            return
        try:
            self.collection.before_update(*collection_args)
        except StructurePrinted:
            self._stop_as_asked()
            raise
        except Exception as exc:
            self.collection.fail("step start", exc)
        self._skip_if_asked()

    def _skip_if_asked(self) -> None:
        """The ``skip_step`` action: when any rank found a new anomaly in what this step has
        measured so far (gradients, activations, parameters before the update), every rank
        drops the gradients so that the optimizer leaves the weights and moments as they are.
        The step's values are judged at once (the writer is waited for), not in the background."""
        alerts = self.alerts
        if alerts is None or "skip_step" not in alerts.actions or self.collection is None:
            return
        if self._agree_on_stop(self.collection.core.new_anomalies_now()):
            logger.warning("trainmon: skipping the update of step %d as alert.actions asks", self.step)
            self._skip_update()

    def _skip_update(self) -> None:
        """Make the coming optimizer update a no-op; adapters know how for their optimizers."""
        logger.warning("trainmon: skip_step is not supported here; the update runs")

    # -- the end of a step -------------------------------------------------------------------

    def _after_update(self, *hook_args: Any) -> None:
        """Optimizer post-hook: finish the step's collection, count the step, run live control."""
        step_ids, self._step_batch_ids = self._step_batch_ids, []
        try:
            if self.collection is not None:
                try:
                    if step_ids:
                        self.collection.core.submit_batch_ids(self.step, step_ids)
                    self.collection.after_update()
                except Exception as exc:
                    self.collection.fail("step end", exc)
        finally:
            self.step += 1
            if self.collection is not None:
                if self.collection.finished:
                    logger.info(
                        "trainmon: collect_times reached (%d steps); monitoring stopped",
                        self.collection.schedule.collected,
                    )
                    self._end_collection()
                else:
                    try:
                        self.collection.set_step(self.step)
                    except CollectivesLogged:  # cc_log_only: the user asked the run to stop here
                        self._stop_as_asked()
                        raise
            if self.on_step_end is not None:
                try:
                    self.on_step_end(self.step)
                except Exception as exc:  # live control must never stop the training
                    logger.error("trainmon: live control failed (%r); monitoring state unchanged", exc)
            if self.collection is None and self.on_step_end is None:
                self._detach_after_this_step()
        self._respond_to_incidents()

    def _stop_as_asked(self) -> None:
        """print_struct or cc_log_only stops the run inside an optimizer hook: end monitoring."""
        self._end_collection()
        self._detach_after_this_step()

    def _end_collection(self) -> None:
        if self.collection is not None:
            self._core = self.collection.core
            self.collection.remove()
            self.collection = None
