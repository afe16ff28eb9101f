"""Thin callbacks that attach a TrainerMon from inside a trainer: Hugging Face, Lightning and
MindSpore's ``Model.train``.

``monitor.integrations.hf``, ``.lightning`` and ``.mindspore`` are the only modules of
``monitor`` that import a trainer package (transformers, lightning, mindspore.train), and only
when the user imports them; ``import monitor`` never does. Each is a few lines over TrainerMon: the trainer
knows the model, the optimizer, the number of micro-batches per step and its own step counter,
so the user does not have to pass them.

A trainer run again with the same callback on the same model and optimizer (MindSpore's
``Model.train`` per epoch) goes on in the first run's directory, from the trainer's step count;
another model or optimizer, or a run that starts again from an earlier step, gets a run of its
own: so does a second Lightning ``fit`` (``configure_optimizers`` builds a new optimizer) and a
second Hugging Face ``train()`` (it counts from step 1 again).

Nothing these callbacks do may end the user's run from inside the trainer: a failure to attach
is logged with its cause and the run goes on unmonitored. A bad config still fails at the door,
when the callback is built, before training starts.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import weakref
from collections.abc import Mapping
from typing import Any

from monitor.config.schema import MonitorConfig
from monitor.errors import StructurePrinted
from monitor.session.dynamic import dynamic_mode
from monitor.session.trainer import TrainerMon

logger = logging.getLogger("trainmon")

#: what a callback accepts as its config: what TrainerMon accepts, or a TrainerMon already built.
MonitorSource = str | os.PathLike | Mapping[str, Any] | MonitorConfig | TrainerMon


#: the keyword arguments a callback passes on to TrainerMon (all of its own but the config)
TRAINER_MON_KWARGS = tuple(inspect.signature(TrainerMon).parameters)[1:]
#: trainer -> the module of its callback, named when a callback is handed to another trainer
CALLBACKS = {
    "the Hugging Face Trainer": "monitor.integrations.hf",
    "Lightning": "monitor.integrations.lightning",
    "MindSpore's Model.train": "monitor.integrations.mindspore",
}


def as_monitor(source: MonitorSource, **trainer_mon_kwargs: Any) -> TrainerMon:
    """A TrainerMon from a config (validated now) or the one given.

    Raises:
        ConfigError: the config cannot be read or a value is invalid.
        TypeError: a keyword argument TrainerMon does not take (the trainer gives the model, the
            optimizer and grad_acc_steps).
    """
    unknown = sorted(set(trainer_mon_kwargs) - set(TRAINER_MON_KWARGS))
    if unknown:
        raise TypeError(
            f"TrainmonCallback: unexpected keyword argument(s) {', '.join(unknown)}: it takes the config "
            f"and TrainerMon's {', '.join(TRAINER_MON_KWARGS)}; the trainer gives the model and the "
            "optimizer"
        )
    if isinstance(source, TrainerMon):
        return source
    return TrainerMon(source, **trainer_mon_kwargs)


class MonitorCallback:
    """What every trainer callback holds: the TrainerMon, built (its config checked) when the
    callback is, and whether it is attached. Mixed in before the trainer's own callback class.

    Args:
        config: a config file path, a dict, a MonitorConfig, or a TrainerMon already built.
        **trainer_mon_kwargs: passed to TrainerMon (``process_group``, ``params_have_main_grad``).

    ``callback.monitor`` is the TrainerMon: ``on_incident``, ``on_checkpoint``, ``set_batch_ids``
    and ``incidents`` are reached through it.

    Raises:
        ConfigError: the config is invalid (raised here, before training starts).
        TypeError: a keyword argument that TrainerMon does not take.
    """

    #: the trainer this callback is for (a key of CALLBACKS)
    for_trainer = ""

    def __getattr__(self, name: str) -> Any:
        """A trainer event this callback does not have: it was handed to another trainer."""
        if name.startswith("on_") and self.for_trainer:
            others = "; ".join(
                f"{t}: {m}.TrainmonCallback" for t, m in CALLBACKS.items() if t != self.for_trainer
            )
            raise AttributeError(
                f"{type(self).__name__} has no {name!r}: this is trainmon's callback for {self.for_trainer} "
                f"({CALLBACKS[self.for_trainer]}); each trainer has its own ({others})"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __init__(self, config: MonitorSource, **trainer_mon_kwargs: Any) -> None:
        self.monitor = as_monitor(config, **trainer_mon_kwargs)
        self.attached = False
        #: what the last run was attached to (weak references, and the other arguments)
        self._last_run: tuple | None = None
        #: the monitor's state read from a trainer's checkpoint, and where: loaded once attached
        self._restored: tuple[Mapping[str, Any], str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What a copy of the callback carries (Lightning's ``ddp_spawn`` pickles the callbacks
        into each process it starts): the config and TrainerMon's arguments, not the session,
        whose hooks, threads and files belong to this process; each copy attaches its own. A
        process group does not cross processes and is left out, and so are ``on_incident`` and
        ``on_checkpoint`` functions not defined at the top of a module (a lambda), each said."""
        monitor = self.monitor
        if monitor.process_group is not None:
            logger.warning(
                "trainmon: the callback's process_group does not cross into the trainer's other "
                "processes; each copy attaches with the default group"
            )
        state = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("monitor", "attached", "_last_run", "_restored")
        }
        state["monitor"] = {
            "config": monitor.config,  # as it is now (``mon.ops = ...`` included)
            "path": monitor.config_file_path if dynamic_mode() else None,  # dynamic mode watches it
            "params_have_main_grad": monitor.params_have_main_grad,
            "on_incident": [f for f in monitor._incident_callbacks if _copyable(f, "on_incident")],
            "on_checkpoint": [
                f for f in (monitor._checkpoint_function,) if f is not None and _copyable(f, "on_checkpoint")
            ],
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        made = state.pop("monitor")
        self.__dict__.update(state)
        main_grad = made["params_have_main_grad"]
        try:
            self.monitor = TrainerMon(made["path"] or made["config"], params_have_main_grad=main_grad)
        except Exception as exc:  # the watched file changed or went: its config as it was copied
            logger.error(
                "trainmon: the copied callback cannot read %s (%r); using the config it carried",
                made["path"],
                exc,
            )
            self.monitor = TrainerMon(made["config"], params_have_main_grad=main_grad)
        for callback in made["on_incident"]:
            self.monitor.on_incident(callback)
        for function in made["on_checkpoint"]:
            self.monitor.on_checkpoint(function)
        self.attached = False
        self._last_run = None
        self._restored = None

    def attach(self, trainer: str, **set_monitor_kwargs: Any) -> None:
        """``set_monitor(**set_monitor_kwargs)`` at the start of a training run; a failure is
        logged, never raised, and the run goes on unmonitored. A session still attached from an
        earlier run whose trainer never reached its end (it raised, and the trainer has no
        exception hook) is closed first: left on, its hooks would go on counting steps under the
        new run's step numbers."""
        run = _run_of(set_monitor_kwargs)
        start = set_monitor_kwargs.get("start_iteration", 0)
        if self.attached and run is not None and run == self._last_run and start == self.monitor.step:
            logger.warning(
                "trainmon: the %s began the same run twice with this callback (is it in the "
                "callback list twice?); the second beginning is ignored",
                trainer,
            )
            return
        if self.attached:
            logger.warning(
                "trainmon: the previous %s run ended without reaching its end of training (an "
                "exception?); its outputs are closed and a new session starts",
                trainer,
            )
            self.detach()
        elif self.monitor.monitoring:  # the TrainerMon handed to the callback was attached by hand
            logger.warning(
                "trainmon: the TrainerMon given to the %s callback is already attached (set_monitor "
                "was called on it); it goes on as attached there and the callback leaves it alone",
                trainer,
            )
            return
        try:
            if run is not None and run == self._last_run and start >= self.monitor.step:
                # the same model trained on (a run per epoch): one run directory, anomaly files
                # and incident numbers, from the trainer's step count; one that starts again
                # from an earlier step gets a run of its own (a step is never written twice)
                self.monitor.start(step=start)
            else:
                self.monitor.set_monitor(**set_monitor_kwargs)
            self._last_run = run
        except Exception as exc:
            logger.error(
                "trainmon: could not attach to the %s run (%r); training continues unmonitored",
                trainer,
                exc,
                exc_info=exc,
            )
            return
        self.attached = True
        self._load_restored()

    def checkpoint_state(self) -> dict[str, Any] | None:
        """The monitor's state to keep with the trainer's checkpoint (the anomaly rules' history,
        so that a resumed run judges its first steps as the run would have; also after the run
        ended, for a checkpoint saved then), None where there is none; a failure is logged,
        never raised."""
        try:
            saved = self.monitor.state_dict()
        except Exception as exc:
            logger.error("trainmon: reading the monitor's state for the checkpoint failed (%r)", exc)
            return None
        return saved if saved.get("detector") is not None else None

    def restore_state(self, state: Mapping[str, Any], where: str) -> None:
        """The monitor's state read from the trainer's checkpoint at ``where``: loaded now if
        attached, else when the run attaches."""
        self._restored = (state, where)
        if self.attached:
            self._load_restored()

    def _load_restored(self) -> None:
        restored, self._restored = self._restored, None
        if restored is None:
            return
        state, where = restored
        try:
            self.monitor.load_state_dict(dict(state))
        except Exception as exc:  # other rules, or a state of another version: start afresh
            logger.error(
                "trainmon: the monitor's state in %s cannot be restored (%r); the anomaly rules start "
                "their history anew",
                where,
                exc,
            )
            return
        logger.info("trainmon: the anomaly rules' history is restored from %s", where)

    def keep_pace(self, next_step: int) -> None:
        """After the trainer's optimizer step: ``next_step`` is the number the monitor's next step
        should have. One behind it means the update was skipped (a loss scaler found Inf/NaN
        gradients and did not call the optimizer, whose hooks mark a step's end) while the trainer
        counted the step: the monitor ends it too, so both go on under the same numbers."""
        if not self.attached or self.monitor.step != next_step - 1:
            return
        try:
            self.monitor.update_skipped()
        except StructurePrinted:  # print_struct: the run stops as the user asked
            raise
        except Exception as exc:
            logger.error("trainmon: ending a step without its update failed (%r)", exc, exc_info=exc)

    def detach(self) -> None:
        """Remove the hooks and close the outputs at the end of training, once; a failure is
        only logged."""
        if not self.attached:
            return
        self.attached = False
        try:
            self.monitor.stop()
        except Exception as exc:
            logger.error("trainmon: closing the outputs failed (%r)", exc, exc_info=exc)


def _copyable(function: Any, what: str) -> bool:
    """Whether a function given to the monitor can be copied into another process: one defined at
    the top of a module, which a copy names by its module and name (a lambda, a closure, a bound
    method or a callable object is left out, and said)."""
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    found: Any = module
    for part in getattr(function, "__qualname__", "<none>").split("."):
        found = getattr(found, part, None)
    if inspect.isfunction(function) and found is function:
        return True
    logger.warning(
        "trainmon: the %s function %r cannot be copied into the trainer's other processes; it is not "
        "called there (give a function defined at the top of a module)",
        what,
        function,
    )
    return False


def _run_of(set_monitor_kwargs: Mapping[str, Any]) -> tuple | None:
    """What a run attaches to, comparable with a later run's: weak references to the model and
    the optimizer (an object freed since is not taken for a new one at its address) and the
    other arguments but the start step; None where one cannot be referred to weakly."""
    try:
        objects = tuple(
            weakref.ref(set_monitor_kwargs[key]) if set_monitor_kwargs.get(key) is not None else None
            for key in ("model", "optimizer")
        )
    except TypeError:
        return None
    others = tuple(
        sorted(
            (k, repr(v))
            for k, v in set_monitor_kwargs.items()
            if k not in ("model", "optimizer", "start_iteration")
        )
    )
    return objects + others
