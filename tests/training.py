"""The one small training fixture of the tests and the benchmarks: models, batches and the loop.

``train`` is the loop every test and benchmark runs: micro-batches, each forward and backward,
then the optimizer step, optionally with plain data parallelism (each gradient all-reduced and
averaged before the step). What differs between them is only the model, the batches and the loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """A few layers with different shapes, a LayerNorm and a ReLU."""

    def __init__(self, sizes: Sequence[int] = (6, 16, 12, 4)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
        self.norm = nn.LayerNorm(sizes[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return self.norm(x)


class Net(nn.Module):
    """Linear -> (optionally checkpointed) block with dropout -> Linear.

    Dropout draws from the global RNG, so a monitor that consumed random numbers, or a checkpoint
    recompute that replayed a different mask, would change the training.
    """

    def __init__(self, reentrant: bool | None = None, features: int = 6, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.block = nn.Sequential(
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, hidden),
            nn.LayerNorm(hidden),
        )
        self.out = nn.Linear(hidden, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        if self.reentrant is None:
            x = self.block(x)
        else:
            x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.out(x)


def make_batches(
    steps: int, micro: int, seed: int = 1, features: int = 6, batch: int = 5
) -> list[list[torch.Tensor]]:
    """``steps`` lists of ``micro`` random (batch, features) inputs from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(batch, features, generator=generator) for _ in range(micro)] for _ in range(steps)]


def mean_square(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The default loss: the mean square of the model's output."""
    return model(batch).pow(2).mean()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Sequence[Any]],
    after_step: Callable[[int], None] | None = None,
    loss_scale: dict[int, float] | None = None,
    loss: Callable[[nn.Module, Any], torch.Tensor] = mean_square,
    data_parallel: bool = False,
) -> list[float]:
    """Micro-batches per step, then ``optimizer.step()``; returns every micro-batch loss (exact
    floats).

    ``after_step(step)`` runs after each step; ``loss_scale`` maps steps to a factor on their loss
    (a gradient spike); ``loss(model, batch)`` gives a micro-batch's loss; ``data_parallel``
    all-reduces and averages every gradient over the ranks before the step, one call per
    gradient (as a hand-written data-parallel loop does).
    """
    losses = []
    for step, step_batches in enumerate(batches):
        for batch in step_batches:
            value = loss(model, batch) * (loss_scale or {}).get(step, 1.0)
            value.backward()
            losses.append(value.item())
        if data_parallel:
            world = torch.distributed.get_world_size()
            for p in model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad.div_(world)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(step)
    return losses
