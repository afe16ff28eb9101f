"""Back-end for parameters that are DTensors: FSDP2 (``fully_shard``), tensor parallelism
(``parallelize_module``) and both on a 2-D (dp, tp) device mesh.

Every number is read from this rank's local piece (the DTensor's local tensor: nothing is
gathered per parameter), recorded with its element count, or merged exactly across the mesh with
``shard_reduce``: one all-gather per mesh dimension and data type, since min, max, sums of
squares, counted means and NaN counts merge dimension by dimension. A piece is counted once:
where a tensor is replicated along a mesh dimension (a LayerNorm weight under tensor
parallelism), only the rank at coordinate 0 of that dimension counts it and writes its row, so a
merged norm is never inflated by replicas, nor is a row deflated by ``sqrt(shards)`` the way a
norm of one local shard is. A gradient that is still a ``Partial`` sum is summed first (one
collective for that tensor, on collected steps only).

Parameters may live on a (dp, tp) mesh and on its named sub-meshes (FSDP2 over ``dp`` for the
parameters tensor parallelism leaves whole): their pieces merge over the largest mesh's
dimensions, a sub-mesh's tensors counted as replicated along the dimensions it lacks. A
parameter that is not a DTensor in such a model is taken as replicated over the whole mesh:
rank 0 of the mesh writes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from adapters.torch.dist import local_tensor, partials_summed
from adapters.torch.optim import TorchBackend


def holds_dtensors(optimizer: torch.optim.Optimizer, chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether any parameter the optimizer updates, or the model holds, is a DTensor (tensor-
    parallel layers may be updated by another optimizer than the one given)."""
    return any(isinstance(p, DTensor) for p in _given_and_held(optimizer, chunks))


def holds_replicated_dtensors(optimizer: torch.optim.Optimizer, chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether a parameter the optimizer updates, or the model holds, is a DTensor replicated
    along a mesh dimension (tensor parallelism; FSDP2 alone shards every parameter): its gradient
    can be a partial sum."""
    return any(
        isinstance(p, DTensor) and any(placement.is_replicate() for placement in p.placements)
        for p in _given_and_held(optimizer, chunks)
    )


def _given_and_held(optimizer: torch.optim.Optimizer, chunks: Sequence[torch.nn.Module]) -> Iterator[Any]:
    given = (p for group in optimizer.param_groups for p in group["params"])
    return itertools.chain(given, (p for chunk in chunks for p in chunk.parameters()))


class DTensorBackend(TorchBackend):
    """A torch optimizer over DTensor parameters: this rank's counted pieces of every tensor."""

    sharded = True
    dtensors = True

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self.shard_group: tuple = ()
        self._mesh: DeviceMesh | None = None
        #: id(mesh) -> whether this rank is at coordinate 0 of the main mesh's dimensions that
        #: the mesh lacks (along which its tensors are replicated)
        self._first_elsewhere: dict[int, bool] = {}
        #: whether this rank writes the parameters that are not DTensors (rank 0 of the mesh)
        self._plain_here = True
        #: (id(mesh), placements) -> (whether partial sums are pending, whether this rank's piece
        #: is counted once they are done): a few layouts serve every tensor of a step
        self._layouts: dict[tuple, tuple[bool, bool]] = {}

    def prepare(self, params: Sequence[torch.nn.Parameter], local_grad: Callable) -> None:
        """Find the main mesh (the largest of the parameters'); its dimensions' groups are what
        pieces merge over. Parameters on a sub-mesh (FSDP2 over the dp dimension of a (dp, tp)
        mesh, for parameters tensor parallelism leaves whole) are replicated along the other
        dimensions.

        Raises:
            ValueError: a parameter's mesh is not a named sub-mesh of the main one.
        """
        super().prepare(params, local_grad)
        meshes = {id(p.device_mesh): p.device_mesh for p in params if isinstance(p, DTensor)}
        self._first_elsewhere, self._layouts = {}, {}
        if not meshes:
            self._mesh, self.shard_group = None, (None,)
            self._plain_here = not dist.is_initialized() or dist.get_rank() == 0
            return
        main = max(meshes.values(), key=lambda mesh: mesh.mesh.numel())
        self._mesh = main
        self._plain_here = not any(main.get_coordinate() or (1,))
        self.shard_group = tuple(main.get_group(dim) for dim in range(main.ndim))
        for mesh in meshes.values():
            self._first_elsewhere[id(mesh)] = self._first_along_missing_dims(mesh)

    def _first_along_missing_dims(self, mesh: DeviceMesh) -> bool:
        main = self._mesh
        coordinate = main.get_coordinate()
        if coordinate is None:
            return False
        ranks = set(mesh.mesh.flatten().tolist())
        if ranks == set(main.mesh.flatten().tolist()):
            return True
        names, main_names = mesh.mesh_dim_names or (), main.mesh_dim_names or ()
        if not ranks <= set(main.mesh.flatten().tolist()) or not names or not set(names) <= set(main_names):
            raise ValueError(
                f"set_monitor: model: a parameter lives on the device mesh {mesh}, which is not a named "
                f"sub-mesh of {main}, the mesh of the other parameters; expected all parameters on one "
                "mesh or on named sub-meshes of it (select one mesh's parameters with targets)"
            )
        return all(c == 0 for c, name in zip(coordinate, main_names) if name not in names)

    def _layout(self, mesh: DeviceMesh, placements: tuple) -> tuple[bool, bool]:
        """Whether a tensor laid out so has partial sums pending, and whether this rank's piece is
        the one counted once they are summed: coordinate 0 along every dimension the tensor is
        replicated over (its own replicated or partial dimensions, and the main mesh's that it
        lacks)."""
        first = self._first_elsewhere.get(id(mesh))
        if first is None:
            first = self._first_elsewhere[id(mesh)] = self._first_along_missing_dims(mesh)
        coordinate = mesh.get_coordinate()
        counted = (
            first
            and coordinate is not None
            and all(
                c == 0
                for c, placement in zip(coordinate, placements)
                if placement.is_replicate() or placement.is_partial()
            )
        )
        return any(placement.is_partial() for placement in placements), bool(counted)

    def _piece(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's counted piece of ``tensor``, or None (no tensor, a replica, or no elements)."""
        if tensor is None:
            return None
        if isinstance(tensor, DTensor):
            key = (id(tensor.device_mesh), tensor.placements)
            layout = self._layouts.get(key)
            if layout is None:
                layout = self._layouts[key] = self._layout(tensor.device_mesh, tensor.placements)
            partial, counted = layout
            if partial:  # every rank of the mesh takes part, counted or not
                tensor = partials_summed(tensor)
            if not counted:
                return None
            tensor = local_tensor(tensor)
        elif not self._plain_here:
            return None
        return tensor if tensor.numel() else None

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self._piece(self._local_grad(param))

    def numel(self, param: torch.nn.Parameter) -> int:
        return param.numel()  # a DTensor's numel is the global one

    def value(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self._piece(param)

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        return self._piece(super().moment(param, key))
