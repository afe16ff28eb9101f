"""DeepSpeed back-ends: ZeRO stages 0 to 3, located through DeepSpeed's own maps.

What ``engine.optimizer`` is decides the back-end (the stage is read from the objects, never
from a flag). Users may pass the engine, ``engine.optimizer`` or the torch optimizer inside it.

=================================  ========================  ======================================
engine.optimizer                   when                      numbers per monitored parameter
=================================  ========================  ======================================
the torch optimizer itself         stage 0, fp32             generic back-end (optim.py)
``FP16_UnfusedOptimizer``          stage 0, bf16             reduced ``p.grad``; its fp32 copy;
                                                             moments of that copy (not sharded)
``DeepSpeedZeroOptimizer``         stages 1 and 2            this rank's fragment (``_hp_mapping``)
``BF16_Optimizer``                 bf16 with fp32 gradient   of the flat fp32 partition, of the
                                   accumulation (ZeRO-1)     reduced gradient and of the moments
``DeepSpeedZeroOptimizer_Stage3``  stage 3                   this rank's partition (``grad_position``)
=================================  ========================  ======================================

Sharded back-ends hand out views of DeepSpeed's own tensors (never a copy, never a gather) and
set ``shard_group`` to the data-parallel group the partitions are cut over. Maps are built once
per ``prepare`` and keyed by the parameter object, so ``targets`` cannot shift them (msprobe
maps by position, which a target list shifts).

Importing this module registers the back-ends; ``optimizer_backend`` imports it once DeepSpeed
is imported by the application. DeepSpeed itself is never imported here.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from adapters.torch.method_wrap import MethodWrap
from adapters.torch.optim import BACKENDS, TorchBackend, unwrap_chain


def _is_deepspeed(obj: Any) -> bool:
    return any(cls.__module__.split(".", 1)[0] == "deepspeed" for cls in type(obj).__mro__)


def deepspeed_owner(optimizer: Any) -> Any:
    """The DeepSpeed object that wraps a bare torch optimizer (``engine.optimizer.optimizer``), else
    ``optimizer`` unchanged.

    A torch optimizer holds no reference to its wrapper, so the wrapper is found once, at attach
    time, among the optimizer's referrers (two passes over the garbage collector's objects;
    nothing is modified).
    A ZeRO wrapper is preferred to the engine, which names the optimizer directly only in stage 0.
    """
    if not isinstance(optimizer, torch.optim.Optimizer) or any(map(_is_deepspeed, unwrap_chain(optimizer))):
        return optimizer
    referrers = gc.get_referrers(optimizer)
    dicts = [r for r in referrers if isinstance(r, dict)]  # instance __dict__s: find their instances
    owners = [r for r in referrers if not isinstance(r, dict)]
    if dicts:
        ids = {id(d) for d in dicts}
        owners += [o for o in gc.get_referrers(*dicts) if id(getattr(o, "__dict__", None)) in ids]
    owners = [o for o in owners if _is_deepspeed(o) and getattr(o, "optimizer", None) is optimizer]
    owners.sort(key=lambda o: isinstance(o, torch.nn.Module))
    return owners[0] if owners else optimizer


class DeepSpeedBackend(TorchBackend):
    """Common part: the wrapper's ``step`` marks the training step; the torch optimizer inside
    holds the moments (keyed by DeepSpeed's fp32 tensors)."""

    def __init__(self, wrapper: Any) -> None:
        super().__init__(wrapper)  # self.optimizer: the torch optimizer inside
        self.wrapper = wrapper
        config = getattr(wrapper, "loss_scale_config", None)  # FP16_Optimizer's; ZeRO's own attribute
        dynamic = getattr(wrapper, "dynamic_loss_scale", getattr(config, "dynamic_loss_scale", False))
        #: fp16 with a dynamic loss scale: a step that finds an overflow (its ``overflow`` flag)
        #: skips the update while the scale is lowered, which the first steps of a run do by design
        self.loss_scaled = dynamic is True

    def overflowed(self) -> bool:
        return bool(getattr(self.wrapper, "overflow", False))

    def register_step_hooks(self, before: Callable, after: Callable) -> list:
        """Wrap the DeepSpeed wrapper's own ``step`` on the instance (restored by ``remove()``).

        Not hooks on the torch optimizer inside: stages 1/2 step it once per parameter group and
        stage 3 once per sub-group, each time after that group's gradient has been flattened,
        unscaled, clipped in place and its reduced gradient released, so no single call sees every
        reduced gradient; and on an overflow (a NaN or Inf gradient) DeepSpeed skips it, so the
        step the anomaly detector exists for would go unrecorded and the step counter would drift
        from the engine's. The wrapper's ``step`` is exactly one training step.
        """
        return [MethodWrap(self.wrapper, "step", before, after)]

    def _state(self, flat: torch.Tensor, key: str) -> torch.Tensor | None:
        state = self.optimizer.state.get(flat)
        value = state.get(key) if state else None
        return value if isinstance(value, torch.Tensor) else None


class UnfusedBackend(DeepSpeedBackend):
    """Stage 0 with bf16 (``FP16_UnfusedOptimizer``): every rank holds whole tensors; the optimizer
    updates an fp32 copy of each model parameter."""

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        super().prepare(params, local_grad)
        wanted = set(params)
        self._master = {
            p: copy
            for model, master in zip(self.wrapper.fp16_groups, self.wrapper.fp32_groups)
            for p, copy in zip(model, master)
            if p in wanted
        }

    def value(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self._master.get(param)

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        master = self._master.get(param)
        return None if master is None else self._state(master, key)

    def state_owner(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
        master = self._master.get(param)
        return None if master is None else (self.optimizer, master)


@dataclass(frozen=True)
class _Piece:
    """Where one parameter's piece lives on this rank."""

    group: int  # parameter group (stages 1/2) or sub-group (stage 3)
    start: int  # offset in the group's flat fp32 partition
    numel: int  # elements of the piece (padding excluded)
    grad_index: int  # index in DeepSpeed's per-group gradient list
    lp_start: int = 0  # offset of the piece inside the flattened parameter (stages 1/2)


class ShardedBackend(DeepSpeedBackend):
    """Common part of the sharded back-ends: values and moments are views of the flat fp32
    partitions and of their optimizer state."""

    sharded = True

    def __init__(self, wrapper: Any) -> None:
        super().__init__(wrapper)
        self.shard_group = wrapper.dp_process_group
        self._pieces: dict[torch.nn.Parameter, _Piece] = {}

    def _flats(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def value(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        piece = self._pieces.get(param)
        return None if piece is None else self._flats()[piece.group].narrow(0, piece.start, piece.numel)

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        piece = self._pieces.get(param)
        if piece is None:
            return None
        state = self._state(self._flats()[piece.group], key)
        return None if state is None else state.narrow(0, piece.start, piece.numel)

    def state_owner(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
        piece = self._pieces.get(param)
        return None if piece is None else (self.optimizer, self._flats()[piece.group])


class FragmentBackend(ShardedBackend):
    """ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: each parameter's fragment in
    this rank's flat fp32 partition, from DeepSpeed's ``param._hp_mapping`` (None: no piece here).

    The reduced gradient is read where DeepSpeed's own ``safe_get_full_grad`` reads it: entry
    ``param._index_in_param_group`` of the mapping's gradient list (ZeRO-1/2: the fragment itself;
    BF16_Optimizer: the whole parameter's reduced gradient, of which the fragment is taken).
    """

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        super().prepare(params, local_grad)
        self._mappings, self._pieces = {}, {}
        for param in params:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                continue
            hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
            self._mappings[param] = mapping
            self._pieces[param] = _Piece(
                mapping.param_group_index, hp.start, hp.numel, param._index_in_param_group, lp.start
            )

    @property
    def frees_micro_batch_grads(self) -> bool:
        """ZeRO-2 (partitioned gradients), ZeRO-1 with a separate fp32 accumulation buffer and
        BF16_Optimizer reduce each micro-batch's gradient into their own buffers and free it;
        plain ZeRO-1 lets ``.grad`` accumulate until the step."""
        wrapper = self.wrapper
        if not hasattr(wrapper, "partition_gradients"):  # BF16_Optimizer
            return True
        return bool(wrapper.partition_gradients or getattr(wrapper, "use_separate_grad_accum", False))

    def _flats(self) -> list[torch.Tensor]:
        wrapper = self.wrapper  # ZeRO-1/2, else BF16_Optimizer
        if hasattr(wrapper, "single_partition_of_fp32_groups"):
            return wrapper.single_partition_of_fp32_groups
        return wrapper.fp32_groups_flat_partition

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        piece = self._pieces.get(param)
        if piece is None:
            return None
        try:
            fragment = self._mappings[param].get_lp_grad_fragment(piece.grad_index).reshape(-1)
        except ValueError:  # DeepSpeed: no reduced gradient now (no backward since the last step)
            return None
        if fragment.numel() != piece.numel:  # a whole parameter's gradient: take this rank's piece
            fragment = fragment.narrow(0, piece.lp_start, piece.numel)
        return fragment


class Stage3Backend(ShardedBackend):
    """ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): each parameter's partition, located by
    ``grad_position[param id] = (sub-group, offset, partition size)``; the last rank's partition
    ends in padding, which is cut off. The reduced gradient is the sub-group's entry in
    ``averaged_gradients``, filled after the last backward of the step."""

    collectives_caveat = (
        "DeepSpeed ZeRO-3 pads the last rank's partition of each parameter with memory it never "
        "writes (torch.empty), and its all-gathers and reduce-scatters carry that padding: their "
        "comm rows' min, max, norm, mean and nans include whatever it holds (huge values, NaN), "
        "which is not the model's"
    )

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        super().prepare(params, local_grad)
        wrapper = self.wrapper
        index = {id(p): i for group in wrapper.fp16_groups for i, p in enumerate(group)}
        self._pieces = {}
        for param in params:
            if not hasattr(param, "ds_id"):  # not a ZeRO-3 parameter
                continue
            position = wrapper.grad_position.get(wrapper.get_param_id(param))
            if position is None:  # not in this optimizer
                continue
            group, start, size = position
            rank = dist.get_rank(group=param.ds_process_group)
            numel = max(0, min(size, param.ds_numel - rank * size))
            if numel:
                self._pieces[param] = _Piece(group, start, numel, index[id(param)])

    #: each micro-batch's gradient is reduce-scattered into the partitions and freed
    frees_micro_batch_grads = True

    def _flats(self) -> list[torch.Tensor]:
        return self.wrapper.fp32_partitioned_groups_flat

    def numel(self, param: torch.nn.Parameter) -> int:
        return getattr(param, "ds_numel", None) or param.numel()

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        piece = self._pieces.get(param)
        if piece is None:
            return None
        grads = self.wrapper.averaged_gradients.get(piece.group)
        if grads is None:
            return None
        return grads[piece.grad_index].reshape(-1).narrow(0, 0, piece.numel)


BACKENDS.update(
    {
        "FP16_UnfusedOptimizer": UnfusedBackend,
        "DeepSpeedZeroOptimizer": FragmentBackend,
        "BF16_Optimizer": FragmentBackend,
        "DeepSpeedZeroOptimizer_Stage3": Stage3Backend,
    }
)
