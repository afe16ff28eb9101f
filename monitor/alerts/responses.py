"""What a session does about incidents: alerts, batch ids, evidence bundles and the actions.

``IncidentResponses`` is a part of ``monitor.session.lifecycle.SessionLifecycle`` (which inherits it); it
uses the session's ``config``, ``rank``, ``step``, ``collection``, ``core`` and
``_stop_as_asked``. Adapters supply ``_agree_on_stop`` (a collective across ranks),
``_skip_update``, ``_bundle_contents`` and ``_keep_module_inputs``.

Actions are agreed at every optimizer step from attaching until ``stop()``, whether or not the
step is collected and whether or not this rank's collection still runs, so that every rank
calls the collective at the same points: it then pairs with no collective of the training.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import weakref
from collections.abc import Callable
from typing import Any

from monitor.alerts.bundle import write_bundle
from monitor.alerts.dispatch import Alerts
from monitor.errors import TrainingStopped
from monitor.files import output_root

logger = logging.getLogger("trainmon")

#: seconds ``skip_step`` waits for the writer to judge a step before letting the update run.
SKIP_JUDGE_WAIT_S = 30.0


class IncidentResponses:
    """Alerts, batch ids, bundles and actions of one session (mixed into SessionLifecycle)."""

    #: whether this framework's optimizers can be made to skip an update (``skip_step``).
    can_skip_updates = True

    def _init_responses(self) -> None:
        #: sinks, callbacks and actions of new incidents (None while nothing asks for them).
        self.alerts: Alerts | None = None
        self._alerts_config: Any = None
        self.incident_callbacks: list[Callable[[dict], Any]] = []
        #: called as ``fn(step, reason)`` by the ``checkpoint`` action (``on_checkpoint``).
        self.checkpoint_function: Callable[[int, str], Any] | None = None
        #: ids of each micro-batch of the current step (``set_batch_ids``).
        self._step_batch_ids: list[Any] = []
        self._exit_hook_registered = False
        #: (first step, number) of the updates skipped in a row so far
        self._skipped = (0, 0)

    # -- public ---------------------------------------------------------------------------------

    def add_incident_callback(self, callback: Callable[[dict], Any]) -> None:
        """Call ``callback(message)`` for each new incident from now on (on its own thread)."""
        self.incident_callbacks.append(callback)
        if self.alerts is not None:
            self.alerts.add_callback(callback)
        elif self.collection is not None:
            self._connect_alerts()

    def set_batch_ids(self, ids: Any) -> None:
        """The ids of the micro-batch about to run (JSON-ready), for the incidents of this step;
        dropped on steps that are not collected (no incident can begin there)."""
        if self.collection is not None and self.collection.collect:
            self._step_batch_ids.append(ids)

    @property
    def acting(self) -> bool:
        """Whether actions are agreed across ranks at every step (the hooks then stay)."""
        return self.alerts is not None and bool(self.alerts.actions)

    # -- wiring -------------------------------------------------------------------------------

    def _ensure_alerts(self, root: str) -> None:
        """The Alerts of the current config (replaced when its alert part changed)."""
        alert = self.config.alert
        wanted = (alert.sinks, alert.actions, alert.bundle)
        if self.alerts is not None and self._alerts_config != wanted:
            self._close_alerts(block=False)  # training goes on: the old sinks drain on their own
        if self.alerts is None and (alert.sinks or alert.actions or alert.bundle or self.incident_callbacks):
            world = getattr(self, "world_size", 0)
            self.alerts = Alerts(alert.sinks, alert.actions, self.rank, root, alert.bundle, world)
            self._alerts_config = wanted
            for callback in self.incident_callbacks:
                self.alerts.add_callback(callback)
            if "skip_step" in alert.actions and not self.can_skip_updates:
                logger.warning("trainmon: alert.actions skip_step is not supported here and is ignored")
            elif "skip_step" in alert.actions and self.config.step_interval > 1:
                logger.warning(
                    "trainmon: alert.actions skip_step acts on collected steps: with step_interval %d "
                    "a NaN gradient of another step reaches the weights",
                    self.config.step_interval,
                )
            self._register_exit_hook()

    def _connect_alerts(self) -> None:
        """Hand the new collection's incidents to the alerts its config and the callbacks ask for."""
        core = self.collection.core
        self._ensure_alerts(core.root)
        if self.alerts is not None:
            alerts = self.alerts
            core.on_incident(lambda incident: alerts.incident(incident, core.output_dir))
        self._keep_module_inputs(self._input_budget())

    def _attach_alerts(self) -> None:
        """At attaching (also dormant): the actions must be agreed from the first step on."""
        if self.config.alert.actions:
            self._ensure_alerts(output_root())

    def _register_exit_hook(self) -> None:
        """At interpreter exit, before the writer's own exit handler (registered earlier, so run
        later): drain the writer so that the last incidents reach the alerts, then deliver them."""
        if self._exit_hook_registered:
            return
        self._exit_hook_registered = True
        session = weakref.ref(self)

        def at_exit() -> None:
            alive = session()
            if alive is not None:
                alive._deliver_before_exit()

        atexit.register(at_exit)

    def _deliver_before_exit(self) -> None:
        try:
            if self.collection is not None:
                self.collection.core.flush(SKIP_JUDGE_WAIT_S)
            self._close_alerts()
        except Exception as exc:
            logger.error("trainmon: delivering the last alerts at exit failed (%r)", exc)

    def _close_alerts(self, block: bool = True) -> None:
        if self.alerts is not None:
            self.alerts.close(block)
            self.alerts = None

    def _take_batch_ids(self) -> list[Any]:
        step_ids, self._step_batch_ids = self._step_batch_ids, []
        return step_ids

    # -- before the update: skip_step ----------------------------------------------------------

    def _skip_if_asked(self) -> None:
        """The ``skip_step`` action: when any rank finds an abnormal value in what this step has
        measured so far (gradients, activations, parameters before the update), every rank drops
        the gradients so that the optimizer leaves the weights and moments as they are. The
        step's values are judged at once (the writer is waited for, at most SKIP_JUDGE_WAIT_S)."""
        alerts = self.alerts
        if alerts is None or "skip_step" not in alerts.actions or not self.can_skip_updates:
            return
        abnormal = False
        if self.collection is not None and self.collection.collect:
            abnormal = self.collection.core.abnormal_now(SKIP_JUDGE_WAIT_S)
        skip = self._agree_on_stop(abnormal)
        self._say_skipped(skip)
        if skip:
            self._skip_update()

    def _say_skipped(self, skip: bool) -> None:
        """A run of skipped updates is said when it begins, as it goes on (at 10, 100, ... in a
        row) and when updates run again, not at every step (a NaN that stays skips them all)."""
        first, count = self._skipped
        if skip:
            first, count = (first, count + 1) if count else (self.step, 1)
            if count == 1:
                logger.warning("trainmon: skipping the update of step %d as alert.actions asks", self.step)
            elif math.log10(count).is_integer():
                logger.warning(
                    "trainmon: skipping updates as alert.actions asks: %d in a row since step %d",
                    count,
                    first,
                )
        elif count:
            if count > 1:
                logger.warning(
                    "trainmon: updates run again at step %d, after %d skipped in a row since step %d",
                    self.step,
                    count,
                    first,
                )
            first, count = 0, 0
        self._skipped = (first, count)

    def _skip_update(self) -> None:
        """Make the coming optimizer update a no-op; adapters know how for their optimizers."""
        logger.warning("trainmon: skip_step is not supported here; the update runs")

    # -- after the update: bundles, checkpoint, stop --------------------------------------------

    def _respond_to_incidents(self) -> None:
        """At a step end: the evidence bundles of incidents found since, then the actions. While
        bundles are wanted, the step's records are judged first (the writer is waited for), so
        that a bundle holds the tensors of the step where its incident began."""
        if self.alerts is None:
            return
        wait = self.alerts.bundles_wanted and self.collection is not None
        if wait and not self.collection.core.flush(SKIP_JUDGE_WAIT_S):
            logger.warning(
                "trainmon: the writer did not judge step %d within %.0f s; an incident found there "
                "gets its evidence bundle at a later step",
                self.step - 1,
                SKIP_JUDGE_WAIT_S,
            )
        try:
            for incident in self.alerts.take_bundles():
                self._write_bundle(incident)
        finally:
            self._keep_module_inputs(self._input_budget())
        self._act_if_asked()

    def _input_budget(self) -> int:
        """Bytes of module inputs a step keeps for a bundle: its size limit while bundles are
        wanted, else none."""
        bundle = self.config.alert.bundle
        wanted = self.alerts is not None and self.alerts.bundles_wanted and bundle is not None
        return int(bundle.max_mb * 2**20) if wanted else 0

    def _keep_module_inputs(self, budget: int) -> None:
        """Drop the module inputs kept for the step that ended; keep those of the coming steps'
        monitored modules within ``budget`` bytes (0: none). Adapters that can hold module
        inputs do; by default none are kept."""

    def _write_bundle(self, incident: dict[str, Any]) -> None:
        """One incident's evidence bundle; a failure is logged and the run goes on."""
        try:
            limit = int(self.config.alert.bundle.max_mb * 2**20)
            info, tensors = self._bundle_contents(incident, limit)
            root = self.core.root if self.core is not None else output_root()
            directory = os.path.join(root, "anomaly_detected", f"rank{self.rank}")
            config = self.config.to_dict(for_outputs=True)
            facts = {"written_at_step": self.step - 1, "config": config, **info}
            path = write_bundle(directory, incident, facts, tensors, limit)
            logger.warning("trainmon: evidence of incident %d kept in %s", incident["id"], path)
        except Exception as exc:
            logger.error("trainmon: writing the evidence of incident %s failed (%r)", incident.get("id"), exc)

    def _bundle_contents(
        self, incident: dict[str, Any], budget: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(facts, tensors)`` of a bundle: topology, versions, RNG states and the records'
        tensors, copied within ``budget`` bytes (see ``monitor.alerts.bundle.write_bundle``);
        adapters know their framework's."""
        return {"topology": {"rank": self.rank}}, {}

    def _act_if_asked(self) -> None:
        """The ``checkpoint`` and ``stop`` actions: every rank agrees at each step end whether an
        incident asked for them, so all act at the same step (a checkpoint function may itself
        use collectives). ``checkpoint`` calls the function of ``on_checkpoint`` (its failure is
        logged, the run goes on); ``stop`` then raises TrainingStopped."""
        alerts = self.alerts
        if alerts is None or not {"checkpoint", "stop"} & set(alerts.actions):
            return
        if not self._agree_on_stop(alerts.action_requested.is_set()):
            return
        alerts.action_requested.clear()
        reason = alerts.action_reason or "an incident on another rank (its log and incidents.json name it)"
        reason = reason.removeprefix("trainmon: ")
        if "checkpoint" in alerts.actions:
            self._checkpoint(reason)
        if "stop" in alerts.actions:
            logger.error(
                "trainmon: stopping the run at step %d as alert.actions asks (%s)",
                self.step,
                reason,
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
            then = (
                "the run stops as alert.actions asks" if "stop" in self.alerts.actions else "the run goes on"
            )
            logger.error("trainmon: the checkpoint function failed (%r); %s", exc, then)

    def _agree_on_stop(self, asked_here: bool) -> bool:
        """Whether any rank was asked to act; adapters with several ranks agree through a collective."""
        return asked_here
