"""One attached TrainerMon on a MindSpore (PyNative) model: the optimizer Cell's hooks and the step.

A MindSpore optimizer is a Cell that the training loop calls with the gradient tuple
(``opt(grads)``); one call is one training step. The session registers a forward pre-hook
(gradients and parameters before the update) and a forward hook (moments and parameters after
it, end of the step) on that Cell, instance-level only: nothing is patched on a class or set on
the user's objects. Like the torch session it owns the step counter and these two hooks for its
whole life, while what is collected under a config lives in a Collection that can be started,
stopped and replaced (``start()``, ``stop()``, live control through ``on_step_end``).

MindSpore iterates a Cell's hook dict while it calls the hooks, so a hook cannot be removed
from inside that Cell's call. When ``collect_times`` (or print_struct) ends the collection inside
the optimizer's hooks, the collection's parameter and Cell hooks are removed at once and the two
optimizer hooks stay, doing nothing, until ``stop()``.

Graph mode (``GRAPH_MODE``, or ``set_monitor(..., graph_mode=True)`` for a step compiled with
``mindspore.jit`` in PyNative mode): the compiled step runs no Python hook, and a hook on a Cell
inside it breaks its compilation, so nothing is hooked. The loop calls ``step_end()`` after each
step (``monitor.integrations.mindspore`` does it for ``Model.train``); the parameters and Adam's
moments are then read from the host, the step numbered by the optimizer's own update count, so
a call after several steps (dataset sinking) is numbered right. What needs hooks (gradients,
activations, mg_direction, collectives, print_struct, stack_info) is switched off with one
warning naming it.
"""

from __future__ import annotations

import dataclasses
import logging
from types import MappingProxyType
from typing import Any

import mindspore as ms

from adapters.mindspore.bundle import facts as bundle_facts
from adapters.mindspore.bundle import record_tensors
from adapters.mindspore.collection import Collection
from adapters.mindspore.dist import any_rank, global_rank, pipeline_info, world_size
from adapters.mindspore.jit_guard import TRAINING_STEP, LeftOutOfJit
from adapters.mindspore.optim import OptimizerView, hookable_optimizer, trained_network
from monitor.config.schema import MonitorConfig
from monitor.session.lifecycle import Attachment, SessionLifecycle, model_chunks

logger = logging.getLogger("trainmon")

#: config switches whose data only hooks can see (PyNative mode).
NEEDS_HOOKS = ("wg_distribution", "xy_distribution", "mg_direction", "print_struct", "stack_info")


def without_hooks(config: MonitorConfig) -> tuple[MonitorConfig, list[str]]:
    """The config with what needs hooks switched off, and the names of the switches that were on.
    The attention features need hooks; the linear ones read weights between steps and stay."""
    on = [key for key in NEEDS_HOOKS if getattr(config, key)]
    changes: dict[str, Any] = dict.fromkeys(on, False)
    if config.cc_distribution.enable:
        on.append("cc_distribution")
        changes["cc_distribution"] = dataclasses.replace(config.cc_distribution, enable=False)
    if config.recording_l2_features and config.l2_targets.get("attention_hook"):
        on.append("l2_targets.attention_hook")
        rest = {kind: keys for kind, keys in config.l2_targets.items() if kind != "attention_hook"}
        changes["l2_targets"] = MappingProxyType(rest)
    return (dataclasses.replace(config, **changes) if changes else config), on


class MindSporeSession(SessionLifecycle):
    """Hooks of one TrainerMon on one MindSpore model (Cell or list of Cells) and optimizer Cell."""

    #: a MindSpore optimizer takes the gradients as arguments and would move its moments on zeros
    can_skip_updates = False

    monitored = "MindSpore parameters"
    collection: Collection | None

    def __init__(self, attachment: Attachment) -> None:
        a = attachment
        chunks = model_chunks(a.model, ms.nn.Cell, "mindspore.nn.Cell")
        if a.optimizer is None:
            raise ValueError("set_monitor: optimizer: required (its call marks the end of a training step)")
        self.graph_mode = (
            a.graph_mode if a.graph_mode is not None else ms.get_context("mode") != ms.PYNATIVE_MODE
        )
        if a.params_have_main_grad:
            logger.warning(
                "trainmon: params_have_main_grad is ignored: MindSpore parameters have no main_grad"
            )
        self.optimizer = hookable_optimizer(a.optimizer)
        self.chunks = [trained_network(chunk, self.optimizer) for chunk in chunks]
        self.view = OptimizerView(self.optimizer)
        super().__init__(a.config, global_rank(), a.start_iteration, a.on_step_end)
        #: dynamic mode's ranks follow rank 0 through the schedule file when there are several
        self.world_size = world_size()
        self.pp_stage, self.group_mates = pipeline_info(a.process_group)
        self.grad_acc_steps = a.grad_acc_steps
        self.dp_group = a.dp_group
        self.tp_group = a.tp_group
        #: graph mode: the optimizer's update count when the session began counting from ``step``
        self._updates_at_start = (self.view.step_count() or 0) if self.graph_mode else 0
        self._start_step = a.start_iteration
        self._told_pynative = False
        self._attach(a.dormant)

    # -- public control ----------------------------------------------------------------------

    def resume_step_count(self, step: int | None) -> None:
        """After stop() no hook counts steps: go on from ``step``, else from the optimizer's global_step."""
        if self.graph_mode:  # no hook counted the steps since stop(): the update count did
            updates = self.view.step_count() or 0
            self.step = step if step is not None else self._start_step + updates - self._updates_at_start
            self._start_step, self._updates_at_start = self.step, updates
            return
        super().resume_step_count(step)

    # -- the collection of one config --------------------------------------------------------

    def _new_collection(self) -> Collection:
        config = self.config
        if self.graph_mode:
            config, needs_hooks = without_hooks(config)
            if needs_hooks:
                logger.warning(
                    "trainmon: MindSpore graph mode runs no hooks, and these need them (PyNative mode): "
                    "%s; they are off in this run. Parameters and moments are read from the host at "
                    "each step_end()",
                    ", ".join(needs_hooks),
                )
        return Collection(
            config=config,
            chunks=self.chunks,
            view=self.view,
            rank=self.rank,
            pp_stage=self.pp_stage,
            group_mates=self.group_mates,
            grad_acc_steps=self.grad_acc_steps,
            dp_group=self.dp_group,
            first_step=self.step,
            output_dir=self._output_dir,
            graph_mode=self.graph_mode,
        )

    # -- optimizer Cell hooks ----------------------------------------------------------------

    def step_end(self) -> None:
        """Graph mode: a training step (or, with dataset sinking, several) has ended. Collects the
        step the optimizer's update count says ended last; nothing when it has not moved. An
        optimizer without an update count has each call taken as one step."""
        if not self.graph_mode:
            if not self._told_pynative:
                self._told_pynative = True
                compiled = getattr(getattr(self, "_jit", None), "said", False)  # the step runs no hook
                logger.log(
                    logging.WARNING if compiled else logging.INFO,
                    "trainmon: step_end() reads between steps only when attached with "
                    "set_monitor(..., graph_mode=True); %s",
                    "this run's training step is compiled with mindspore.jit, so nothing is recorded "
                    "until it is attached so"
                    if compiled
                    else "in PyNative mode the optimizer's hooks count the steps",
                )
            return
        try:
            updates = self.view.step_count()
        except Exception as exc:
            logger.error("trainmon: step_end: the optimizer's update count is unreadable (%r)", exc)
            return
        last = self.step if updates is None else self._start_step + updates - self._updates_at_start - 1
        if last < self.step:  # no update since the last call
            return
        if last > self.step:  # several steps ran in one call (dataset sinking)
            self.step = last
            if self.collection is not None:
                self.collection.jump_to(last)
        self._begin_update(None)
        self._after_update()

    def _attach_optimizer_hooks(self) -> None:
        if self.graph_mode:
            return
        jit = self._jit = LeftOutOfJit(TRAINING_STEP)  # held here: its registry keeps it weakly
        self._hooks = [
            self.optimizer.register_forward_pre_hook(jit.cell_hook(self._before_update), with_kwargs=True),
            self.optimizer.register_forward_hook(jit.cell_hook(self._after_update)),
        ]

    def _optimizer_step_count(self) -> int | None:
        return self.view.step_count()

    def _bundle_contents(
        self, incident: dict[str, Any], budget: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        info, generators = bundle_facts(self)
        return info, {**record_tensors(self, incident, budget), **generators}

    def _agree_on_stop(self, asked_here: bool) -> bool:
        return any_rank(asked_here)

    def _detach_after_this_step(self) -> None:
        """Monitoring ended inside the optimizer Cell's call, which iterates the hooks: they stay,
        doing nothing, until stop()."""

    def _before_update(self, cell: Any, args: tuple, kwargs: dict) -> None:
        grads = args[0] if args else kwargs.get("gradients")
        self._begin_update(grads if isinstance(grads, (tuple, list)) else None)
