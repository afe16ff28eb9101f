"""The MindSpore part of an evidence bundle: topology, versions, random generator states, and the
tensors an incident's records point at (see ``monitor.alerts.bundle``).

A record's tag names a parameter or a Cell's input or output; for a parameter the bundle holds
its value and Adam's moments as they are now, for an activation the parameters of that Cell.
MindSpore parameters hold no gradient (the optimizer Cell receives the gradients as arguments
and nothing keeps them), so a bundle has none.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np

import monitor
from adapters.mindspore.dist import world_size
from monitor.alerts.bundle import Tensors, host_generators
from monitor.datatypes.tasks import params_of_records


def as_array(tensor: Any) -> tuple[np.ndarray, str]:
    """A host copy as NumPy (float32 where NumPy lacks the dtype) and the original dtype's name."""
    dtype = str(tensor.dtype)
    if tensor.dtype == ms.bfloat16:
        tensor = tensor.astype(ms.float32)
    return np.array(tensor.asnumpy(), copy=True), dtype


def facts(session: Any) -> tuple[dict[str, Any], Tensors]:
    """Topology, versions and random generator states of a MindSpore session."""
    rng, tensors = host_generators()
    get_state = getattr(ms, "get_rng_state", None)  # MindSpore's default generator, where it has one
    if get_state is not None:
        array, dtype = as_array(get_state())
        tensors["rng.mindspore"] = (array, dtype, "MindSpore's default generator state", array.shape)
    rng["mindspore_seed"] = ms.get_seed()
    info = {
        "topology": {
            "rank": session.rank,
            "world_size": world_size(),
            "pp_stage": session.pp_stage,
            "group_mates": list(session.group_mates),
            "chunks": [type(chunk).__name__ for chunk in session.chunks],
            "graph_mode": session.graph_mode,
        },
        "versions": {"trainmon": monitor.__version__, "mindspore": ms.__version__, "numpy": np.__version__},
        "rng": rng,
    }
    return info, tensors


def record_tensors(session: Any, incident: dict[str, Any], budget: int) -> Tensors:
    """The parameters behind the incident's root and records, root first, each once, with Adam's
    moments; only those that fit in ``budget`` bytes are copied to the host (the rest are listed)."""
    collection = session.collection
    if collection is None:
        return {}
    tensors: Tensors = {}
    for entry in params_of_records(
        [incident.get("root", {}), *incident.get("records", [])], collection.registry.params
    ):
        label = f"{entry.vpp_stage}:{entry.name}"
        parts = [
            ("value", entry.param, "the parameter now (after the update of the step that ended)"),
            ("exp_avg", session.view.moment(entry.param, "exp_avg"), "Adam's first moment"),
            ("exp_avg_sq", session.view.moment(entry.param, "exp_avg_sq"), "Adam's second moment"),
        ]
        for part, tensor, what in parts:
            if tensor is None:
                continue
            shape = tuple(tensor.shape)
            size = int(np.prod(shape, dtype=np.int64)) * max(tensor.itemsize, 4)
            if size > budget:
                tensors[f"{label} {part}"] = (None, str(tensor.dtype), what, shape)
                continue
            budget -= size
            tensors[f"{label} {part}"] = (*as_array(tensor), what, shape)
    return tensors
