"""MindSpore optimizer Cells: which one to hook, and where its moments and update count are.

A MindSpore optimizer is a Cell called with the gradient tuple, aligned with its
``parameters``. Its moments are ParameterTuples aligned the same way, under attribute names
that depend on the optimizer family (picked by class name, subclasses included). The alignment
is checked once, by the moments' names (``<prefix>.<parameter name>``), never guessed from
substrings.
"""

from __future__ import annotations

import logging
from typing import Any

import mindspore as ms
import numpy as np

logger = logging.getLogger("trainmon")

#: optimizer class name -> attributes holding (exp_avg, exp_avg_sq).
MOMENT_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "Adam": ("moment1", "moment2"),
    "AdamWeightDecay": ("moments1", "moments2"),
    "Lamb": ("moments1", "moments2"),
}
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
#: what each data type leaves out where the optimizer keeps no Adam moments
WITHOUT_MOMENTS = {
    "mv_distribution": "no exp_avg/exp_avg_sq rows",
    "mg_direction": "every share is 1.0",
    "ur_distribution": "no histograms",
}


def hookable_optimizer(optimizer: Any) -> ms.nn.Optimizer:
    """The mindspore.nn.Optimizer to hook: the object itself or the one it wraps (``.optimizer``).

    Raises:
        TypeError: nothing in the chain is a MindSpore optimizer.
    """
    current, seen = optimizer, 0
    while current is not None and seen < 4:
        if isinstance(current, ms.nn.Optimizer):
            return current
        current, seen = getattr(current, "optimizer", None), seen + 1
    raise TypeError(
        f"set_monitor: optimizer: expected a mindspore.nn.Optimizer (or a wrapper with .optimizer), "
        f"got {type(optimizer).__name__}"
    )


def trained_network(chunk: ms.nn.Cell, optimizer: ms.nn.Optimizer) -> ms.nn.Cell:
    """The network a model chunk trains, where the chunk is a train network holding its optimizer
    (a train cell of your own that calls it, as one that accumulates gradients does): the one
    child that holds every parameter the optimizer updates (going on into it while it holds the
    optimizer too), and inside an ``nn.WithLossCell`` its backbone, the network
    ``Model(net, loss_fn, optimizer)`` monitors. The train network's own call is no training
    call (its ``value_and_grad`` runs inside it), so its activations would go unrecorded, and the
    optimizer's compiled ``construct`` would meet the hooks of the optimizer Cell. A chunk without
    the optimizer is returned as it is; one without such a child too, and said."""
    if not _holds(chunk, optimizer):
        return chunk
    wanted = {id(p) for p in optimizer.parameters}
    current = chunk
    while _holds(current, optimizer):
        children = {id(c): c for c in current.cells() if c is not optimizer}.values()
        holders = [c for c in children if wanted <= {id(p) for p in c.get_parameters()}]
        holders = [c for c in holders if not any(o is not c and _holds(o, c) for o in holders)]
        if len(holders) != 1 or isinstance(holders[0], (ms.nn.CellList, ms.nn.CellDict)):
            logger.warning(
                "trainmon: the model %s holds its optimizer, and no one Cell inside it that its call "
                "runs holds every parameter the optimizer updates: activations are recorded only "
                "where the model's own call runs under value_and_grad; give set_monitor the network "
                "the optimizer trains instead",
                type(chunk).__name__,
            )
            return chunk
        current = holders[0]
    backbone = getattr(current, "_backbone", None)
    if isinstance(current, ms.nn.WithLossCell) and isinstance(backbone, ms.nn.Cell):
        current = backbone if wanted <= {id(p) for p in backbone.get_parameters()} else current
    logger.info(
        "trainmon: the model %s holds its optimizer; monitoring the network it trains inside it, %s",
        type(chunk).__name__,
        type(current).__name__,
    )
    return current


def _holds(outer: ms.nn.Cell, cell: ms.nn.Cell) -> bool:
    """Whether ``cell`` is ``outer`` or one of the Cells inside it."""
    return any(inner is cell for _, inner in outer.cells_and_names())


def _moment_attributes(optimizer: ms.nn.Optimizer) -> tuple[str, str] | None:
    for cls in type(optimizer).__mro__:
        if cls.__name__ in MOMENT_ATTRIBUTES:
            return MOMENT_ATTRIBUTES[cls.__name__]
    return None


class OptimizerView:
    """Per optimizer position: the parameter, its moments; plus the optimizer's update count."""

    def __init__(self, optimizer: ms.nn.Optimizer) -> None:
        self.optimizer = optimizer
        self.parameters = tuple(optimizer.parameters)
        self._position = {id(p): j for j, p in enumerate(self.parameters)}
        self.moments: dict[str, tuple[ms.Parameter, ...]] = {}
        self.moment_problem: str | None = None
        attributes = _moment_attributes(optimizer)
        if attributes is None:
            self.moment_problem = f"{type(optimizer).__name__} keeps no Adam moments known to trainmon"
            return
        for key, attribute in zip(MOMENT_KEYS, attributes):
            moments = tuple(getattr(optimizer, attribute, ()))
            problem = self._check_alignment(attribute, moments)
            if problem:
                self.moment_problem, self.moments = problem, {}
                return
            self.moments[key] = moments

    def say_missing_moments(self, config: Any, update_ratio: bool) -> None:
        """Once at attach, per data type switched on (``config``'s mv_distribution and
        mg_direction, ``update_ratio``): what an optimizer without Adam moments leaves it,
        instead of rows missing or flat in silence."""
        wanted = {"mv_distribution": config.mv_distribution, "mg_direction": config.mg_direction}
        for key, on in {**wanted, "ur_distribution": update_ratio}.items():
            if on and self.moment_problem:
                logger.warning("trainmon: %s: %s; %s", key, self.moment_problem, WITHOUT_MOMENTS[key])

    def _check_alignment(self, attribute: str, moments: tuple) -> str | None:
        if len(moments) != len(self.parameters):
            return f"{attribute} has {len(moments)} entries for {len(self.parameters)} parameters"
        for param, moment in zip(self.parameters, moments):
            if not moment.name.endswith("." + param.name) or tuple(moment.shape) != tuple(param.shape):
                return f"{attribute} entry {moment.name!r} does not belong to parameter {param.name!r}"
        return None

    def position(self, param: ms.Parameter) -> int | None:
        """The parameter's index in the optimizer's gradient tuple (None: not optimized here)."""
        return self._position.get(id(param))

    def moment(self, param: ms.Parameter, key: str) -> ms.Parameter | None:
        """``exp_avg`` / ``exp_avg_sq`` of a parameter, or None when the optimizer has none."""
        position = self._position.get(id(param))
        moments = self.moments.get(key)
        return None if position is None or moments is None else moments[position]

    def step_count(self) -> int | None:
        """The optimizer's count of updates (``global_step``; one host copy), None if it has none."""
        global_step = getattr(self.optimizer, "global_step", None)
        if global_step is None:
            return None
        return int(global_step.asnumpy().reshape(-1)[0])

    def adam_hyper(self) -> tuple[float, float, float, float, bool] | None:
        """``(step, beta1, beta2, eps, bias_correction)`` of an Adam-family optimizer after an
        update, else None. AdamWeightDecay applies m / (sqrt(v) + eps) without bias correction."""
        step = self.step_count()
        values = [getattr(self.optimizer, name, None) for name in ("beta1", "beta2", "eps")]
        if not step or any(v is None for v in values):
            return None
        beta1, beta2, eps = (
            float(np.asarray(v.asnumpy() if hasattr(v, "asnumpy") else v).reshape(-1)[0]) for v in values
        )
        return float(step), beta1, beta2, eps, not isinstance(self.optimizer, ms.nn.AdamWeightDecay)

    def not_updated_yet(self) -> ms.Tensor:
        """0-d bool Tensor on the device: the optimizer has not made an update yet (no sync)."""
        return (self.optimizer.global_step == 0).reshape(())
