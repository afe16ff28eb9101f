"""Everything collected under one config on a MindSpore model: hooks, statistics, outputs.

A Collection lives from the step it starts at until ``collect_times`` collected steps or stop();
the MindSporeSession (which owns the optimizer Cell's hooks and the step counter) creates and
removes it. Every part is guarded: a failure is logged once with its cause and switches that
data type off while the rest goes on.

Where each data type comes from (PyNative):

* ``grad_unreduced``: Parameter tensor hooks during ``value_and_grad`` (see grads.py).
* ``grad_reduced``: the gradient tuple passed to the optimizer Cell's call, i.e. after the
  user's DistributedGradReducer when the loop has one (the same as unreduced without one).
* ``param_origin`` / ``param_updated``: the Parameters before / after the optimizer's call.
* ``exp_avg`` / ``exp_avg_sq``: the optimizer's moment ParameterTuples after its call.
* ``other`` (mg_direction): gradient at the call against exp_avg before the update.
* ``actv`` / ``actv_grad``: Cell hooks and tensor hooks on the Cells' inputs and outputs
  (see activations.py), written at the optimizer's call.
* ``comm``: the collective primitives' calls of the step (see collectives.py).

In graph mode (no hooks, see session.py) only the parameters, the moments and ur_distribution
are collected, at each ``step_end()``: ``param_origin`` of a step is measured when the step
before it ended (or at attach), while the parameters still hold those values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import mint, ops

from adapters.mindspore.activations import Activations, select_cells
from adapters.mindspore.collectives import CollectiveMonitor
from adapters.mindspore.dist import rank_in_group, world_size
from adapters.mindspore.grads import UnreducedGrads
from adapters.mindspore.jit_guard import MODEL_CALLS, LeftOutOfJit
from adapters.mindspore.l2 import L2Features
from adapters.mindspore.optim import OptimizerView
from adapters.mindspore.params import ParamRegistry
from adapters.mindspore.stats import StatEngine, host_memory, training_values
from adapters.mindspore.structure import CellStacks, StructureRecorder
from monitor.config.schema import MonitorConfig
from monitor.datatypes.params import param_row_tables, reduced_index
from monitor.datatypes.update_ratio import adam_histograms, submit_histograms
from monitor.errors import raise_if_of_the_training
from monitor.record import RowSet
from monitor.run_info import run_info
from monitor.session.collection import BaseCollection, UnendedStep
from monitor.session.core import MonitorCore
from monitor.stats.host_stats import probe_index

logger = logging.getLogger("trainmon")


def _same_memory(a: ms.Tensor, b: ms.Tensor) -> bool:
    """Whether two tensors are one piece of memory read alike (address, shape and dtype)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()


class Collection(BaseCollection):
    """The hooks and statistics of one config, from ``first_step`` on."""

    grads: UnreducedGrads | None
    activations: Activations | None
    structure: StructureRecorder | None
    collectives: CollectiveMonitor | None

    def __init__(
        self,
        *,
        config: MonitorConfig,
        chunks: Sequence[ms.nn.Cell],
        view: OptimizerView,
        rank: int,
        pp_stage: int,
        group_mates: list[int],
        grad_acc_steps: int,
        dp_group: Any,
        first_step: int,
        output_dir: str | None = None,
        graph_mode: bool = False,
    ) -> None:
        super().__init__(config, rank, first_step)
        self.view = view
        self.graph_mode = graph_mode
        #: graph mode: (step, statistics of the parameters before that step's update)
        self._origin: tuple[int, Any] | None = None
        self.engine = StatEngine(config.ops, config.eps)
        self.update_ratio = self._update_ratio_wanted()
        view.say_missing_moments(config, self.update_ratio)
        self.update_ratio = self.update_ratio and not view.moment_problem
        self.registry = ParamRegistry(chunks, config)
        cells = [(vpp, raw) for vpp, chunk in enumerate(chunks) for raw, _ in chunk.cells_and_names()]
        self.pipeline_stage = len(group_mates) > 1
        self._warn_unmatched_targets(cells, self.registry.names)
        info = run_info("mindspore", ms.__version__, rank, world_size(), [type(c).__name__ for c in chunks])
        self.core = MonitorCore(config, rank, pp_stage, group_mates, output_dir=output_dir, info=info)
        params = self.registry.params
        self._positions = [view.position(p.param) for p in params]
        self._rows = param_row_tables(
            [p.vpp_stage for p in params],
            [p.name for p in params],
            rank,
            # MindSpore parameters carry no tensor-parallel marker: tp_group does not filter rows.
            reduced_index([False] * len(params), rank_in_group(dp_group), None),
        )
        unended = UnendedStep(grad_acc_steps)  # one for the gradients and activations: said once
        self.grad_acc_steps = grad_acc_steps
        jit = self._jit = LeftOutOfJit(MODEL_CALLS, removes=True)
        if config.wg_distribution:
            mbs = config.monitor_mbs_grad
            self.grads = UnreducedGrads(
                self.registry, grad_acc_steps, self.engine, mbs, self.fail, jit, unended
            )
            self._handles += self.grads.register()
        if config.xy_distribution:
            forward, backward = not config.backward_only, not config.forward_only
            cells = select_cells(chunks, config)
            self.activations = Activations(
                chunks, cells, self.engine, forward, backward, self.fail, jit, unended
            )
            self._handles += self.activations.register()
        if config.recording_l2_features:
            self.l2 = L2Features(chunks, config, self.fail, jit)
            self._handles += self.l2.register()
        self._register_recorders(chunks, partial(StructureRecorder, jit=jit), partial(CellStacks, jit=jit))
        if config.cc_distribution.enable:
            self.collectives = CollectiveMonitor(config, self.fail)
            self.collectives.install()
        if self._handles or self._stack_handles:
            self._handles += [*jit.sentinels(chunks), jit]  # the hooks put back after a compilation too
        self.set_step(first_step)

    # -- the step ----------------------------------------------------------------------------

    def set_step(self, step: int, renumbered: bool = False) -> None:
        """As every adapter's; in graph mode also measure the parameters before ``step``'s update
        (this runs at attach and at the end of the step before) when ``step`` is collected."""
        super().set_step(step, renumbered)
        self._origin = None
        self._jit.restore()  # hooks a compiled function's compilation removed (outside any Cell's call)
        if self.graph_mode and self.collect and self._wanted("param_origin", self.config.param_distribution):
            self._guard("param_origin", self._measure_origin, step)

    def jump_to(self, step: int) -> None:
        """Graph mode: steps ran unseen (dataset sinking) up to ``step``, which has ended already:
        its parameters before the update are gone, so its param_origin rows are not written."""
        super().set_step(step)
        self._origin = None
        if self.collect and self.config.param_distribution and "sunk steps" not in self._told:
            self._told.add("sunk steps")
            logger.info(
                "trainmon: step %d ended with others since the last step_end() (dataset sinking): it has "
                "no param_origin rows (said once); call step_end() after every step to get them",
                step,
            )

    def _measure_origin(self, step: int) -> None:
        self._origin = (step, self.engine.matrix([entry.param for entry in self.registry.params]))

    def before_update(self, grads: Sequence[ms.Tensor] | None) -> None:
        """Optimizer Cell pre-call: activations, gradients, mg_direction, parameters before the update.

        Raises:
            StructurePrinted: print_struct wrote the structure; the run stops as the user asked.
        """
        if not self._start_update():
            return
        cfg = self.config
        if (cfg.wg_distribution or cfg.mg_direction) and (
            grads is None or len(grads) != len(self.view.parameters)
        ):
            problem = ValueError(
                f"the optimizer was called with {'no' if grads is None else len(grads)} gradients "
                f"for {len(self.view.parameters)} parameters"
            )
            for part, switch in (("grad_reduced", cfg.wg_distribution), ("other", cfg.mg_direction)):
                if switch:
                    self.fail(part, problem)
            grads = None
        sources: dict[str, Callable[[int], ms.Tensor | None]] = {}
        if grads is not None and self._wanted("grad_reduced", cfg.wg_distribution):
            reused = self._reduced_as_measured(grads)
            if reused is not None:
                self._guard("grad_reduced", self._submit, "grad_reduced", *reused)
            else:
                sources["grad_reduced"] = self._grad_of(grads)
        if not self.graph_mode and self._wanted("param_origin", cfg.param_distribution):
            sources["param_origin"] = self._param
        measured = self._measure_together(sources)
        if "grad_reduced" in measured:
            self._guard("grad_reduced", self._submit, "grad_reduced", *measured["grad_reduced"])
        if grads is not None and self._wanted("other", cfg.mg_direction):
            self._guard("other", self._submit_mg_direction, grads)
        if self.graph_mode:
            if self._origin is not None and self._origin[0] == self._step:
                _, rows = self._rows["param_origin"]
                self._guard("param_origin", self._submit, "param_origin", rows, self._origin[1])
        elif "param_origin" in measured:
            self._guard("param_origin", self._submit, "param_origin", *measured["param_origin"])
        if self.grads is not None:
            self.grads.release()

    def _reduced_as_measured(self, grads: Sequence[ms.Tensor]) -> tuple[RowSet, np.ndarray] | None:
        """grad_reduced's rows, where the optimizer was handed the very gradients measured at the
        backward pass (one process, one micro-batch a step: the same memory, by address, which
        the grads module held since): their unreduced rows, once one of them, measured again,
        shows that nothing rescaled them in place; else None (measured anew). Host memory
        only: on a device, measuring again costs less than the host reads a comparison needs.
        Any failure here means measuring anew."""
        taken = self.grads.taken if self.grads is not None else {}
        if not taken or not host_memory():
            return None
        try:
            return self._reused_rows(grads, taken)
        except Exception as exc:
            raise_if_of_the_training(exc)
            return None

    def _reused_rows(
        self, grads: Sequence[ms.Tensor], taken: dict[int, tuple[ms.Tensor, int]]
    ) -> tuple[RowSet, np.ndarray] | None:
        """The reuse itself (see ``_reduced_as_measured``)."""
        rows, tensors = self._tensors("grad_reduced", self._grad_of(grads))
        index, _ = self._rows["grad_reduced"]
        found = [taken.get(i) for i in index]
        if len(tensors) != len(index) or any(
            earlier is None or not _same_memory(earlier[0], tensor) for earlier, tensor in zip(found, tensors)
        ):
            return None
        matrix = self.grads.taken_matrix.asnumpy()
        values = matrix[[row for _, row in found]]
        probe = probe_index(values, self.ops, [int(np.prod(t.shape)) for t in tensors])
        if probe is None:
            return None
        again = self.engine.matrix([tensors[probe]]).asnumpy()[0]
        if not np.allclose(again, values[probe], rtol=1e-6, atol=0.0, equal_nan=True):
            return None
        return rows, values

    def after_update(self) -> None:
        """Optimizer Cell post-call: moments and parameters after the update; the step is written."""
        if not self.collect:
            return
        cfg = self.config
        sources = {
            key: self._moment_of(key)
            for key in ("exp_avg", "exp_avg_sq")
            if self._wanted(key, cfg.mv_distribution) and key in self.view.moments
        }
        if self._wanted("param_updated", cfg.param_distribution):
            sources["param_updated"] = self._param
        for prefix, (rows, values) in self._measure_together(sources).items():
            self._guard(prefix, self._submit, prefix, rows, values)
        if self._wanted("ur", self.update_ratio):
            self._guard("ur", self._submit_update_histograms)
        self._end_step()

    # -- where each tensor is ----------------------------------------------------------------

    def _param(self, i: int) -> ms.Parameter:
        return self.registry.params[i].param

    def _grad_of(self, grads: Sequence[ms.Tensor]) -> Callable[[int], ms.Tensor | None]:
        def grad(i: int) -> ms.Tensor | None:
            position = self._positions[i]
            return None if position is None else grads[position]

        return grad

    def _moment_of(self, key: str) -> Callable[[int], ms.Tensor | None]:
        return lambda i: self.view.moment(self._param(i), key)

    # -- statistics --------------------------------------------------------------------------

    def _submit(
        self, prefix: str, rows: RowSet, matrix: ms.Tensor | np.ndarray, ops: tuple[str, ...] | None = None
    ) -> None:
        # a Tensor on the device: its one host copy (arrays come from a shared measurement)
        values = matrix.asnumpy() if isinstance(matrix, ms.Tensor) else np.asarray(matrix)
        self._record(prefix, rows, values, ops)

    def _tensors(self, prefix: str, tensor_of: Callable[[int], ms.Tensor | None]) -> tuple[RowSet, list]:
        """One tensor per monitored parameter (skipping parameters without one) and their rows."""
        index, rows = self._rows[prefix]
        tensors, present = [], []
        for position, i in enumerate(index):
            tensor = tensor_of(i)
            if tensor is not None:
                tensors.append(tensor)
                present.append(position)
        if len(present) != len(index):
            rows = rows.take(present)
        return rows, tensors

    def _measure_together(
        self, sources: dict[str, Callable[[int], ms.Tensor | None]]
    ) -> dict[str, tuple[RowSet, np.ndarray]]:
        """Data type -> its rows and host statistics, for several data types read at one point of
        the step, measured in one ``engine.matrix`` call: one wait for MindSpore's queue, one
        kernel call and one host copy where each data type had its own. Should that call fail,
        each data type is measured on its own, so that a failure switches off only its own."""
        gathered: dict[str, tuple[RowSet, list]] = {}
        for prefix, tensor_of in sources.items():
            try:
                gathered[prefix] = self._tensors(prefix, tensor_of)
            except Exception as exc:
                self.fail(prefix, exc)
        if not gathered:
            return {}
        try:
            matrix = self.engine.matrix([tensor for _, tensors in gathered.values() for tensor in tensors])
            values = matrix.asnumpy()
        except Exception as exc:
            raise_if_of_the_training(exc)
            if "shared measurement" not in self._told:
                self._told.add("shared measurement")
                logger.warning(
                    "trainmon: measuring %s together failed (%r); each is measured on its own (said once)",
                    ", ".join(gathered),
                    exc,
                )
            measured = {}
            for prefix, (rows, tensors) in gathered.items():
                try:
                    measured[prefix] = (rows, self.engine.matrix(tensors).asnumpy())
                except Exception as exc:
                    self.fail(prefix, exc)
            return measured
        measured, start = {}, 0
        for prefix, (rows, tensors) in gathered.items():
            measured[prefix] = (rows, values[start : start + len(tensors)])
            start += len(tensors)
        return measured

    def _submit_update_histograms(self) -> None:
        """ur_distribution: histograms of every monitored parameter's Adam state, on the host."""
        hyper = self.view.adam_hyper()
        if hyper is None:
            return
        labels, counts = [], []
        for entry in self.registry.params:
            exp_avg = self.view.moment(entry.param, "exp_avg")
            exp_avg_sq = self.view.moment(entry.param, "exp_avg_sq")
            if exp_avg is not None and exp_avg_sq is not None:
                labels.append((entry.vpp_stage, entry.name))
                counts.append(adam_histograms(training_values(exp_avg), training_values(exp_avg_sq), *hyper))
        if counts:
            submit_histograms(self.core, self._step, self.rank, labels, np.stack(counts))

    def _submit_collectives(self) -> None:
        for rows, ops_, values in self.collectives.take(self.rank):
            self._submit("comm", rows, values, ops_)

    def _submit_mg_direction(self, grads: Sequence[ms.Tensor]) -> None:
        """Share of gradient signs agreeing with exp_avg before this update (1.0 before the first)."""
        index, rows = self._rows["other"]
        grad_of = self._grad_of(grads)
        present, pairs, constant = [], [], []
        for position, i in enumerate(index):
            grad = grad_of(i)
            if grad is None:
                continue
            moment = self.view.moment(self._param(i), "exp_avg")
            if moment is None:
                constant.append((len(present), 1.0))  # no moments: as torch before the first step
            elif tuple(moment.shape) != tuple(grad.shape) or moment.size == 0:
                constant.append((len(present), float("nan")))
            else:
                pairs.append((len(present), grad, moment))
            present.append(position)
        if len(present) != len(index):
            rows = rows.take(present)
        parts, order = [], []
        if pairs:
            share = self.engine.sign_agreement([g for _, g, _ in pairs], [m for _, _, m in pairs])
            parts.append(mint.where(self.view.not_updated_yet(), ms.Tensor(1.0, ms.float64), share))
            order += [slot for slot, _, _ in pairs]
        if constant:
            parts.append(ms.Tensor(np.array([value for _, value in constant], dtype=np.float64)))
            order += [slot for slot, _ in constant]
        if not parts:
            self._submit("other", rows, self.engine.matrix(()))
            return
        values = parts[0] if len(parts) == 1 else ops.concat(parts)
        if order != sorted(order):
            values = ops.gather(values, ms.Tensor(np.argsort(np.array(order)).astype(np.int32)), 0)
        self._submit("other", rows, self.engine.scalar_matrix(values))
