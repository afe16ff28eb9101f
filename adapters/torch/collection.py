"""Everything collected under one config: hooks, per-step statistics, the outputs they go to.

A Collection lives from the step it starts at until ``collect_times`` collected steps, stop(),
or a live reconfiguration; the TorchSession (which owns the optimizer hooks and the step
counter) creates and removes it. Every part is guarded: a failure is logged once with its cause
and switches that data type off while the rest goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from adapters.torch.activations import Activations
from adapters.torch.compiled import CompiledModel
from adapters.torch.device_stats import device_scalars, on_device, with_host_columns
from adapters.torch.dist import ddp_reduces_after_pass_end, rank_in_group, world_size
from adapters.torch.grad_sources import unreduced_source
from adapters.torch.grads import GradCounting
from adapters.torch.hooked_modules import select_modules, shown_class
from adapters.torch.l2 import L2Features
from adapters.torch.mg_direction import sign_agreement
from adapters.torch.optim import TorchBackend
from adapters.torch.optimizer_checks import OptimizerChecks
from adapters.torch.params import ParamRegistry
from adapters.torch.sharded.merge_failures import MERGED_PARTS, MergeFailures
from adapters.torch.sharded.shards import SHARD_COLUMNS, held_rows, piece_columns, shard_reduce
from adapters.torch.sharded.tp_activations import TensorParallelMerge
from adapters.torch.stats import stat_matrix, still_measured, to_host
from adapters.torch.structure import StructureRecorder, stack_recorder
from adapters.torch.update_ratio import update_histograms
from monitor.config.schema import MonitorConfig
from monitor.datatypes.params import PARAM_TASKS, param_row_tables, reduced_index
from monitor.datatypes.update_ratio import submit_histograms
from monitor.record import RowSet
from monitor.run_info import run_info
from monitor.session.collection import BaseCollection, UnendedStep
from monitor.session.core import MonitorCore
from monitor.stats.host_stats import scalar_matrix

logger = logging.getLogger("trainmon")


class Collection(BaseCollection):
    """The hooks and statistics of one config, from ``first_step`` on."""

    activations: Activations | None
    structure: StructureRecorder | None

    def __init__(
        self,
        *,
        config: MonitorConfig,
        chunks: Sequence[torch.nn.Module],
        backend: Any,
        rank: int,
        pp_stage: int,
        group_mates: list[int],
        grad_acc_steps: int,
        main_grad: bool | None,
        tp_group: Any,
        dp_group: Any,
        first_step: int,
        output_dir: str | None = None,
        collectives: Any = None,
        last_micro_batch: Callable[[], bool] | None = None,
        ddp_wrappers: Sequence[torch.nn.Module] | None = None,
        given_compiled: bool = False,
    ) -> None:
        super().__init__(config, rank, first_step)
        self.backend = backend
        self.eps = config.eps
        self.update_ratio = self._update_ratio_wanted()
        self.registry = ParamRegistry(chunks, config, main_grad, backend.named_parameters)
        modules = [(vpp, raw) for vpp, chunk in enumerate(chunks) for raw, _ in chunk.named_modules()]
        self.pipeline_stage = len(group_mates) > 1
        self._warn_unmatched_targets(modules, self.registry.names)
        #: collected steps left to tell whether the optimizer keeps Adam's moments (a shard may hold none)
        holds_parameters = not backend.sharded or backend.dtensors  # DTensors themselves, not flat copies
        self._optimizer_checks = OptimizerChecks(config, backend.sharded, holds_parameters, chunks)
        backend.prepare([entry.param for entry in self.registry.params], self.registry.grad)
        info = run_info("torch", torch.__version__, rank, world_size(), [shown_class(c) for c in chunks])
        self.core = MonitorCore(config, rank, pp_stage, group_mates, output_dir=output_dir, info=info)
        unended = UnendedStep(grad_acc_steps)  # one for the gradients and activations: said once
        self.grad_acc_steps = grad_acc_steps
        if config.wg_distribution:  # UnreducedGrads, or BucketGrads for Megatron
            counting = GradCounting(
                grad_acc_steps,
                self.ops,
                self.eps,
                config.monitor_mbs_grad,
                self.fail,
                last_micro_batch,
                unended,
            )
            self.grads = unreduced_source(chunks, backend, self.registry, counting)
            # the measured gradients are kept for reuse only where reuse can happen (one process,
            # torch's optimizer and .grad): elsewhere (DeepSpeed frees each gradient after its
            # hook) holding them would cost memory
            torch_grads = type(backend) is TorchBackend and not self.registry.main_grad
            self.grads.keep_measured = torch_grads and world_size() == 1
            self.grads.measure_at_pass_end = torch_grads and (
                world_size() == 1 or ddp_reduces_after_pass_end(ddp_wrappers)
            )
            self.grads.sum_micro_batches = backend.frees_micro_batch_grads
        self._rows = self._build_rows(tp_group, dp_group)
        #: with shard_reduce over DTensors: merges tensor-parallel pieces of activations and of
        #: unreduced gradients over their mesh
        tensor_parallel = config.shard_reduce and backend.dtensors and world_size() > 1
        self._tp_merge = TensorParallelMerge() if tensor_parallel else None
        if self._tp_merge is not None and hasattr(self.grads, "tags"):
            self.grads.merge = self._tp_merge
        merged = backend.sharded and config.shard_reduce
        counts = {part: len(index) for part, (index, _) in self._rows.items()}
        self._merges = MergeFailures(backend.shard_group, counts, self.ops, self.fail) if merged else None
        self.collectives = collectives
        if self.grads is not None:
            self._handles += self.grads.register()
        if config.xy_distribution:
            modules = select_modules(chunks, config, every=False)
            forward, backward = not config.backward_only, not config.forward_only
            self.activations = Activations(
                chunks, modules, self.ops, self.eps, forward, backward, self.fail, self._tp_merge, unended
            )
            self._handles += self.activations.register()
        if config.recording_l2_features:
            self.l2 = L2Features(chunks, config, self.fail, unended)
            self._handles += self.l2.register()
        self._register_recorders(chunks, StructureRecorder, stack_recorder)
        if collectives is not None:
            collectives.on_error = self.fail
            collectives.install()
        self.compiled_model = CompiledModel(chunks, given_compiled)
        self._handles += self.compiled_model.register()
        self.set_step(first_step)

    def set_step(self, step: int, renumbered: bool = False) -> None:
        super().set_step(step, renumbered)
        self.compiled_model.step_begins(step, self._hooks_measure_in_compiled_code())

    def remove(self) -> None:
        try:
            super().remove()
        finally:
            self.compiled_model.release()

    def _hooks_measure_in_compiled_code(self) -> bool:
        """Whether hooks that compiled code runs measure in this step (it then runs eagerly, for them
        to see its tensors): print_struct and stack_info until recorded, the others on collected steps."""
        attention = self.l2 is not None and bool(self.l2.attention) and self.l2.collect
        unsharded = getattr(self.grads, "uses_module_hooks", False) and self.grads.collect
        collected = (self.activations is not None and self.activations.collect) or attention or unsharded
        pending = self.structure is not None or (self.stacks is not None and not self.stacks.stacks)
        return pending or collected or (self.collectives is not None and self.collect)

    # -- attach-time tables ------------------------------------------------------------------

    def micro_batch_begins(self) -> None:
        """A trainer announces each micro-batch: activations, l2 and per-micro-batch gradients
        count micro-steps from it."""
        for part in (self.activations, self.l2):
            if part is not None:
                part.micro.announce()
        announce = getattr(self.grads, "announce", None)  # per-parameter hooks only
        if announce is not None:
            announce()

    def _build_rows(self, tp_group: Any, dp_group: Any) -> dict[str, tuple[list[int], RowSet]]:
        """Parameter index lists and row labels per data type, computed once."""
        params = self.registry.params
        # sharded optimizers: every data-parallel rank holds its own pieces, none is a duplicate
        dp_rank = None if self.backend.sharded else rank_in_group(dp_group)
        shards = [bool(getattr(p.param, "tensor_model_parallel", False)) for p in params]
        return param_row_tables(
            [p.vpp_stage for p in params],
            [p.name for p in params],
            self.rank,
            reduced_index(shards, dp_rank, rank_in_group(tp_group)),
            self.grads.task if self.grads is not None else PARAM_TASKS["grad_unreduced"],
        )

    # -- the step ----------------------------------------------------------------------------

    def before_update(self) -> None:
        """Optimizer pre-step: activations, gradients, mg_direction, parameters before the update."""
        if self.collect and self._optimizer_checks.first:
            self._guard("the checks of the optimizer", self._leave_out_what_describes_nothing)
        if not self._start_update():  # raises StructurePrinted when print_struct stops the run
            return
        cfg = self.config
        if self._wanted("grad_reduced", cfg.wg_distribution):
            reuse = self._reusable()
            self._guard("grad_reduced", self._submit_tensors, "grad_reduced", self.backend.grad, reuse)
        if hasattr(self.grads, "release"):
            self.grads.release()
        if self._wanted("other", cfg.mg_direction):
            self._guard("other", self._submit_mg_direction)
        if self._wanted("param_origin", cfg.param_distribution):
            self._guard("param_origin", self._submit_tensors, "param_origin", self.backend.value)

    def _leave_out_what_describes_nothing(self) -> None:
        params, names = [p.param for p in self.registry.params], [p.name for p in self.registry.params]
        self._failed.update(self._optimizer_checks.describing_nothing(self.backend, params, names))

    def after_update(self) -> None:
        """Optimizer post-step: moments and parameters after the update, then the step is written."""
        if not self.collect:
            return
        cfg = self.config
        moment = self.backend.moment
        if self._optimizer_checks.pending:  # not exp_avg's rows, whatever they say
            params = [p.param for p in self.registry.params]
            self._guard(
                "the checks of the optimizer", self._optimizer_checks.after_update, self.backend, params
            )
        for prefix in ("exp_avg", "exp_avg_sq"):
            if self._wanted(prefix, cfg.mv_distribution):
                self._guard(prefix, self._submit_tensors, prefix, lambda p, k=prefix: moment(p, k))
        if self._wanted("param_updated", cfg.param_distribution):
            self._guard("param_updated", self._submit_tensors, "param_updated", self.backend.value)
        if self._wanted("ur", self.update_ratio):
            self._guard("ur", self._submit_update_histograms)
        self._end_step()

    # -- merged parts (shard_reduce): a failure here reaches the merge's other ranks ------------

    def _wanted(self, part: str, switch: bool) -> bool:
        if self._merges is not None and switch and part in MERGED_PARTS:
            self._merges.pay(part)  # where the part's gather comes: the others may wait in it
        return super()._wanted(part, switch)

    def _guard(self, part: str, fn: Callable, *args: Any) -> None:
        merges = self._merges if part in MERGED_PARTS else None
        (super()._guard if merges is None else merges.run)(part, fn, *args)

    def fail(self, part: str, exc: BaseException) -> None:
        if part in ("actv", "actv_grad") and self._tp_merge is not None and self.activations is not None:
            self.activations.failed(part, exc)  # stays on: its hooks take collectives with the mesh
        else:
            super().fail(part, exc)

    # -- statistics --------------------------------------------------------------------------

    def _submit(
        self, prefix: str, rows: RowSet, matrix: torch.Tensor | np.ndarray, ops: tuple[str, ...] | None = None
    ) -> None:
        values, fetch = to_host(matrix) if isinstance(matrix, torch.Tensor) else (np.asarray(matrix), None)
        self._record(prefix, rows, values, ops, fetch)

    def _reusable(self) -> Any:
        """The unreduced-gradient source whose rows the reduced pass may reuse (``measured_rows``),
        or None. Never on an accelerator: comparing there would make the host wait for the device.
        Only where a gradient changed since is seen: one process, torch's own optimizers and
        ``.grad``, where in-place kernels bump the version and those that do not (a loss scaler's
        unscaling) rescale every gradient alike, which ``still_measured`` sees in one of them."""
        if not getattr(self.grads, "keep_measured", False):
            return None
        taken = getattr(self.grads, "taken_matrix", None)
        return self.grads if taken is not None and taken.device.type == "cpu" else None

    def _submit_tensors(
        self, prefix: str, tensor_of: Callable[[torch.nn.Parameter], Any], reuse: Any = None
    ) -> None:
        """Statistics of one tensor per monitored parameter (skipping parameters without one).

        ``reuse``: the unreduced-gradient source; a row it measured earlier this step is reused
        where it is the very same tensor, unchanged (``measured_rows``, ``still_measured``).
        """
        index, rows = self._rows[prefix]
        params = self.registry.params
        found = [tensor_of(params[i].param) for i in index]
        present = [position for position, tensor in enumerate(found) if tensor is not None]
        measured = index
        if len(present) != len(index):
            measured, found = [index[p] for p in present], [found[p] for p in present]
        if self.backend.sharded:
            self._submit_pieces(prefix, index, rows, found, present)
            return
        if len(present) != len(index):
            rows = self._same_rows[prefix].get(present, lambda: rows.take(present))
        earlier = reuse.measured_rows(measured, found) if reuse is not None else None
        known = [k for k, row in enumerate(earlier or ()) if row is not None]
        reused = reuse.taken_matrix[[earlier[k] for k in known]] if known else None
        if reused is None or not still_measured(reused, [found[k] for k in known], self.ops, self.eps):
            self._submit(prefix, rows, stat_matrix(found, self.ops, self.eps))
            return
        # rows measured earlier this step, merged in parameter order with those measured now
        fresh = [k for k, row in enumerate(earlier) if row is None]
        full = torch.empty((len(found), len(self.ops)), dtype=torch.float64, device=reused.device)
        full[known] = reused
        if fresh:
            full[fresh] = stat_matrix([found[k] for k in fresh], self.ops, self.eps).to(full.device)
        self._submit(prefix, rows, full)

    def _submit_pieces(
        self, prefix: str, index: list[int], rows: RowSet, tensors: list[torch.Tensor], present: list[int]
    ) -> None:
        """Sharded data: each row is this rank's piece with its element count, or (shard_reduce)
        the whole tensor merged over the shard group. ``tensors``: those of the parameters at
        positions ``present`` of ``index``."""
        ops = (*self.ops, *SHARD_COLUMNS)
        pieces = stat_matrix(tensors, self.ops, self.eps)
        counts = np.array([t.numel() for t in tensors], dtype=np.float64)
        if self.config.shard_reduce:
            full = torch.full(
                (len(index), len(self.ops)), float("nan"), dtype=torch.float64, device=pieces.device
            )
            full.index_copy_(0, on_device(present, torch.long, pieces.device), pieces)
            all_counts = np.zeros(len(index), dtype=np.float64)
            all_counts[present] = counts
            merged = shard_reduce(
                full, on_device(all_counts, torch.float64, pieces.device), self.ops, self.backend.shard_group
            )
            self._merges.gathered(prefix)
            self._submit(prefix, *held_rows(rows, merged), ops)
            return
        whole = np.array([self.backend.numel(self.registry.params[index[p]].param) for p in present])
        self._submit(prefix, rows.take(present), with_host_columns(pieces, piece_columns(counts, whole)), ops)

    def _unreduced_columns(self, index: list[int], matrix: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """Gradients that are DTensors (tensor parallelism) are measured on this rank's piece:
        their rows get the piece's element count and whether it is part of the tensor, or
        (shard_reduce) are merged into the whole tensor over their mesh."""
        merged = False
        if self._tp_merge is not None and self.grads.merge is not None:
            matrix = matrix.clone()
            tags = [self.grads.tags.get(i) for i in index]
            merged = self._tp_merge.merge([([str(i) for i in index], matrix, tags)], self.ops)
        pieces = getattr(self.grads, "pieces", None)  # Megatron's bucket source has none
        if not pieces:
            return matrix, None
        params = self.registry.params
        numels = [pieces.get(i) or (params[i].param.numel(),) * 2 for i in index]  # plain ones: whole
        if merged:  # every tagged row is whole now
            numels = [
                (whole, whole) if self.grads.tags.get(i) else (local, whole)
                for i, (local, whole) in zip(index, numels)
            ]
        sizes = np.array(numels, dtype=np.float64).reshape(-1, 2)  # (local, whole) per row
        return with_host_columns(matrix, piece_columns(sizes[:, 0], sizes[:, 1])), (*self.ops, *SHARD_COLUMNS)

    def _unreduced_switched_off(self) -> None:
        """grad_unreduced failed here earlier: its merge's header still goes to the mesh mates,
        which would otherwise wait for it."""
        if self._tp_merge is not None and getattr(self.grads, "merge", None) is not None:
            self._tp_merge.merge([], self.ops)

    def _submit_update_histograms(self) -> None:
        merge = self.backend.sharded and self.config.shard_reduce
        found = update_histograms(self.backend, [e.param for e in self.registry.params], merge)
        if found is None:
            return
        positions, counts = found
        params = self.registry.params
        labels = [(params[i].vpp_stage, params[i].name) for i in positions]
        submit_histograms(self.core, self._step, self.rank, labels, counts)

    def _submit_collectives(self) -> None:
        for rows, ops, values in self.collectives.take(self._step, self.rank):
            self._submit("comm", rows, values, ops)

    def _submit_mg_direction(self) -> None:
        """Share of gradient signs agreeing with exp_avg before this update (1.0 without state).

        Sharded back-ends: the share of this rank's piece, written with the piece's element count
        (the count-weighted mean of the pieces' shares is the whole tensor's share), or merged.
        """
        index, rows = self._rows["other"]
        params = [self.registry.params[i].param for i in index]
        values, present, device = sign_agreement(self.backend, params)
        if self.backend.sharded:
            self._submit_shares(index, rows, device_scalars(values, device), present)
            return
        if len(present) != len(index):
            rows = rows.take([position for position, _ in present])
        if all(isinstance(v, float) for v in values):  # host values: one vectorised pass
            matrix = torch.from_numpy(scalar_matrix(np.array(values, dtype=np.float64), self.ops, self.eps))
        else:
            matrix = stat_matrix(device_scalars(values, device), self.ops, self.eps)
        self._submit("other", rows, matrix)

    def _submit_shares(
        self, index: list[int], rows: RowSet, values: list[torch.Tensor], present: list[tuple[int, int]]
    ) -> None:
        """mg_direction of pieces: each share with its count, or (shard_reduce) the merged share."""
        ops = (*self.ops, *SHARD_COLUMNS)
        positions = [position for position, _ in present]
        counts = np.array([count for _, count in present], dtype=np.float64)
        if not self.config.shard_reduce:
            whole = np.array([self.backend.numel(self.registry.params[index[p]].param) for p in positions])
            shares = stat_matrix(values, self.ops, self.eps)
            self._submit(
                "other", rows.take(positions), with_host_columns(shares, piece_columns(counts, whole)), ops
            )
            return
        device = values[0].device if values else torch.device("cpu")
        shares = torch.full((len(index), 1), float("nan"), dtype=torch.float64, device=device)
        all_counts = np.zeros(len(index), dtype=np.float64)
        if values:
            shares.index_copy_(0, on_device(positions, torch.long, device), torch.stack(values)[:, None])
            all_counts[positions] = counts
        all_counts = on_device(all_counts, torch.float64, device)
        gathered = shard_reduce(shares, all_counts, ("mean",), self.backend.shard_group)
        self._merges.gathered("other")
        rows, merged = held_rows(rows, gathered)
        whole = stat_matrix(list(torch.from_numpy(merged[:, 0])), self.ops, self.eps).numpy()
        self._submit("other", rows, np.concatenate([whole, merged[:, 1:]], axis=1), ops)
