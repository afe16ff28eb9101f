"""Whole-tensor activations of tensor-parallel modules, and whole unreduced gradients of
tensor-parallel parameters (``shard_reduce``).

Under ``parallelize_module`` a module's tensors are DTensors inside it and, by default, plain
local tensors outside: a column-parallel module hands on this rank's columns, a row-parallel one
the reduced sum (its sequence part under sequence parallelism). Each measured tensor is tagged
with the 1-D device mesh it is spread over and this rank's element count: a piece (fewer local
elements than the whole) counts its own, a replica only at mesh coordinate 0, a partial sum is
summed first. For a plain local output the whole tensor's size comes from the DTensor the module
computed, seen by a hook that runs before tensor parallelism's own output hook; a plain tensor
seen earlier in the step (a column-parallel output that is the next module's input) keeps its
tag. Other plain tensors are left per rank.

At the step's end the tagged rows merge exactly over their mesh with one all-gather (the
statistics merge as the parameters' pieces do). A rank whose rows do not line up with its mesh
mates' (a hook that failed on one rank) must not leave the others waiting in that all-gather:
first a three-number header (row count, a checksum of the row names, the mesh) is all-gathered
over the world, and a mesh merges only when all its ranks agree; otherwise its rows stay per
rank this step and that is said once. The unreduced gradients of DTensor parameters are tagged
and merged the same way (their pieces lie on the mesh of the unsharded parameter).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adapters.torch.cc_wrap import REGISTRY
from adapters.torch.dist import all_gather_flat, collective_device, local_tensor, partials_summed
from adapters.torch.sharded.shards import shard_reduce

logger = logging.getLogger("trainmon")


#: a measured tensor's tag: (the ranks of its 1-D mesh, this rank's element count to merge)
Piece = tuple[tuple[int, ...], int]
#: a raw module output's shape on the mesh: (mesh ranks, whole element count, at coordinate 0)
Spread = tuple[tuple[int, ...], int, bool]


def as_passed(
    tensors: list[torch.Tensor],
    tags: list | None,
    passed: list[torch.Tensor],
    dtensor: type | tuple,
    merge: TensorParallelMerge | None,
) -> tuple[list[torch.Tensor], list | None]:
    """The tensors whose gradients are a module's input gradients: a DTensor that tensor
    parallelism made from a plain tensor the caller passed is replaced by that tensor. Its
    gradient is the whole dL/d(input): the module's share, plus those of the tensor's other
    users (a residual branch), as without tensor parallelism; the DTensor's own is the module's
    share alone. A replica (``ColwiseParallel``'s input: the same shape, the same on every rank)
    carries no mesh tag; a piece (``SequenceParallel``'s input, this rank's part of the
    sequence: the DTensor's local shape) is tagged as the DTensor is spread."""
    if len(passed) != len(tensors):
        return tensors, tags
    out, out_tags = list(tensors), None if tags is None else list(tags)
    for k, (made, given) in enumerate(zip(tensors, passed)):
        if isinstance(made, dtensor) and not isinstance(given, dtensor) and given.requires_grad:
            tag = _passed_tag(made, given, merge)
            if tag is not False:
                out[k] = given
                if out_tags is not None:
                    out_tags[k] = tag
    return out, out_tags


def passed_pieces(
    tensors: list[torch.Tensor], passed: list[torch.Tensor], dtensor: type | tuple, merge: TensorParallelMerge
) -> list[tuple[torch.Tensor, Piece]]:
    """The plain tensors the caller passed that are pieces of a DTensor tensor parallelism made
    of them (a sequence part), with their tags: what a plain module before recorded of them
    (a block's output, a residual sum) is such a piece too."""
    if len(passed) != len(tensors):
        return []
    found = []
    for made, given in zip(tensors, passed):
        if isinstance(made, dtensor) and not isinstance(given, dtensor):
            tag = _passed_tag(made, given, merge)
            if tag:
                found.append((given, tag))
    return found


def _passed_tag(made: Any, given: torch.Tensor, merge: TensorParallelMerge | None) -> Piece | bool | None:
    """The tag of a plain tensor a DTensor was made of: None for a replica, a piece's tag (None
    without ``merge``), or False when the DTensor is not made of it."""
    placements = made.placements
    if given.shape == made.shape and all(p.is_replicate() for p in placements):
        return None
    if given.shape == local_tensor(made).shape and all(p.is_replicate() or p.is_shard() for p in placements):
        return merge.piece(given, merge.spread(made)) if merge is not None else None
    return False


class TensorParallelMerge:
    """Tags tensors with their mesh and merges tagged rows over it at the step's end."""

    def __init__(self) -> None:
        #: mesh ranks -> the mesh's process group
        self._groups: dict[tuple[int, ...], Any] = {}
        #: id(mesh) -> (the mesh, kept so that its id stays its own; its ranks; whether this rank
        #: is at its coordinate 0), read once per mesh
        self._meshes: dict[int, tuple[Any, tuple[int, ...], bool]] = {}
        self._told: set[str] = set()

    def spread(self, tensor: Any) -> Spread | None:
        """How a DTensor is spread over a 1-D mesh, or None (a plain tensor, or a mesh of more
        dimensions, whose pieces are left per rank)."""
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is None or mesh.ndim != 1:
            return None
        known = self._meshes.get(id(mesh))
        if known is None:
            ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
            self._groups.setdefault(ranks, mesh.get_group(0))
            coordinate = mesh.get_coordinate()
            first = bool(coordinate is not None and coordinate[0] == 0)
            known = self._meshes[id(mesh)] = (mesh, ranks, first)
        _, ranks, first = known
        return ranks, tensor.numel(), first

    def local(self, tensor: Any) -> tuple[torch.Tensor, Piece | None]:
        """A DTensor's local tensor (its partial sums done) and its tag; a plain tensor as is."""
        if not hasattr(tensor, "device_mesh"):
            return tensor, None
        whole = partials_summed(tensor)
        spread = self.spread(whole)
        local = local_tensor(whole)
        return local, self.piece(local, spread)

    @staticmethod
    def piece(local: torch.Tensor, spread: Spread | None) -> Piece | None:
        """The tag of a local tensor of a DTensor spread as ``spread``."""
        if spread is None:
            return None
        ranks, whole, first = spread
        count = local.numel()
        return ranks, count if count < whole or first else 0

    def merge(self, parts: Sequence[tuple[list[str], torch.Tensor, list[Piece | None]]], ops: tuple) -> bool:
        """Replace, in place, the tagged rows of each ``(row names, statistics, tags)`` part
        with the whole tensors' statistics; whether they were. Every rank calls this at every
        collected step, with or without rows."""
        try:
            header, rows, mesh = self._header(parts)
        except Exception as exc:  # still take part in the header, or the others would wait
            header, rows, mesh = torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64), [], None
            self._tell("tagging", f"trainmon: shard_reduce: tensor-parallel pieces left per rank ({exc!r})")
        world = dist.get_world_size()
        device = collective_device()
        gathered = torch.empty(world * 3, dtype=torch.float64, device=device)
        with REGISTRY.unobserved():  # the monitor's own collectives are not the run's
            all_gather_flat(gathered, header.to(device))
        headers = gathered.reshape(world, 3).cpu().numpy()
        if mesh is None:
            return False
        if not all(np.array_equal(headers[r], headers[dist.get_rank()]) for r in mesh):
            self._tell(
                "mismatch",
                f"trainmon: shard_reduce: the ranks {list(mesh)} measured different tensor-parallel "
                "rows this step (activations or unreduced gradients); their rows stay per rank",
            )
            return False
        matrix = torch.cat([parts[p][1][i : i + 1] for p, i, _ in rows]).to(torch.float64)
        counts = torch.tensor([count for _, _, count in rows], dtype=torch.float64, device=matrix.device)
        with REGISTRY.unobserved():
            merged = shard_reduce(matrix, counts, ops, self._groups[mesh])[:, : len(ops)]
        for (p, i, _), values in zip(rows, merged):
            parts[p][1][i] = torch.from_numpy(values).to(parts[p][1].device)
        return True

    def _header(self, parts: Sequence) -> tuple[torch.Tensor, list[tuple[int, int, int]], tuple | None]:
        """This rank's header (tagged rows, checksum of their names, checksum of the mesh), the
        tagged rows ``(part, row, count)`` and their mesh (None: nothing to merge here)."""
        rows, names, meshes = [], [], set()
        for p, (row_names, _, tags) in enumerate(parts):
            for i, tag in enumerate(tags):
                if tag is not None:
                    rows.append((p, i, tag[1]))
                    names.append(f"{p}:{row_names[i]}")
                    meshes.add(tag[0])
        if len(meshes) > 1:
            raise ValueError(f"tensors on {len(meshes)} meshes in one step, expected one")
        if not rows:
            return torch.zeros(3, dtype=torch.float64), [], None
        mesh = meshes.pop()
        checksum = zlib.crc32("\n".join(names).encode())
        mesh_sum = zlib.crc32(repr(mesh).encode())
        return torch.tensor([len(rows), checksum, mesh_sum], dtype=torch.float64), rows, mesh

    def _tell(self, what: str, message: str) -> None:
        if what not in self._told:
            self._told.add(what)
            logger.warning(message)
