"""Spectral norms of linear weights held in pieces (``shard_reduce`` with FSDP2, tensor
parallelism, or both): exact, without gathering a weight.

Each Lanczos step applies the whole weight's Gram matrix ``W^T W`` to a vector every rank holds
whole, from the rank's piece and all-reduces over the mesh dimensions that split the weight: for
a weight split along its rows only (FSDP2, a column-parallel layer) ``W^T W v`` is the sum of the
pieces' ``W_r^T W_r v`` (one all-reduce); split along its columns only (a row-parallel layer)
``W W^T`` is the sum of the pieces' ``W_c W_c^T`` (one all-reduce); split along both (FSDP2 over a
row-parallel layer) ``W v`` is summed over the column pieces, ``W^T`` of that over the row pieces,
and the column blocks of the result gathered (three). Every rank then runs the same iteration on
the same numbers and finds the whole weight's spectral norm; the Frobenius norm is one more
all-reduce. Every rank of the mesh measures the same weights in the same order at the same
collected step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from adapters.torch.cc_wrap import REGISTRY
from adapters.torch.dist import local_tensor


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear module's 2-D weight: ``weight``, or Megatron's ``wg`` (an MoE router)."""
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else module.wg


def _split(placement: Any) -> int | None:
    """The tensor dimension a placement splits, or None. Strided shards (FSDP2 over a dimension
    tensor parallelism splits too) are not ``Shard`` subclasses but split their ``dim`` all the same."""
    dim = getattr(placement, "dim", None)
    return None if dim is None else dim % 2


def split_dimension(weight: Any) -> int | None:
    """For a 2-D DTensor weight that can be measured from its pieces: 0 (rows split), 1
    (columns split) or 2 (both, each by one mesh dimension, evenly chunked as DTensor does);
    None for anything else (not a DTensor, a pending partial sum, several mesh dimensions
    splitting the same tensor dimension along with the other)."""
    placements = getattr(weight, "placements", None)
    if placements is None or weight.dim() != 2 or any(p.is_partial() for p in placements):
        return None
    dims = [dim for dim in map(_split, placements) if dim is not None]
    if not dims:
        return None
    if len(set(dims)) == 1:
        return dims[0]
    plain = all(type(p).__name__ == "Shard" for p in placements if _split(p) is not None)
    return 2 if plain and len(dims) == 2 else None


class ShardedWeight:
    """How a weight lies on its mesh, found once at attach: the whole weight's Gram operator and
    Frobenius norm from this rank's piece at each collected step."""

    def __init__(self, weight: Any, split: int) -> None:
        self.split = split
        mesh, placements = weight.device_mesh, weight.placements
        #: the mesh dimensions' groups that split the rows, and those that split the columns
        self._groups = [
            [mesh.get_group(i) for i, p in enumerate(placements) if _split(p) == dim] for dim in (0, 1)
        ]
        rows, columns = weight.shape
        #: the length of the Gram matrix's vectors: the columns, unless only the columns are split
        self.size = rows if split == 1 else columns
        self._columns = slice(0, columns)
        if split == 2:  # where this rank's columns lie in the weight
            coordinate = mesh.get_coordinate()
            (axis,) = [i for i, p in enumerate(placements) if _split(p) == 1]
            start = min(coordinate[axis] * math.ceil(columns / mesh.size(axis)), columns)
            self._columns = slice(start, start + weight.to_local().shape[1])

    @staticmethod
    def _summed(tensor: torch.Tensor, groups: list) -> torch.Tensor:
        with REGISTRY.unobserved():  # the monitor's own collectives are not the run's
            for group in groups:
                dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def piece(module: Any) -> torch.Tensor:
        """This rank's piece of the module's weight now, in float32."""
        return local_tensor(linear_weight(module)).detach().float()

    def gram(self, piece: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        by_rows, by_columns = self._groups
        if self.split == 0:
            return self._summed((piece.T @ (piece @ v)).contiguous(), by_rows)
        if self.split == 1:
            return self._summed((piece @ (piece.T @ v)).contiguous(), by_columns)
        rows = self._summed((piece @ v[self._columns]).contiguous(), by_columns)
        block = self._summed((piece.T @ rows).contiguous(), by_rows)
        whole = torch.zeros_like(v)
        whole[self._columns] = block
        return self._summed(whole, by_columns)

    def frobenius(self, piece: torch.Tensor) -> torch.Tensor:
        squares = piece.square().sum().reshape(1)
        return self._summed(squares, self._groups[0] + self._groups[1])[0].sqrt()
