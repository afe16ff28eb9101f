"""Spectral norms of FSDP1's linear weights (``shard_reduce``): exact, from each rank's piece of
the flattened weight, without gathering it.

FSDP1 flattens a unit's parameters into one FlatParameter and gives each rank a contiguous range
of it, so a rank holds a run of the weight's elements in row-major order: the end of one row,
whole rows, the start of another. A product ``W v`` is then each rank's rows' partial dot
products (a row cut between ranks gets a share from each), summed over the unit's process
group; ``W^T u`` alike. Each Lanczos step applies the Gram matrix on the weight's smaller side
with two such all-reduces of one vector, so every rank runs the same iteration on the same
numbers and finds the whole weight's spectral norm; the Frobenius norm is one more all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from adapters.torch.cc_wrap import REGISTRY
from adapters.torch.sharded.fsdp_flat import flat_units
from adapters.torch.sharded.fsdp_internals import FlatSlot, FsdpInternalsChanged, flat_layout


def flat_weights(chunks: Any) -> dict[int, FlatSlot]:
    """id(module) -> where its 2-D ``weight`` lies in an FSDP1 FlatParameter, for every module
    FSDP1 flattened (none without FSDP1; a unit whose metadata cannot be read is left out)."""
    found = {}
    for unit in flat_units(chunks):
        try:
            slots = flat_layout(unit)
        except FsdpInternalsChanged:
            continue
        for slot in slots:
            prefix, _, leaf = slot.fqn.rpartition(".")
            if leaf == "weight" and len(slot.shape) == 2:
                found[id(unit.module.get_submodule(prefix))] = slot
    return found


class FlatPieceWeight:
    """Where one FSDP1 weight's elements lie on this rank, found once at attach; its Gram
    operator and Frobenius norm from the piece at each collected step."""

    def __init__(self, slot: FlatSlot) -> None:
        self.slot = slot
        self._group = slot.unit.process_group
        rows, self._columns = slot.shape
        self.rows = rows
        #: the Gram matrix's vectors are the smaller side
        self.size = min(rows, self._columns)
        start, stop = slot.piece_start, slot.piece_start + slot.shard_numel
        columns = self._columns
        first_whole, last_whole = -(-start // columns), stop // columns  # rows held whole: [first, last)
        #: the run of elements as (row, first column, count) of a cut first row, the whole rows'
        #: range, and (row, 0, count) of a cut last row; an empty part has count 0
        self._head = (start // columns, start % columns, min(stop, first_whole * columns) - start)
        self._whole = (first_whole, max(first_whole, last_whole))
        self._tail = (last_whole, 0, stop - last_whole * columns) if last_whole >= first_whole else (0, 0, 0)

    def piece(self, module: Any) -> torch.Tensor:
        """This rank's run of the module's weight's elements now (from the FlatParameter's local
        shard), in float32."""
        slot = self.slot
        return slot.flat.detach()[slot.shard_offset : slot.shard_offset + slot.shard_numel].float()

    def _split(self, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head_count, (first, last), tail_count = self._head[2], self._whole, self._tail[2]
        head = piece[:head_count]
        block = piece[head_count : head_count + (last - first) * self._columns]
        tail = piece[piece.numel() - tail_count :] if tail_count else piece[:0]
        return head, block.reshape(last - first, self._columns), tail

    def _times(self, piece: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``W v`` (v of the columns' length), summed over the ranks."""
        head, block, tail = self._split(piece)
        out = torch.zeros(self.rows, dtype=v.dtype, device=v.device)
        first, last = self._whole
        out[first:last] = block @ v
        if head.numel():
            row, column, count = self._head
            out[row] += head @ v[column : column + count]
        if tail.numel():
            out[self._tail[0]] += tail @ v[: tail.numel()]
        return self._summed(out)

    def _transposed_times(self, piece: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``W^T u`` (u of the rows' length), summed over the ranks."""
        head, block, tail = self._split(piece)
        first, last = self._whole
        out = block.T @ u[first:last] if last > first else u.new_zeros(self._columns)
        if head.numel():
            row, column, count = self._head
            out[column : column + count] += head * u[row]
        if tail.numel():
            out[: tail.numel()] += tail * u[self._tail[0]]
        return self._summed(out.contiguous())

    def gram(self, piece: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.rows >= self._columns:  # W^T W on the columns
            return self._transposed_times(piece, self._times(piece, v))
        return self._times(piece, self._transposed_times(piece, v))  # W W^T on the rows

    def frobenius(self, piece: torch.Tensor) -> torch.Tensor:
        return self._summed(piece.square().sum().reshape(1))[0].sqrt()

    def _summed(self, tensor: torch.Tensor) -> torch.Tensor:
        with REGISTRY.unobserved():  # the monitor's own collectives are not the run's
            dist.all_reduce(tensor, group=self._group)
        return tensor
