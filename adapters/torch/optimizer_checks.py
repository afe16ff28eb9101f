"""What is said once about the optimizer instead of rows that are missing, flat or of other
tensors: one that updates none of the model's parameters (a wrapper took them over after
``set_monitor``), one that keeps no Adam moments, or keeps them for some parameters only."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from adapters.torch.dist import dtensor_type
from adapters.torch.optim import TorchBackend
from monitor.datatypes.l2 import LINEAR_PREFIX
from monitor.datatypes.update_ratio import update_ratio_written

logger = logging.getLogger("trainmon")


def without_adam_moments(backend: TorchBackend, params: Sequence[torch.nn.Parameter]) -> str | bool | None:
    """Whether the optimizer behind ``params`` keeps no Adam moments, after an update: the name of
    its type when it holds state for them without ``exp_avg``/``exp_avg_sq`` or its groups have no
    ``betas`` (a stateless SGD); False when a parameter has either; None while it cannot tell (no
    update has made any state yet, as when a loss scaler skipped the first steps)."""
    if any(backend.moment(param, key) is not None for param in params for key in ("exp_avg", "exp_avg_sq")):
        return False
    owners = [owner for owner in map(backend.state_owner, params) if owner is not None]
    if not owners:
        return None
    optimizer = owners[0][0]
    states = [owner.state.get(tensor) for owner, tensor in owners]
    if any(state and ("exp_avg" in state or "exp_avg_sq" in state) for state in states):
        return False  # kept, though this rank reads none (an HSDP replica's pieces are not counted)
    if any(states):
        return type(optimizer).__name__
    if not any("betas" in group for owner, _ in owners for group in owner.param_groups):
        return type(optimizer).__name__
    return None


#: the data types that describe only the optimizer's own tensors, and so nothing of a training
#: whose parameters a wrapper took over; with the parameters themselves partitioned away (empty
#: placeholders), also those read from the parameters.
OPTIMIZER_SIDE = ("grad_reduced", "exp_avg", "exp_avg_sq", "param_updated", "ur", "other")
PARAMETER_SIDE = ("param_origin", LINEAR_PREFIX)


def _switched_on(part: str, config: Any) -> bool:
    """Whether ``config`` asks for one of those data types."""
    if part == "ur":
        return update_ratio_written(config)
    key = {
        "grad_unreduced": "wg_distribution",
        "grad_reduced": "wg_distribution",
        "exp_avg": "mv_distribution",
        "exp_avg_sq": "mv_distribution",
        "param_origin": "param_distribution",
        "param_updated": "param_distribution",
        "other": "mg_direction",
        LINEAR_PREFIX: "recording_l2_features",
    }[part]
    return bool(getattr(config, key))


#: what to do where a wrapper made after set_monitor took the parameters over
_ATTACH_AFTER_WRAPPER = (
    "attach after a wrapper that takes the parameters over is made (deepspeed.initialize), passing it"
)
#: what to do where the model's parameters were made anew after set_monitor or the optimizer
_AFTER_SHARDING = (
    "build the model fully first (sharded, parallelized or wrapped: fully_shard, FSDP, "
    "parallelize_module), then the optimizer from its parameters, then attach"
)


def taken_over(
    backend: TorchBackend, params: Sequence[torch.nn.Parameter], model_params: Sequence[torch.Tensor]
) -> tuple[str, str, tuple[str, ...]] | None:
    """Why the torch optimizer the monitor hooked updates none of the model's parameters, if it
    does not, what to do, and the data types that then describe nothing of the training: a
    wrapper made after ``set_monitor`` (``deepspeed.initialize``) partitioned them (ZeRO-3 leaves
    each an empty placeholder with a ``ds_id``) or gave the optimizer flat partitions in their
    place (ZeRO-1/2); sharding made the model's parameters anew after ``set_monitor``
    (``model_params``, the model's now, are none of the monitored ones) or after the optimizer
    was built (DTensors the optimizer does not hold). None where it does, or where a back-end
    maps them."""
    trained = [param for param in params if param.requires_grad]  # frozen ones are nobody's to update
    plain = type(backend) is TorchBackend
    if not (plain or backend.dtensors) or not trained:
        return None
    if any(hasattr(param, "ds_id") for param in trained):
        why = (
            "DeepSpeed ZeRO-3 partitioned the model's parameters after set_monitor (and frees each "
            "micro-batch's gradient once reduced, so that with several micro-batches a step "
            "grad_unreduced would hold the last one's only)"
        )
        return why, _ATTACH_AFTER_WRAPPER, ("grad_unreduced", *OPTIMIZER_SIDE, *PARAMETER_SIDE)
    now = {id(param) for param in model_params}
    # (not asked of DTensors: FSDP2 may hold the unsharded ones on the model at the update)
    if plain and not any(id(param) in now for param in trained):
        why = (
            "the model's parameters were made anew after set_monitor (sharded, parallelized or "
            "wrapped): the monitored ones take no part"
        )
        return why, _AFTER_SHARDING, OPTIMIZER_SIDE + PARAMETER_SIDE
    held = {id(tensor) for group in backend.optimizer.param_groups for tensor in group["params"]}
    if any(id(param) in held for param in trained):
        return None
    name = type(backend.optimizer).__name__
    if any(isinstance(param, dtensor_type()) for param in trained):
        why = (
            f"{name} updates none of the model's parameters, which are DTensors made after it was "
            "built: they are not trained"
        )
        return why, _AFTER_SHARDING, OPTIMIZER_SIDE + PARAMETER_SIDE
    why = (
        f"{name} updates none of the monitored parameters (other tensors in their place: a "
        "wrapper's flat partitions, or master copies)"
    )
    return why, _ATTACH_AFTER_WRAPPER, OPTIMIZER_SIDE


def stale_parameters(
    backend: TorchBackend, params: Sequence[torch.nn.Parameter], model_params: Sequence[torch.Tensor]
) -> list[int]:
    """The monitored ``params`` (their indices) that the model no longer holds: ``parallelize_module``
    or ``fully_shard`` made them anew after set_monitor, so their rows describe stale tensors.
    Asked of plain back-ends only: the others map stand-ins, or (FSDP2) put unsharded tensors on
    the model for a while."""
    if type(backend) is not TorchBackend:
        return []
    now = {id(param) for param in model_params}
    return [i for i, param in enumerate(params) if id(param) not in now]


class OptimizerChecks:
    """What is said once about the optimizer, instead of rows that are missing, flat or of other
    tensors in silence: before the first update, that it updates none of the model's parameters
    (``taken_over``: those rows are then not written), and after updates that it keeps no Adam
    moments (with mv_distribution or mg_direction, asked until an update has made state)."""

    def __init__(
        self, config: Any, sharded: bool, holds_parameters: bool, chunks: Sequence[torch.nn.Module]
    ) -> None:
        """``sharded``: a back-end whose ranks hold pieces (a rank may hold no piece of some
        parameters, so partial moments are not said); ``holds_parameters``: its optimizer holds
        the model's parameters themselves (FSDP2 and tensor parallelism do), so its state tells
        whether it keeps moments, where flat partitions (ZeRO, FSDP1, Megatron) are mapped;
        ``chunks``: the model, whose parameters at the first update are compared with those
        monitored."""
        self.config = config
        self.chunks = list(chunks)
        self.first = True
        self.sharded = sharded
        wanted = config.mv_distribution or config.mg_direction
        self.moment_checks_left = 20 if wanted and holds_parameters else 0

    def describing_nothing(
        self, backend: TorchBackend, params: Sequence[torch.nn.Parameter], names: Sequence[str]
    ) -> tuple[str, ...]:
        """Before the first update: the data types that would describe none of this training
        (said once, with what to do), else none; monitored parameters (``names``) that are no
        longer the model's are said too."""
        if not self.first:
            return ()
        self.first = False
        model_params = [p for chunk in self.chunks for p in chunk.parameters()]
        found = taken_over(backend, params, model_params)
        if not found:
            stale = [names[i] for i in stale_parameters(backend, params, model_params)]
            if stale:
                logger.warning(
                    "trainmon: %d monitored parameter(s) (%s%s) are no longer the model's: made anew "
                    "after set_monitor (parallelized, sharded or wrapped), so their rows describe tensors "
                    "the training does not use; build the optimizer and call set_monitor after "
                    "parallelize_module / fully_shard",
                    len(stale),
                    ", ".join(stale[:3]),
                    ", ..." if len(stale) > 3 else "",
                )
            return ()
        why, advice, parts = found
        flat_partitions = advice == _ATTACH_AFTER_WRAPPER and "grad_unreduced" not in parts
        if flat_partitions and self.config.wg_distribution and "deepspeed" in sys.modules:
            why += (  # ZeRO-1 and 2 cannot be told apart from the flat partitions
                "; under DeepSpeed ZeRO-2, which frees each micro-batch's gradient once reduced, "
                "grad_unreduced (still written) holds a step's last micro-batch only"
            )
        wanted = [part for part in parts if _switched_on(part, self.config)]
        if wanted:
            logger.warning(
                "trainmon: %s: %s would describe none of this training and %s not written; %s",
                why,
                ", ".join("ur (ur_distribution's histograms)" if part == "ur" else part for part in wanted),
                "is" if len(wanted) == 1 else "are",
                advice,
            )
        return parts

    @property
    def pending(self) -> bool:
        return self.moment_checks_left > 0

    def after_update(self, backend: TorchBackend, params: Sequence[torch.nn.Parameter]) -> None:
        if self.moment_checks_left:
            self.moment_checks_left -= 1
            verdict = without_adam_moments(backend, params)
            if verdict is not None:
                self.moment_checks_left = 0
            if verdict and self.config.mv_distribution:
                logger.warning(
                    "trainmon: mv_distribution: %s keeps no exp_avg/exp_avg_sq; no moment rows", verdict
                )
            if verdict and self.config.mg_direction:
                logger.warning("trainmon: mg_direction: %s keeps no exp_avg; every share is 1.0", verdict)
            if verdict is False and self.config.mv_distribution and not self.sharded:
                _say_partial_moments(backend, params)


def _say_partial_moments(backend: TorchBackend, params: Sequence[torch.nn.Parameter]) -> None:
    """Parameters whose optimizer state holds no ``exp_avg_sq`` while others' does: Adafactor
    keeps a factored second moment (``exp_avg_sq_row`` / ``_col``) for matrices. Said once, with
    the keys their state holds instead, so that their missing rows are not a silent gap."""
    lacking = [
        param
        for param in params
        if backend.moment(param, "exp_avg_sq") is None
        and (owner := backend.state_owner(param)) is not None
        and owner[0].state.get(owner[1])
    ]
    if lacking:
        owner, tensor = backend.state_owner(lacking[0])
        keys = ", ".join(sorted(k for k in owner.state[tensor] if k != "step")) or "nothing"
        logger.warning(
            "trainmon: mv_distribution: %s keeps no exp_avg_sq for %d of %d parameters (their state "
            "holds %s: a factored second moment); no exp_avg_sq rows for them",
            type(owner).__name__,
            len(lacking),
            len(params),
            keys,
        )
