"""Optimizer back-ends for megatron-core: FP32Optimizer, Float16OptimizerWithFloat16Params,
DistributedOptimizer, and ChainedOptimizer over any of them.

Imported lazily by ``optimizer_backend`` when a class of the optimizer chain comes from the
``megatron`` package; this module itself never imports megatron. Every map from a model
parameter to its master copy, shard range and optimizer state is built once, in ``prepare``,
from the optimizer's own tables, built once per ``prepare``:

- FP32Optimizer: the model parameter is what the inner torch optimizer updates.
- Float16OptimizerWithFloat16Params: ``float16_groups`` zipped with ``fp32_from_float16_groups``
  gives each bf16/fp16 parameter's fp32 master copy; ``fp32_from_fp32_groups`` are their own.
- DistributedOptimizer: ``model_float16_groups`` / ``model_fp32_groups`` zipped with
  ``shard_fp32_from_float16_groups`` / ``shard_fp32_groups`` give each owned parameter's fp32
  shard; ``model_param_gbuf_map`` and ``gbuf_ranges[...]["param_map"]`` its element range. Only
  that range of ``main_grad`` is reduced on this rank, so only that range is read.

Step hooks: Megatron optimizers are not torch optimizers and have no hook API. Their ``step``
prepares the gradients in place (copies to fp32 masters, unscales, clips ``main_grad`` itself
for FP32Optimizer) before the inner torch optimizers run, and skips them on inf/nan, so hooks on
the inner torch optimizers would fire several times per step and see clipped gradients. The one
place that sees the reduced, unclipped gradient once per step is the call of ``step`` on the
object the user holds: that bound method is wrapped on the instance (never on the class) and
restored exactly on removal (``MethodWrap``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from adapters.torch.method_wrap import MethodWrap
from adapters.torch.optim import BACKENDS, TorchBackend, optimizer_step_count

logger = logging.getLogger("trainmon")


class MegatronBackend(TorchBackend):
    """One Megatron optimizer (``megatron``) and the torch optimizer inside it (``inner``).

    Parameters this optimizer does not update (or, sharded, holds no piece of) have no
    gradient, value or moment here (None).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.megatron = optimizer
        self.inner: torch.optim.Optimizer | None = getattr(optimizer, "optimizer", None)
        self._local_grad: Callable[[torch.nn.Parameter], torch.Tensor | None] = lambda p: None
        #: model parameter -> the tensor the inner optimizer updates for it (master copy / shard).
        self._main: dict[torch.nn.Parameter, torch.Tensor] = {}
        #: fp16 with a dynamic loss scale skips the update of a step whose gradients overflow
        #: while the scale comes down
        self.loss_scaled = _dynamic_scale(optimizer)
        self._step: MethodWrap | None = None

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        self._local_grad = local_grad
        wanted = set(params)
        self._main = {p: main for p, main in self._pairs() if p in wanted and main is not None}

    def _pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """(model parameter, tensor the inner optimizer updates) for every parameter it updates."""
        if self.inner is None:
            return []
        return [(p, p) for group in self.inner.param_groups for p in group["params"]]

    def owns(self, param: torch.nn.Parameter) -> bool:
        """Whether this optimizer is the one responsible for ``param`` (held here or not)."""
        return param in self._main

    def register_step_hooks(self, before: Callable, after: Callable) -> list:
        self._step = MethodWrap(self.megatron, "step", before, after)
        return [self._step]

    def overflowed(self) -> bool:
        return _update_skipped(self._step)

    def step_count(self) -> int | None:
        return optimizer_step_count(self.inner) if self.inner is not None else None

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self._local_grad(param) if param in self._main else None

    def value(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        main = self._main.get(param)
        return main.detach() if main is not None else None

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        main = self._main.get(param)
        if main is None or self.inner is None:
            return None
        state = self.inner.state.get(main)
        value = state.get(key) if state else None
        return value if isinstance(value, torch.Tensor) else None

    def state_owner(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
        main = self._main.get(param)
        return None if main is None or self.inner is None else (self.inner, main)


class FP32Backend(MegatronBackend):
    """FP32Optimizer: the inner torch optimizer updates the model parameters themselves."""


class Float16Backend(MegatronBackend):
    """Float16OptimizerWithFloat16Params: bf16/fp16 parameters are updated through fp32 masters."""

    def _pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        opt = self.megatron
        if self.inner is None:
            return []
        pairs = []
        for models, masters in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
            pairs += zip(models, masters, strict=True)
        for group in opt.fp32_from_fp32_groups:
            pairs += [(p, p) for p in group]
        return pairs


class DistributedBackend(MegatronBackend):
    """DistributedOptimizer: each rank updates fp32 shards, one contiguous range of a parameter.

    ``grad`` is ``main_grad`` over that range (the only part reduced on this rank), ``value`` the
    fp32 shard, moments the shard's state; a parameter with no piece on this rank gives None.
    """

    sharded = True

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self._range: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self._covered: set[torch.nn.Parameter] = set()

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        super().prepare(params, local_grad)
        opt = self.megatron
        self._range = {}
        for param in self._main:
            gbuf, dtypes, bucket = opt.model_param_gbuf_map[param]
            piece = opt.gbuf_ranges[gbuf][dtypes][bucket]["param_map"][param]["param"]
            self._range[param] = (piece.start, piece.end)
        wanted = set(params)
        self._covered = {p for buffer in opt.buffers for p in buffer.params if p in wanted}

    def _pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        opt = self.megatron
        pairs = []
        for models, shards in (
            (opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
            (opt.model_fp32_groups, opt.shard_fp32_groups),
        ):
            for model_group, shard_group in zip(models, shards, strict=True):
                pairs += zip(model_group, shard_group, strict=True)
        return pairs

    def owns(self, param: torch.nn.Parameter) -> bool:
        return param in self._covered

    @property
    def shard_group(self) -> Any:
        """The data-parallel group over which this optimizer's buffers are sharded."""
        return _one_group([buffer.data_parallel_group for buffer in self.megatron.buffers])

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        piece = self._range.get(param)
        if piece is None:
            return None
        full = self._local_grad(param)
        return None if full is None else full.reshape(-1)[piece[0] : piece[1]]


class ChainedBackend(TorchBackend):
    """ChainedOptimizer: one back-end per chained optimizer; each parameter answered by its owner."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.parts: list[MegatronBackend] = [_part_backend(o) for o in optimizer.chained_optimizers]
        self._owner: dict[torch.nn.Parameter, MegatronBackend] = {}
        self.loss_scaled = any(part.loss_scaled for part in self.parts)
        self._step: MethodWrap | None = None

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        for part in self.parts:
            part.prepare(params, local_grad)
        self._owner = {}
        for param in params:
            owner = next((part for part in self.parts if part.owns(param)), None)
            if owner is not None:
                self._owner[param] = owner

    @property
    def sharded(self) -> bool:  # type: ignore[override]
        return any(part.sharded for part in self.parts)

    @property
    def shard_group(self) -> Any:
        return _one_group([part.shard_group for part in self.parts if part.sharded])

    def register_step_hooks(self, before: Callable, after: Callable) -> list:
        self._step = MethodWrap(self.optimizer, "step", before, after)
        return [self._step]

    def overflowed(self) -> bool:
        return _update_skipped(self._step)

    def step_count(self) -> int | None:
        return next((c for c in (part.step_count() for part in self.parts) if c is not None), None)

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        owner = self._owner.get(param)
        return owner.grad(param) if owner is not None else None

    def value(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        owner = self._owner.get(param)
        return owner.value(param) if owner is not None else None

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        owner = self._owner.get(param)
        return owner.moment(param, key) if owner is not None else None

    def state_owner(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
        owner = self._owner.get(param)
        return owner.state_owner(param) if owner is not None else None


def _update_skipped(step: MethodWrap | None) -> bool:
    """Whether the step that just returned skipped its update: Megatron's ``step`` returns
    ``(update_successful, grad_norm, num_zeros)``, False first when its scaler found an Inf/NaN
    (``found_inf``, agreed over the model-parallel ranks). Read from that plain bool, never from
    the ``found_inf`` tensor, whose read would wait for the device."""
    result = step.last_result if step is not None else None
    return isinstance(result, tuple) and len(result) > 0 and result[0] is False


def _dynamic_scale(optimizer: Any) -> bool:
    """Whether the optimizer's gradient scaler is Megatron's dynamic one (fp16). Under a constant
    scale an overflow skips the update too, but nothing lowers the scale: that is a fault."""
    scaler = getattr(optimizer, "grad_scaler", None)
    return any(cls.__name__ == "DynamicGradScaler" for cls in type(scaler).__mro__)


def _one_group(groups: list[Any]) -> Any:
    """The one process group shared by all pieces.

    Raises:
        RuntimeError: pieces are sharded over different groups (e.g. dense and expert optimizers
            of a mixture-of-experts model), which one ``shard_reduce`` cannot merge.
    """
    distinct = list({id(g): g for g in groups}.values())
    if len(distinct) > 1:
        raise RuntimeError(
            "shard_reduce: the optimizer's shards live in different data-parallel groups; "
            "record the pieces instead (shard_reduce: false)"
        )
    return distinct[0] if distinct else None


#: Megatron optimizer class name -> back-end for it (also inside a ChainedOptimizer).
_PARTS: dict[str, type] = {
    "DistributedOptimizer": DistributedBackend,
    "Float16OptimizerWithFloat16Params": Float16Backend,
    "FP32Optimizer": FP32Backend,
}


def _part_backend(optimizer: Any) -> MegatronBackend:
    """The back-end of one optimizer inside a ChainedOptimizer (by class name along its MRO).

    An optimizer class not known here gets the plain one (state keyed by the parameters its
    inner torch optimizer holds), with a warning.
    """
    for cls in type(optimizer).__mro__:
        backend = _PARTS.get(cls.__name__)
        if backend is not None:
            return backend(optimizer)
    logger.warning(
        "trainmon: ChainedOptimizer holds a %s, which this version does not know (known: %s); "
        "its parameters are read as an FP32Optimizer's",
        type(optimizer).__name__,
        ", ".join(sorted(_PARTS)),
    )
    return MegatronBackend(optimizer)


BACKENDS.update(_PARTS)
BACKENDS["ChainedOptimizer"] = ChainedBackend
