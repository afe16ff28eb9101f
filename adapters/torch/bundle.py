"""The torch part of an evidence bundle: topology, versions, random generator states, and the
tensors an incident's records point at (see ``monitor.alerts.bundle``).

A record's tag names a parameter (gradients, values, moments) or a module's input or output; for
a parameter the bundle holds its value, its gradient and its Adam moments as they are now, for an
activation the parameters of that module (activations themselves are not kept after a step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import monitor
from monitor.alerts.bundle import Tensors, host_generators
from monitor.datatypes.tasks import params_of_records


def as_array(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A host copy as NumPy (float32 where NumPy lacks the dtype) and the original dtype's name."""
    if hasattr(tensor, "to_local"):  # a DTensor: this rank's piece
        tensor = tensor.to_local()
    tensor = tensor.detach()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2) or tensor.is_complex():
        tensor = tensor.float()
    return tensor.cpu().numpy().copy(), dtype


def facts(session: Any) -> tuple[dict[str, Any], Tensors]:
    """Topology, versions and random generator states of a torch session."""
    rng, tensors = host_generators()
    generators = [("rng.torch", torch.get_rng_state(), "torch's CPU generator state")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators += [
            (f"rng.cuda{index}", cuda_state, f"torch's generator of cuda:{index}")
            for index, cuda_state in enumerate(torch.cuda.get_rng_state_all())
        ]
    for name, generator_state, what in generators:
        array, dtype = as_array(generator_state)
        tensors[name] = (array, dtype, what, array.shape)
    info = {
        "topology": {
            "rank": session.rank,
            "world_size": session.world_size,
            "pp_stage": session.pp_stage,
            "group_mates": list(session.group_mates),
            "chunks": [type(chunk).__name__ for chunk in session.chunks],
        },
        "versions": {"trainmon": monitor.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "rng": rng,
    }
    return info, tensors


def record_tensors(session: Any, incident: dict[str, Any], budget: int) -> Tensors:
    """The tensors behind the incident's root and records, root first, each parameter once; only
    those that fit in ``budget`` bytes are copied to the host (the rest are listed)."""
    collection = session.collection
    if collection is None:
        return {}
    registry, backend = collection.registry, session.backend
    tensors: Tensors = {}
    for entry in params_of_records([incident.get("root", {}), *incident.get("records", [])], registry.params):
        label = f"{entry.vpp_stage}:{entry.name}"
        parts = [
            ("value", entry.param, "the parameter now (after the update of the step that ended)"),
            ("grad", registry.grad(entry.param), "its gradient as the optimizer used it"),
            ("exp_avg", backend.moment(entry.param, "exp_avg"), "Adam's first moment"),
            ("exp_avg_sq", backend.moment(entry.param, "exp_avg_sq"), "Adam's second moment"),
        ]
        for part, tensor, what in parts:
            if not isinstance(tensor, torch.Tensor):
                continue
            size = tensor.numel() * max(tensor.element_size(), 4)  # float32 where NumPy lacks the dtype
            shape = tuple(tensor.shape)
            if size > budget:
                tensors[f"{label} {part}"] = (None, str(tensor.dtype).removeprefix("torch."), what, shape)
                continue
            budget -= size
            tensors[f"{label} {part}"] = (*as_array(tensor), what, shape)
    return tensors
