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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mindspore as ms

from adapters.mindspore.collection import Collection
from adapters.mindspore.dist import global_rank, pipeline_info
from adapters.mindspore.optim import OptimizerView, hookable_optimizer
from monitor.config import MonitorConfig
from monitor.errors import CollectivesLogged, StructurePrinted
from monitor.schedule import rank_enabled

logger = logging.getLogger("trainmon")


class MindSporeSession:
    """Hooks of one TrainerMon on one MindSpore model (Cell or list of Cells) and optimizer Cell."""

    def __init__(
        self,
        *,
        config: MonitorConfig,
        model: Any,
        grad_acc_steps: int,
        optimizer: Any,
        process_group: Any,
        params_have_main_grad: bool | None,
        tp_group: Any,
        dp_group: Any,
        start_iteration: int,
        dormant: bool = False,
        on_step_end: Callable[[int], None] | None = None,
    ) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, ms.nn.Cell):
                raise TypeError(
                    f"set_monitor: model[{i}]: expected a mindspore.nn.Cell, got {type(chunk).__name__}"
                )
        if optimizer is None:
            raise ValueError("set_monitor: optimizer: required (its call marks the end of a training step)")
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise ValueError("set_monitor: MindSpore is in graph mode; trainmon supports PyNative mode only")
        if params_have_main_grad:
            logger.warning(
                "trainmon: params_have_main_grad is ignored: MindSpore parameters have no main_grad"
            )
        self.config = config
        self.chunks = chunks
        self.optimizer = hookable_optimizer(optimizer)
        self.view = OptimizerView(self.optimizer)
        self.rank = global_rank()
        self.pp_stage, self.group_mates = pipeline_info(process_group)
        self.grad_acc_steps = grad_acc_steps
        self.dp_group = dp_group
        self.step = start_iteration
        self.on_step_end = on_step_end
        self.collection: Collection | None = None
        self._output_dir: str | None = None
        self._core: Any = None
        self._hooks: list = []
        self._steps_at_stop: int | None = None
        if not rank_enabled(config, self.rank):
            logger.info("trainmon: rank %d is not in module_ranks; nothing is monitored here", self.rank)
            return
        self._attach_optimizer_hooks()  # also when dormant: live control runs at the end of each step
        if not dormant:
            self.start(config)

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
        self.collection = Collection(
            config=self.config,
            chunks=self.chunks,
            view=self.view,
            rank=self.rank,
            pp_stage=self.pp_stage,
            group_mates=self.group_mates,
            grad_acc_steps=self.grad_acc_steps,
            dp_group=self.dp_group,
            first_step=self.step,
            output_dir=self._output_dir,
        )
        self._output_dir = self.collection.core.output_dir
        kinds = [
            k
            for k in (
                "wg_distribution",
                "mv_distribution",
                "param_distribution",
                "mg_direction",
                "xy_distribution",
            )
            if getattr(self.config, k)
        ]
        logger.info(
            "trainmon: monitoring %d MindSpore parameters (%s) on rank %d from step %d, output %s",
            len(self.collection.registry),
            ", ".join(kinds) or "nothing selected",
            self.rank,
            self.step,
            self.collection.core.output_dir or "in memory (format api)",
        )

    def stop(self) -> None:
        """Remove every hook and close the outputs (idempotent; not from inside the optimizer's call)."""
        self._end_collection()
        if self._hooks:
            self._steps_at_stop = self.view.step_count()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def resume_step_count(self, step: int | None) -> None:
        """After stop() no hook counts steps: go on from ``step``, else from the optimizer's global_step."""
        if step is not None:
            self.step = step
        elif self._steps_at_stop is not None:
            now = self.view.step_count()
            if now is not None:
                self.step += now - self._steps_at_stop
        self._steps_at_stop = None

    # -- optimizer Cell hooks ----------------------------------------------------------------

    def _attach_optimizer_hooks(self) -> None:
        self._hooks = [
            self.optimizer.register_forward_pre_hook(self._before_update, with_kwargs=True),
            self.optimizer.register_forward_hook(self._after_update),
        ]

    def _before_update(self, cell: Any, args: tuple, kwargs: dict) -> None:
        if self.collection is not None:
            grads = args[0] if args else kwargs.get("gradients")
            try:
                self.collection.before_update(grads if isinstance(grads, (tuple, list)) else None)
            except StructurePrinted:  # the only exception that leaves a hook: the user asked for it
                self._end_collection()
                raise
            except Exception as exc:
                self.collection.fail("step start", exc)

    def _after_update(self, cell: Any, args: tuple, output: Any) -> None:
        try:
            if self.collection is not None:
                try:
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
                        self._end_collection()
                        raise
            if self.on_step_end is not None:
                try:
                    self.on_step_end(self.step)
                except Exception as exc:  # live control must never stop the training
                    logger.error("trainmon: live control failed (%r); monitoring state unchanged", exc)

    def _end_collection(self) -> None:
        if self.collection is not None:
            self._core = self.collection.core
            self.collection.remove()
            self.collection = None
