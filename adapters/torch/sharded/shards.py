"""Statistics of sharded tensors: each rank's piece with its element count, merged exactly.

Every op merges from per-piece values and counts: norm from sums of squares, min of mins, max of
maxes, mean and zeros weighted by counts, nans summed. ``shard_reduce`` packs a data type's
statistics and counts into one tensor and all-gathers it over the shard group (one collective per
data type per collected step; one per mesh dimension for DTensors), so every rank can write
whole-tensor values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adapters.torch.dist import all_gather_flat

#: extra columns written for sharded data: element count of the row's piece, and 1 when partial.
SHARD_COLUMNS = ("numel", "partial")


class PeerFailed(RuntimeError):
    """A rank's part of a merge failed and it said so in the merge's gather: every rank of the
    merge raises this at that same gather, so that all switch the part off at one step."""


class GatheredThenFailed(RuntimeError):
    """This rank took part in every gather of a merge, then failed (its cause is the error): its
    mates do not know, and are told at the part's next gather."""


def piece_columns(counts: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """The SHARD_COLUMNS of pieces of ``counts`` elements of tensors of ``whole``: (n, 2) float64."""
    counts = np.asarray(counts, dtype=np.float64)
    return np.stack([counts, (counts < np.asarray(whole)).astype(np.float64)], axis=1).reshape(-1, 2)


def merge_pieces(values: np.ndarray, counts: np.ndarray, ops: Sequence[str]) -> np.ndarray:
    """Merge pieces along axis 0: values (pieces, rows, ops), counts (pieces, rows) -> (rows, ops).

    Pieces with count 0 (a rank that holds none of the tensor) are ignored.
    """
    present = counts > 0
    total = counts.sum(axis=0)
    out = np.full(values.shape[1:], np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        for j, op in enumerate(ops):
            column = np.where(present, values[:, :, j], np.nan)
            if op == "norm":
                out[:, j] = np.sqrt(np.sum(np.where(present, column * column, 0.0), axis=0))
            elif op == "min":
                out[:, j] = _masked(np.fmin.reduce, column, present, values[:, :, j])
            elif op == "max":
                out[:, j] = _masked(np.fmax.reduce, column, present, values[:, :, j])
            elif op in ("mean", "zeros"):
                out[:, j] = np.sum(np.where(present, values[:, :, j] * counts, 0.0), axis=0) / total
            elif op == "nans":
                out[:, j] = np.sum(np.where(present, values[:, :, j], 0.0), axis=0)
    return out


def _masked(reduce: Any, column: np.ndarray, present: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """min/max over present pieces; a NaN inside a present piece propagates, as numpy's min does."""
    result = reduce(column, axis=0)
    nan_in_piece = np.any(present & np.isnan(raw), axis=0)
    return np.where(nan_in_piece, np.nan, result)


def shard_reduce(
    matrix: torch.Tensor, counts: torch.Tensor, ops: Sequence[str], group: Any, failed: bool = False
) -> np.ndarray:
    """Whole-tensor statistics from every rank's pieces: one all_gather per group.

    Args:
        matrix: (rows, ops) float64 statistics of this rank's pieces (NaN rows where it holds none).
        counts: (rows,) element counts of this rank's pieces (0 where it holds none).
        group: the process group whose ranks hold the pieces, or a tuple of groups (the
            dimensions of a device mesh), merged one after the other.
        failed: this rank's part failed: every rank of the merge raises ``PeerFailed``.

    Returns:
        (rows, ops + 2) float64: merged values, the total element count, and 0 (not partial).

    Raises:
        PeerFailed: some rank said its part failed (on every rank of the merge alike).
        GatheredThenFailed: this rank failed after a gather; it still took every later one.
    """
    values, failing, error = matrix, [], None
    for one in group if isinstance(group, tuple) else (group,):
        host, said = _gather(values, counts, one, failed or bool(failing))
        failing = failing or said  # later mesh dimensions hear it from those who heard it first
        try:  # whatever fails here, the next mesh dimension's gather is still taken
            pieces, piece_counts = host[:, :-1, :-1], host[:, :-1, -1]
            values = torch.from_numpy(merge_pieces(pieces, piece_counts, ops)).to(matrix.device)
            counts = torch.from_numpy(piece_counts.sum(axis=0)).to(matrix.device)
        except Exception as exc:
            error = error or exc
            values, counts = torch.full_like(values, float("nan")), torch.zeros_like(counts)
    if failing:
        raise PeerFailed(f"rank(s) {sorted(failing)} failed to measure their pieces; merged nowhere")
    if error is not None:
        raise GatheredThenFailed(repr(error)) from error
    host_counts = counts.cpu().numpy()
    return np.concatenate(
        [values.cpu().numpy(), host_counts[:, None], np.zeros((len(host_counts), 1))], axis=1
    )


def held_rows(rows: Any, merged: np.ndarray) -> tuple[Any, np.ndarray]:
    """The rows of ``shard_reduce``'s result that some rank holds a piece of: a parameter with no
    gradient on any rank (unused this step: an expert no token reached) gets no row, as without
    sharding, instead of a row of NaNs that the non-finite rule would take for a fault."""
    held = np.flatnonzero(merged[:, -2] > 0)
    if len(held) == len(merged):
        return rows, merged
    return rows.take(held.tolist()), merged[held]


def _gather(
    matrix: torch.Tensor, counts: torch.Tensor, group: Any, failed: bool
) -> tuple[np.ndarray, list[int]]:
    """Every rank's (rows + 1, columns + 1) pieces of ``group`` on the host: values, counts and a
    last row saying whether the rank's part failed (so a part of no rows can say it too); and
    the (global) ranks that said so, which every later mesh dimension is told in turn."""
    packed = torch.cat([matrix, counts.to(matrix.dtype).unsqueeze(1)], dim=1)
    status = torch.zeros((1, packed.shape[1]), dtype=packed.dtype, device=packed.device)
    status[0, -1] = 1.0 if failed else 0.0
    packed = torch.cat([packed, status]).contiguous()
    world = dist.get_world_size(group)
    # the concatenated output form: gloo accepts only this one (NCCL accepts both)
    rows, columns = packed.shape
    gathered = torch.empty((world * rows, columns), dtype=packed.dtype, device=packed.device)
    all_gather_flat(gathered, packed, group=group)
    host = gathered.cpu().numpy().reshape(world, rows, columns)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    return host, [members[r] for r in np.flatnonzero(host[:, -1, -1] > 0)]
