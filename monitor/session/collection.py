"""What every adapter's Collection shares: the step flag, row numbering and guarded parts.

A Collection holds the hooks and statistics of one config. The framework-specific parts (where
each tensor is, how statistics are computed and copied to the host) live in the adapters; the
bookkeeping around them is the same for every framework and lives here, so that a failure is
contained, logged and switched off in one way only.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from monitor.config.schema import MonitorConfig
from monitor.datatypes.l2 import ATTENTION_PREFIX, LINEAR_OPS, LINEAR_PREFIX
from monitor.datatypes.params import unreduced_rows
from monitor.datatypes.tasks import SCALED_PREFIXES
from monitor.datatypes.update_ratio import update_ratio_written
from monitor.errors import StructurePrinted, raise_if_of_the_training
from monitor.naming import unmatched_targets
from monitor.record import RowSet, SameRows, StepRecord
from monitor.session.core import MonitorCore
from monitor.session.micro_batches import micro_batch_message, uneven_step
from monitor.session.schedule import Schedule
from monitor.structure import StackRecorder

logger = logging.getLogger("trainmon")
#: backward passes in one step, at least, after which a step is taken for one that never ends
UNENDED_PASSES = 256


class UnendedStep:
    """Tells a step that has run for far more backward passes than ``grad_acc_steps``: the
    optimizer that steps is then likely not the one given to set_monitor, and nothing is written
    until that one steps. Said once; from then on in that step the gradient sources and, told by
    ``now``, the activations hold their latest pass's rows only."""

    def __init__(self, grad_acc_steps: int) -> None:
        self.grad_acc_steps = grad_acc_steps
        self.after = max(UNENDED_PASSES, 16 * grad_acc_steps)
        #: the current step has been taken for one that never ends (reset by ``end_step``)
        self.now = False
        self._told = False

    def is_unended(self, count: int) -> bool:
        """Whether a step with ``count`` backward passes so far counts as one that never ends."""
        if count < self.after:
            return False
        self.now = True
        if not self._told:
            self._told = True
            logger.warning(
                "trainmon: %d backward passes and no step of the monitored optimizer (grad_acc_steps "
                "is %d): nothing is written until it steps, and until then only the latest pass's "
                "rows are kept. Is the optimizer given to set_monitor the one that steps (not one "
                "made anew after loading a checkpoint, say), and grad_acc_steps about the number of "
                "micro-batches a step has?",
                count,
                self.grad_acc_steps,
            )
        return True

    def end_step(self) -> None:
        self.now = False


class BaseCollection(ABC):
    """Schedule, step flag, call ids, failures and removal of one config's collection.

    Adapters set the parts they build (``grads``, ``activations``, ``structure``, ``stacks``,
    ``collectives``, ``core``, ``_rows``) and implement ``_submit`` and ``_submit_collectives``.
    Every part keeps the same small interface across frameworks: ``reset()``
    and a ``collect`` flag for gradients and activations (``passes()`` for gradients too),
    ``begin_step``/``remove`` for collectives.
    """

    #: this rank holds one pipeline stage's part of the model (set by the adapters at attach)
    pipeline_stage = False

    core: MonitorCore
    registry: Any
    _rows: dict[str, tuple[list[int], RowSet]]

    def __init__(self, config: MonitorConfig, rank: int, first_step: int) -> None:
        self.config = config
        self.rank = rank
        self.ops = config.ops
        self.schedule = Schedule.from_config(config)
        self.schedule.first_step = first_step
        self.collect = False
        self._failed: set[str] = set()
        self._told: set[str] = set()
        self._call_id = 0
        self._step = first_step
        #: whether the rules judge this step's gradients (``StepRecord.judged``): False for a step
        #: whose update was skipped, or the loss scaler's own verdict where the optimizer skips it
        self.gradients_judged: bool | Callable[[], bool] = True
        #: set by the adapters: micro-batches a step should have; a collected step shorter than
        #: that and the step before (``_uneven``) has its activations and gradients judged for
        #: NaN/Inf only
        self.grad_acc_steps: int | None = None
        self._uneven = False
        self._last_micro_batches: int | None = None
        self._handles: list = []
        self._stack_handles: list = []
        self.grads: Any = None
        self.activations: Any = None
        #: msprobe's l2 features (attention probabilities, linear spectral norms), or None
        self.l2: Any = None
        self.structure: Any = None
        self.stacks: StackRecorder | None = None
        self.collectives: Any = None
        #: per data type whose rows can change from step to step: the last step's RowSet
        self._same_rows: defaultdict[str, SameRows] = defaultdict(SameRows)

    def _update_ratio_wanted(self) -> bool:
        """ur_distribution: on when asked for and the format is TensorBoard (else said once)."""
        if self.config.ur_distribution and not update_ratio_written(self.config):
            logger.warning(
                "trainmon: ur_distribution writes TensorBoard histograms; with format %s it is off",
                self.config.format,
            )
            return False
        return self.config.ur_distribution

    # -- the step ----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.schedule.finished

    def set_step(self, step: int, renumbered: bool = False) -> None:
        """Decide, before the step's forward, whether it is collected; every hook reads this flag.
        ``renumbered``: the step begun at attach, under the number a resumed run's state gives."""
        self._step = step
        self._call_id = 0
        self.gradients_judged = True
        self._uneven = False
        collect = self.collect = self.schedule.wants(step)
        if self.grads is not None:
            self.grads.reset()
            self.grads.collect = collect and "grad_unreduced" not in self._failed
        if self.activations is not None:
            self.activations.reset()
            self.activations.collect = collect and not {"actv", "actv_grad"} & self._failed
        if self.l2 is not None:
            self.l2.reset()
            self.l2.collect = collect and ATTENTION_PREFIX not in self._failed
        if self.collectives is not None:
            begin = self.collectives.renumber if renumbered else self.collectives.begin_step
            begin(step, collect and "comm" not in self._failed)

    def _start_update(self) -> bool:
        """Optimizer pre-step, the part every adapter shares: print_struct, then (on a collected
        step) activations and unreduced gradients. Returns whether the step is collected.

        Raises:
            StructurePrinted: print_struct wrote the structure; the run stops as the user asked.
        """
        self._print_structure()
        if not self.collect:
            return False
        self._uneven = self._uneven_step()
        if self.activations is not None:
            self._guard("actv", self._submit_activations)
        if self._wanted("grad_unreduced", self.config.wg_distribution):
            self._guard("grad_unreduced", self._submit_unreduced)
        elif self.config.wg_distribution and self.grads is not None:
            self._guard("grad_unreduced", self._unreduced_switched_off)
        if self.l2 is not None:
            self._guard(ATTENTION_PREFIX, self._submit_l2, ATTENTION_PREFIX)
            if LINEAR_PREFIX not in self._failed:
                self._guard(LINEAR_PREFIX, self._submit_l2, LINEAR_PREFIX)
        return True

    def skipped_update(self) -> None:
        """A step that ended without its update (a loss scaler found Inf/NaN gradients and did
        not call the optimizer): what its forward and backward passes measured is written, its
        gradients' values left to the scaler rather than judged by the rules, and nothing of
        the optimizer's (it used no gradient and changed no parameter or moment)."""
        self.gradients_judged = False
        if self._start_update():
            self._end_step()

    def _submit_l2(self, prefix: str) -> None:
        """The step's attention rows, or the linear modules' spectral norms (measured now)."""
        if prefix == ATTENTION_PREFIX:
            found, ops = self.l2.take_attention(self.rank), self.l2.attention_ops
        else:
            found, ops = self.l2.linear_values(self.rank), LINEAR_OPS
        if found is not None:
            self._submit(prefix, *found, ops)

    @abstractmethod
    def after_update(self) -> None:
        """Optimizer post-step: the statistics after the update, ending with ``_end_step()``."""

    def _end_step(self) -> None:
        """Last of the optimizer's post-step: collectives and call stacks, then the step is written."""
        if self.collectives is not None:
            self._guard("comm", self._submit_collectives)
        if self.stacks is not None:
            self._guard("stack_info", self._write_stacks)
        self.core.end_step(self._step)
        self.schedule.mark_collected()

    # -- statistics --------------------------------------------------------------------------

    @abstractmethod
    def _submit(self, prefix: str, rows: RowSet, matrix: Any, ops: tuple[str, ...] | None = None) -> None:
        """Hand one data type's statistics (a framework tensor or an array) to the core."""

    @abstractmethod
    def _submit_collectives(self) -> None:
        """The collective calls of the step, one record per kind of call."""

    def _write_stacks(self) -> None:
        """stack_info: write stack_info.csv once, at the first collected step, then unhook; a
        failed write keeps the hooks and is tried again at the next collected step, as does a step
        whose forward recorded no stack (compiled code traced the hooks, so they recorded nothing)."""
        if not self.stacks.stacks:
            return
        if self.core.output_dir is not None:
            path = self.stacks.write(self.core.output_dir)
            if path:
                logger.info("trainmon: module call stacks written to %s", path)
        for handle in self._stack_handles:
            handle.remove()
        self._stack_handles, self.stacks = [], None

    def _record(
        self,
        prefix: str,
        rows: RowSet,
        values: np.ndarray | None,
        ops: tuple[str, ...] | None = None,
        fetch: Callable[[], np.ndarray] | None = None,
    ) -> None:
        """Submit host values (or a pending copy, ``fetch``), numbering the rows in call order."""
        n = len(rows)
        call_ids = np.arange(self._call_id, self._call_id + n)
        self._call_id += n
        scaled = prefix in SCALED_PREFIXES
        judged = self.gradients_judged if scaled else True
        by_rules = not (self._uneven and (scaled or prefix == "actv"))
        self.core.submit(
            StepRecord(prefix, self._step, ops or self.ops, rows, values, call_ids, fetch, judged, by_rules)
        )

    def _uneven_step(self) -> bool:
        """Whether the step was shorter than ``grad_acc_steps`` and the step before."""
        counted = self.grads.passes() if self.grads is not None else 0
        if not counted and self.activations is not None:
            counted = self.activations.micro_batches()
        previous, self._last_micro_batches = self._last_micro_batches, counted
        return uneven_step(self._told, self._step, counted, self.grad_acc_steps, previous)

    def _submit_activations(self) -> None:
        for prefix, rows, matrix in self.activations.take(self.rank):
            self._submit(prefix, rows, matrix)

    def _submit_unreduced(self) -> None:
        index, micro, matrix = self.grads.take()
        self._report_micro_batches(*getattr(self.grads, "counted", (0, 0, 0)))
        _, base = self._rows["grad_unreduced"]
        rows = self._same_rows["grad_unreduced"].get(
            (index, micro), lambda: unreduced_rows(base, index, micro, self.rank)
        )
        self._submit("grad_unreduced", rows, *self._unreduced_columns(index, matrix))

    def _unreduced_switched_off(self) -> None:
        """Called on collected steps after grad_unreduced failed: an adapter whose unreduced rows
        take part in collectives joins them without rows here."""
        return None

    def _unreduced_columns(self, index: list[int], matrix: Any) -> tuple[Any, tuple[str, ...] | None]:
        """The unreduced rows' statistics and ops: as measured, unless an adapter measured pieces."""
        return matrix, None

    def _report_micro_batches(self, micro_batches: int, missing: int, unsummed: int) -> None:
        """Say once each what the step's micro-batches against ``grad_acc_steps`` mean for its
        rows (``monitor.session.micro_batches``)."""
        expected = getattr(self.grads, "grad_acc_steps", None)
        mbs = self.config.monitor_mbs_grad
        said = micro_batch_message(self._told, self._step, micro_batches, expected, missing, unsummed, mbs)
        if said is not None:
            logger.log(*said)

    def _warn_unmatched_targets(self, modules: list[tuple[int, str]], params: list[tuple[int, str]]) -> None:
        """One warning per ``targets`` key that names none of the model's modules and parameters
        (their ``(vpp_stage, raw_name)``), or ``l2_targets`` key that names no module, with the
        closest name there. Under pipeline parallelism (``pipeline_stage``) a rank holds only its
        stage's part: a key naming another stage's is expected, so it is said at info level only."""
        pipeline = self.pipeline_stage
        level = logging.INFO if pipeline else logging.WARNING
        where = "this pipeline stage" if pipeline else "the model"
        lists = [("targets", self.config.targets, modules + params, True)]
        if self.config.recording_l2_features:  # l2 lists name whole modules, not prefixes
            lists += [
                (f"l2_targets.{kind}", keys, modules, False) for kind, keys in self.config.l2_targets.items()
            ]
        for where_key, keys, named, prefixes in lists:
            for key, close in unmatched_targets(keys, named, prefixes=prefixes):
                hint = f"did you mean {close!r}?" if close else "print_struct: true lists the model's names"
                logger.log(
                    level,
                    "trainmon config: %s key %r selects no %s of %s; %s",
                    where_key,
                    key,
                    "module or parameter" if prefixes else "module",
                    where,
                    hint,
                )

    # -- print_struct and stack_info ---------------------------------------------------------

    def _register_recorders(
        self, chunks: Sequence[Any], structure_recorder: type, stack_recorder: Callable[..., Any]
    ) -> None:
        """print_struct / stack_info: hook the adapter's recorders of the structure and call stacks."""
        if self.config.print_struct:
            self.structure = structure_recorder(chunks, self.config.squash_name, self.fail)
            self._handles += self.structure.register()
        if self.config.stack_info:
            self.stacks = stack_recorder(chunks, self.config.squash_name, self.fail)
            self._stack_handles = self.stacks.register()

    def _print_structure(self) -> None:
        """print_struct: once the structure is recorded, write it and stop the run, as the user asked.

        A failure to record (logged by the hook) or to write switches print_struct off, without
        writing an incomplete structure; the run goes on.

        Raises:
            StructurePrinted: the structure was written.
        """
        failed = "print_struct" in self._failed
        if self.structure is None or not (self.structure.structure or failed):
            return
        recorder, self.structure = self.structure, None
        if failed:
            return
        try:
            path = recorder.write(self.core.root, self.rank)
        except Exception as exc:
            self.fail("print_struct", exc)
            return
        logger.info("trainmon: module structure written to %s; stopping as print_struct asks", path)
        raise StructurePrinted(path)

    # -- failures and removal ----------------------------------------------------------------

    def _wanted(self, part: str, switch: bool) -> bool:
        return switch and part not in self._failed

    def _guard(self, part: str, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self.fail(part, exc)

    def fail(self, part: str, exc: BaseException) -> None:
        """Log a failure once with its cause and switch that part off; the training goes on. The
        training's own error that a read of ours surfaced (``errors.of_the_training``) is raised on."""
        raise_if_of_the_training(exc)
        if part in self._failed:
            return
        self._failed.add(part)
        if part == "grad_unreduced" and self.grads is not None:
            self.grads.collect = False
        if part in ("actv", "actv_grad") and self.activations is not None:
            self.activations.collect = False
        if part == ATTENTION_PREFIX and self.l2 is not None:
            self.l2.collect = False
        logger.error(
            "trainmon: %s failed and is switched off (%r); training continues", part, exc, exc_info=exc
        )

    def passes_in_step(self) -> int:
        """Backward passes the current step's gradients have seen so far (0 where no part counts them)."""
        return self.grads.passes() if self.grads is not None else 0

    def remove(self) -> None:
        """Remove every hook of this collection and close its outputs (idempotent)."""
        for handle in self._handles + self._stack_handles:
            handle.remove()
        self._handles, self._stack_handles = [], []
        self.collect = False
        if self.grads is not None:
            self.grads.collect = False
        if self.activations is not None:
            self.activations.collect = False
        if self.l2 is not None:
            self.l2.collect = False
        if self.collectives is not None:
            self.collectives.remove()
        self.core.close()
