"""What every adapter's session shares: starting, stopping and ending steps of collections.

A session is one attached TrainerMon: it owns the step counter and the optimizer's two hooks
(before and after the update) for its whole life, while what is collected under a config lives
in a Collection that can be started, stopped and replaced while the run goes on (``start()``,
``stop()``, live control through ``on_step_end``). How the hooks are attached and what a
Collection is made of differ by framework; the order of what happens around them does not, and
lives here.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from monitor.alerts.responses import IncidentResponses
from monitor.config.schema import MonitorConfig
from monitor.datatypes.update_ratio import update_ratio_written
from monitor.errors import CollectivesLogged, StructurePrinted
from monitor.session.collection import BaseCollection
from monitor.session.dynamic import ScheduleChannel
from monitor.session.schedule import rank_enabled
from monitor.session.unseen import unseen_updates

logger = logging.getLogger("trainmon")

#: config switches named in the "monitoring ..." line when they are on.
_KINDS = ("wg_distribution", "mv_distribution", "param_distribution", "mg_direction", "xy_distribution")


#: what records a row per monitored parameter
_PER_PARAMETER = (
    "wg_distribution",
    "mv_distribution",
    "param_distribution",
    "mg_direction",
    "ur_distribution",
)


def recorded_kinds(config: MonitorConfig) -> list[str]:
    """The config keys of what a collection with ``config`` records (empty: nothing)."""
    kinds = [k for k in _KINDS if getattr(config, k)]
    kinds += ["ur_distribution"] if update_ratio_written(config) else []
    kinds += ["recording_l2_features"] if config.recording_l2_features else []
    return kinds + (["cc_distribution"] if config.cc_distribution.enable else [])


@dataclasses.dataclass(frozen=True)
class Attachment:
    """What ``TrainerMon.set_monitor`` was given, as every adapter's session takes it."""

    config: MonitorConfig
    model: Any
    optimizer: Any
    grad_acc_steps: int = 1
    process_group: Any = None
    params_have_main_grad: bool | None = None
    tp_group: Any = None
    dp_group: Any = None
    start_iteration: int = 0
    #: dynamic mode: attach the hooks but collect only when the config says so
    dormant: bool = False
    #: called with the new step number at the end of every optimizer step (live control)
    on_step_end: Callable[[int], None] | None = None
    #: torch: the collectives monitor that wrapped torch.distributed when TrainerMon was made
    early_collectives: Any = None
    #: MindSpore: whether the step is compiled (no hooks; None: the context's mode says)
    graph_mode: bool | None = None
    #: torch: the model runs as compiled code though it was passed uncompiled
    compiled: bool = False


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


class SessionLifecycle(IncidentResponses, ABC):
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
        #: stop() removed the optimizer's hooks: nothing counts the steps until start()
        self._stopped_hooks = False
        #: the step and the optimizer's own update count at attach (None: not attached, or said)
        self._seen_from: tuple[int, int | None] | None = None
        self._init_responses()

    def _attach(self, dormant: bool) -> None:
        """Hook the optimizer (also when dormant: live control runs at the end of each step) and,
        unless dormant, start collecting; nothing on a rank outside module_ranks."""
        if not rank_enabled(self.config, self.rank):
            logger.info("trainmon: rank %d is not in module_ranks; nothing is monitored here", self.rank)
            return
        self._attach_optimizer_hooks()
        self._attach_alerts()
        updates = self._optimizer_step_count()
        self._seen_from = (self.step, updates)
        if self.step == 0 and updates:  # a run resumed from a checkpoint, numbered from 0
            logger.warning(
                "trainmon: the optimizer has made %d updates already (restored from a checkpoint?), "
                "and steps are numbered from 0; pass set_monitor(..., start_iteration=%d) to number "
                "them as your run does",
                updates,
                updates,
            )
        if not dormant:
            self.start(self.config)

    def schedule_channel(self) -> ScheduleChannel | None:
        """How rank 0 tells the other ranks which edit dynamic mode follows from which step (None:
        the schedule file next to the config)."""
        return None

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
        if self._core is not None:
            self.collection.core.continue_incidents(self._core)
        self._output_dir = self.collection.core.output_dir
        self._connect_alerts()
        config = self.collection.config
        kinds = recorded_kinds(config)
        if not kinds and not (config.print_struct or config.stack_info or config.dynamic_on):
            histograms_off = config.ur_distribution and not update_ratio_written(config)
            logger.warning(
                "trainmon: nothing to record: the config switches on none of %s, cc_distribution, "
                "ur_distribution or recording_l2_features%s",
                ", ".join(_KINDS),
                f" (ur_distribution is on, but its histograms go to TensorBoard files only, not to "
                f"format {config.format})"
                if histograms_off
                else "",
            )
        per_parameter = [k for k in kinds if k in _PER_PARAMETER]
        if per_parameter and not len(self.collection.registry):
            frozen = getattr(self.collection.registry, "frozen_named", 0)
            logger.log(  # a pipeline stage may well hold none of the targets
                logging.INFO if self.collection.pipeline_stage else logging.WARNING,
                "trainmon: no parameter is selected here (targets: %s), so %s %s nothing%s",
                ", ".join(config.targets) or "none",
                ", ".join(per_parameter),
                "records" if len(per_parameter) == 1 else "record",
                f" (the {frozen} parameter(s) the targets name are frozen: requires_grad is False)"
                if frozen
                else "",
            )
        logger.info(
            "trainmon: recording %s on rank %d from step %d (%d %s selected), output %s",
            ", ".join(kinds) or "nothing",
            self.rank,
            self.collection.schedule.first_wanted,
            len(self.collection.registry),
            self.monitored,
            self.collection.core.output_dir or "in memory (format api)",
        )

    def start_or_go_back(self, config: MonitorConfig, source: str) -> bool:
        """Collect with ``config`` (a live edit from ``source``) from the current step; where its
        collection cannot be built, the one that ran before goes on (in the same run directory,
        its collected steps still counted towards collect_times), or nothing, as before; said
        either way. Whether the new config runs."""
        previous, running = self.config, self.collection
        try:
            self.start(config)
            return True
        except Exception as exc:  # a fault of ours: never the training's end
            self.config = previous
            if running is None:
                logger.error("trainmon: %s: the edit cannot be applied (%r); nothing changed", source, exc)
                return False
            try:
                self.start(previous)
                self.collection.schedule.collected = running.schedule.collected
            except Exception as again:
                logger.error(
                    "trainmon: %s: the edit cannot be applied (%r), and going back to the previous "
                    "config failed too (%r): nothing is collected until the next valid edit",
                    source,
                    exc,
                    again,
                )
                return False
            logger.error(
                "trainmon: %s: the edit cannot be applied (%r); collecting on with the previous config",
                source,
                exc,
            )
            return False

    def resume_step_count(self, step: int | None) -> None:
        """After stop() no hook counts steps: go on from ``step``, else by the optimizer's own count
        of updates since stop()."""
        now = self._optimizer_step_count() if self._steps_at_stop is not None else None
        if step is not None:
            self.step = step
        elif now is not None:
            self.step += now - self._steps_at_stop
        elif self._stopped_hooks:
            logger.warning(
                "trainmon: start(): the optimizer keeps no count of its updates, so the steps since "
                "stop() were not counted and rows go on from step %d; pass start(step=...) to number "
                "them as your loop does",
                self.step,
            )
        self._steps_at_stop, self._stopped_hooks = None, False

    def renumber(self, step: int) -> bool:
        """Number the steps from ``step`` on (a resumed run's saved state says where it was); only
        while no step has ended since the monitor attached. Whether it was done."""
        if self._seen_from is None or self.step != self._seen_from[0]:
            return False
        self.step = step
        self._seen_from = (step, self._seen_from[1])
        if self.collection is not None:
            self.collection.set_step(step, renumbered=True)
        return True

    def end_collection(self) -> None:
        """End the current collection and keep the hooks (dynamic mode: the file says
        ``dynamic_on: false`` now)."""
        self._end_collection()

    def stop(self) -> None:
        """Remove every hook and close the outputs (idempotent); queued alerts are delivered."""
        try:  # what tells why nothing was recorded, read before the collection goes
            passes = self.collection.passes_in_step() if self.collection is not None else 0
            stale = self._monitored_not_the_models() if self.collection is not None and not passes else 0
        except Exception:  # only a message depends on it
            passes = stale = 0
        self._end_collection()
        if self._hooks:
            self._steps_at_stop = self._optimizer_step_count()
            self._stopped_hooks = True
        self._say_unseen_updates(passes, stale)
        self._detach_optimizer_hooks()
        self._close_alerts()

    def _say_unseen_updates(self, passes: int, stale: int) -> None:
        """At stop(): why nothing was recorded, where the run updated or passed backward while
        attached yet no step was counted (``unseen_updates``); said at the first stop() only."""
        if self._seen_from is None or self.step != self._seen_from[0]:
            return
        updates = self._seen_from[1]  # None: unknown (no count before an optimizer's first update)
        self._seen_from = None
        said = unseen_updates(updates, self._optimizer_step_count(), passes, stale)
        if said:
            logger.warning("%s", said)

    def _monitored_not_the_models(self) -> int:
        """How many monitored parameters the model no longer holds (frameworks that can tell)."""
        return 0

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
        if self.collection is not None:
            try:
                self.collection.before_update(*collection_args)
            except StructurePrinted:
                self._stop_as_asked()
                raise
            except Exception as exc:
                self.collection.fail("step start", exc)
        self._skip_if_asked()

    # -- the end of a step -------------------------------------------------------------------

    def update_skipped(self) -> None:
        """The step ended without the optimizer's update (a loss scaler skipped it): written as far
        as it was measured and counted, as the trainer counts it. Nothing while detached."""
        if self._hooks:
            self._after_update(skipped=True)

    def _after_update(self, *hook_args: Any, skipped: bool = False) -> None:
        """Optimizer post-hook (``hook_args`` unused), or the end of a step whose update was
        ``skipped``: finish the step's collection, count the step, run live control."""
        step_ids = self._take_batch_ids()
        try:
            if self.collection is not None:
                try:
                    if step_ids:
                        self.collection.core.submit_batch_ids(self.step, step_ids)
                    if skipped:
                        self.collection.skipped_update()
                    else:
                        self.collection.after_update()
                except StructurePrinted:  # print_struct at a skipped step: the run stops as asked
                    self._stop_as_asked()
                    raise
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
            if self.collection is None and self.on_step_end is None and not self.acting:
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
