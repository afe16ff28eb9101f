"""One attached TrainerMon on a PyTorch model: hooks, the step lifecycle, StepRecords.

Only instance-level hooks are used: optimizer step pre/post hooks, parameter gradient hooks
(and module hooks in later issues). Nothing is patched on a class or set on the user's objects.
Every hook is gated on one flag decided before the step's forward pass, and every hook body is
guarded: a failure is logged once with its cause and switches that data type off.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from adapters.torch.dist import global_rank, pipeline_info, rank_in_group
from adapters.torch.grads import UnreducedGrads
from adapters.torch.optim import hookable_optimizer, optimizer_backend
from adapters.torch.params import ParamRegistry
from adapters.torch.stats import stat_matrix
from monitor.config import MonitorConfig
from monitor.core import MonitorCore
from monitor.record import RowSet, StepRecord
from monitor.schedule import Schedule, rank_enabled

logger = logging.getLogger("trainmon")

#: config switches that later issues implement; until then they are reported, not ignored silently.
_NOT_YET = ("xy_distribution", "print_struct", "ur_distribution", "stack_info", "recording_l2_features")


def to_host(matrix: torch.Tensor) -> tuple[np.ndarray | None, Any]:
    """Start the one device-to-host copy of a step's statistics: ``(values, None)`` or ``(None, fetch)``."""
    if matrix.device.type == "cpu":
        return matrix.numpy(), None
    if matrix.device.type == "cuda":
        host = torch.empty(matrix.shape, dtype=matrix.dtype, pin_memory=True)
        host.copy_(matrix, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def fetch() -> np.ndarray:
            done.synchronize()
            return host.numpy()

        return None, fetch
    return matrix.cpu().numpy(), None


class TorchSession:
    """Hooks of one TrainerMon on one PyTorch model and optimizer."""

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
        early_collectives: Any = None,
    ) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, torch.nn.Module):
                raise TypeError(
                    f"set_monitor: model[{i}]: expected a torch.nn.Module, got {type(chunk).__name__}"
                )
        if optimizer is None:
            raise ValueError("set_monitor: optimizer: required (its step marks the end of a training step)")
        self.config = config
        self.optimizer = hookable_optimizer(optimizer)
        self.backend = optimizer_backend(self.optimizer)
        self.rank = global_rank()
        self.step = start_iteration
        self.schedule = Schedule.from_config(config)
        self.active = False
        self.core: MonitorCore | None = None
        self._chunks = chunks
        self.grads: UnreducedGrads | None = None
        self.collectives: Any = None
        self._handles: list = []
        self._cleanup_handles: list = []
        self._post_hook: Any = None
        self._failed: set[str] = set()
        self._call_id = 0
        self._collect = False
        for key in _NOT_YET:
            if getattr(config, key):
                logger.warning("trainmon: %s is not supported yet by this version and is ignored", key)
        if not rank_enabled(config, self.rank):
            logger.info("trainmon: rank %d is not in module_ranks; nothing is monitored here", self.rank)
            return
        pp_stage, mates = pipeline_info(process_group)
        self.registry = ParamRegistry(chunks, config, params_have_main_grad)
        self.core = MonitorCore(config, self.rank, pp_stage, mates)
        self.ops, self.eps = config.ops, config.eps
        self._rows = self._build_rows(tp_group, dp_group)
        if config.wg_distribution:
            self.grads = UnreducedGrads(
                self.registry, grad_acc_steps, self.ops, self.eps, config.monitor_mbs_grad, self._fail
            )
            self._handles += self.grads.register()
        if config.cc_distribution.enable:
            self.collectives = self._collectives(early_collectives)
        self._handles.append(self.optimizer.register_step_pre_hook(self._before_update))
        self._post_hook = self.optimizer.register_step_post_hook(self._after_update)
        self._set_collect(self.schedule.wants(self.step))
        self.active = True
        kinds = [
            k
            for k in ("wg_distribution", "mv_distribution", "param_distribution", "mg_direction")
            if getattr(config, k)
        ]
        logger.info(
            "trainmon: monitoring %d parameters (%s) on rank %d, output %s",
            len(self.registry),
            ", ".join(kinds) or "nothing selected",
            self.rank,
            self.core.output_dir or "in memory (format api)",
        )

    # -- attach-time tables ------------------------------------------------------------------

    def _build_rows(self, tp_group: Any, dp_group: Any) -> dict[str, tuple[list[int], RowSet]]:
        """Parameter index lists and row labels per data type, computed once."""
        everything = list(range(len(self.registry)))
        dp_rank, tp_rank = rank_in_group(dp_group), rank_in_group(tp_group)
        reduced = [
            i
            for i in everything
            if dp_rank in (None, 0)
            and (
                tp_rank in (None, 0) or getattr(self.registry.params[i].param, "tensor_model_parallel", False)
            )
        ]
        tables = {
            "grad_reduced": (reduced, "post_grad"),
            "param_origin": (everything, "param_origin"),
            "param_updated": (everything, "param_updated"),
            "exp_avg": (everything, "exp_avg"),
            "exp_avg_sq": (everything, "exp_avg_sq"),
            "other": (everything, "mg_direction"),
            "grad_unreduced": (everything, "pre_grad" if self.registry.main_grad else "acc_grad"),
        }
        return {
            prefix: (index, self.registry.rows(self.rank, task, index))
            for prefix, (index, task) in tables.items()
        }

    # -- the step lifecycle ------------------------------------------------------------------

    def _collectives(self, early: Any) -> Any:
        """The collective wrapper: the one TrainerMon installed at construction, or a new one."""
        from adapters.torch.collectives import CollectiveMonitor

        monitor = early if early is not None else CollectiveMonitor(self.config, on_error=self._fail)
        monitor.install()
        self._handles.append(monitor)  # removed with the other hooks: restores the originals
        return monitor

    def _set_collect(self, collect: bool) -> None:
        self._collect = collect
        if self.collectives is not None:
            self.collectives.begin_step(self.step, collect and "comm" not in self._failed)
        if self.grads is not None:
            self.grads.collect = collect and "grad_unreduced" not in self._failed

    def _wanted(self, part: str, switch: bool) -> bool:
        return switch and part not in self._failed

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer pre-step hook: reduced gradients, mg_direction, parameters before the update."""
        if not self._collect:
            return
        cfg = self.config
        if self._wanted("grad_unreduced", cfg.wg_distribution):
            self._guard("grad_unreduced", self._submit_unreduced)
        if self._wanted("grad_reduced", cfg.wg_distribution):
            self._guard("grad_reduced", self._submit_tensors, "grad_reduced", self.registry.grad)
        if self._wanted("other", cfg.mg_direction):
            self._guard("other", self._submit_mg_direction)
        if self._wanted("param_origin", cfg.param_distribution):
            self._guard("param_origin", self._submit_tensors, "param_origin", lambda p: p.detach())

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer post-step hook: moments and parameters after the update; end of the step."""
        try:
            if self._collect:
                cfg = self.config
                for prefix in ("exp_avg", "exp_avg_sq"):
                    if self._wanted(prefix, cfg.mv_distribution):
                        self._guard(
                            prefix,
                            self._submit_tensors,
                            prefix,
                            lambda p, k=prefix: self.backend.moment(p, k),
                        )
                if self._wanted("param_updated", cfg.param_distribution):
                    self._guard("param_updated", self._submit_tensors, "param_updated", lambda p: p.detach())
                if self.collectives is not None:
                    self._guard("comm", self._submit_collectives)
                self.core.end_step(self.step)
                self.schedule.mark_collected()
        except Exception as exc:
            self._fail("step end", exc)
        finally:
            self.step += 1
            self._call_id = 0
            if self.grads is not None:
                self.grads.reset()
            self._set_collect(self.schedule.wants(self.step))
            if self.schedule.finished:
                self._finish_from_post_hook()

    # -- statistics --------------------------------------------------------------------------

    def _submit(
        self, prefix: str, rows: RowSet, matrix: torch.Tensor | np.ndarray, ops: tuple[str, ...] | None = None
    ) -> None:
        values, fetch = to_host(matrix) if isinstance(matrix, torch.Tensor) else (np.asarray(matrix), None)
        n = len(rows)
        call_ids = np.arange(self._call_id, self._call_id + n)
        self._call_id += n
        self.core.submit(StepRecord(prefix, self.step, ops or self.ops, rows, values, call_ids, fetch))

    def _submit_tensors(self, prefix: str, tensor_of: Any) -> None:
        """Statistics of one tensor per monitored parameter (skipping parameters without one)."""
        index, rows = self._rows[prefix]
        tensors, present = [], []
        for position, i in enumerate(index):
            tensor = tensor_of(self.registry.params[i].param)
            if tensor is not None:
                tensors.append(tensor.detach())
                present.append(position)
        if len(present) != len(index):
            rows = rows.take(present)
        self._submit(prefix, rows, stat_matrix(tensors, self.ops, self.eps))

    def _submit_unreduced(self) -> None:
        index, micro, matrix = self.grads.take()
        _, base_rows = self._rows["grad_unreduced"]
        if micro is None:
            rows = base_rows.take(index)
        else:
            task = base_rows.tags[0].rsplit("/", 1)[-1] if len(base_rows) else "acc_grad"
            rows = RowSet.build(
                [base_rows.vpp_stages[i] for i in index],
                [base_rows.names[i] for i in index],
                self.rank,
                task,
                micro,
            )
        self._submit("grad_unreduced", rows, matrix)

    def _submit_collectives(self) -> None:
        for rows, ops, values in self.collectives.take(self.step, self.rank):
            self._submit("comm", rows, values, ops)

    def _submit_mg_direction(self) -> None:
        """Share of gradient signs agreeing with exp_avg before this update (1.0 without state)."""
        index, rows = self._rows["other"]
        values, present = [], []
        for position, i in enumerate(index):
            param = self.registry.params[i].param
            grad = self.registry.grad(param)
            if grad is None:
                continue
            moment = self.backend.moment(param, "exp_avg")
            if moment is None:
                values.append(torch.ones((), dtype=torch.float64, device=grad.device))
            elif moment.shape != grad.shape or moment.numel() == 0:
                values.append(torch.full((), float("nan"), dtype=torch.float64, device=grad.device))
            else:
                agreement = (torch.sign(grad.detach()) * torch.sign(moment)).sum(dtype=torch.float64)
                values.append((agreement / moment.numel() + 1.0) / 2.0)
            present.append(position)
        if len(present) != len(index):
            rows = rows.take(present)
        self._submit("other", rows, stat_matrix(values, self.ops, self.eps))

    # -- failures and removal ----------------------------------------------------------------

    def _guard(self, part: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._fail(part, exc)

    def _fail(self, part: str, exc: BaseException) -> None:
        """Log a failure once with its cause and switch that part off; the training goes on."""
        if part in self._failed:
            return
        self._failed.add(part)
        if part == "grad_unreduced" and self.grads is not None:
            self.grads.collect = False
        logger.error(
            "trainmon: %s failed and is switched off (%r); training continues", part, exc, exc_info=exc
        )

    def _finish_from_post_hook(self) -> None:
        """collect_times reached inside the optimizer's post-hook loop.

        Torch iterates that hook dict while we run, so our post hook cannot be removed here; it is
        made inert and removed at the next forward of the model (or by stop()).
        """
        self._remove_hooks(keep_post_hook=True)
        if self._post_hook is not None:

            def cleanup(module: Any, args: Any) -> None:
                self._remove_post_hook()
                for handle in self._cleanup_handles:
                    handle.remove()
                self._cleanup_handles = []

            self._cleanup_handles = [chunk.register_forward_pre_hook(cleanup) for chunk in self._chunks]

    def _remove_post_hook(self) -> None:
        if self._post_hook is not None:
            self._post_hook.remove()
            self._post_hook = None

    def _remove_hooks(self, keep_post_hook: bool = False) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not keep_post_hook:
            self._remove_post_hook()
            for handle in self._cleanup_handles:
                handle.remove()
            self._cleanup_handles = []
        self._collect = False
        if self.grads is not None:
            self.grads.collect = False
        if self.active:
            self.active = False
            if self.core is not None:
                self.core.close()
            logger.info("trainmon: monitoring stopped after %d collected steps", self.schedule.collected)

    def stop(self) -> None:
        """Remove every hook and close the outputs (idempotent)."""
        self._remove_hooks()
