"""The MindSpore part of an evidence bundle: topology, versions, random generator states, and the
tensors an incident's records point at (see ``monitor.alerts.bundle``).

A record's tag names a parameter or a Cell's input or output; for a parameter the bundle holds
its value and Adam's moments as they are now, for an activation the parameters of that Cell.
MindSpore parameters hold no gradient (the optimizer Cell receives the gradients as arguments
and nothing keeps them), so a bundle has none. Nor does it hold a Cell's inputs, as a torch
bundle does: MindSpore tensors keep no count of in-place writes, so an input held from the call
could have been changed since without anything telling, and copying every Cell's inputs at
every collected step would cost every step what only an incident needs.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np

import monitor
from adapters.mindspore.dist import group_ranks, world_size
from monitor.alerts.bundle import TensorBudget, Tensors, host_generators
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
            "groups": {"tp_group": group_ranks(session.tp_group), "dp_group": group_ranks(session.dp_group)},
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
    kept = TensorBudget(budget)
    for entry in params_of_records(
        [incident.get("root", {}), *incident.get("records", [])], collection.registry.params
    ):
        parts = [
            ("value", entry.param, "the parameter now (after the update of the step that ended)"),
            ("exp_avg", session.view.moment(entry.param, "exp_avg"), "Adam's first moment"),
            ("exp_avg_sq", session.view.moment(entry.param, "exp_avg_sq"), "Adam's second moment"),
        ]
        for part, tensor, what in parts:
            if tensor is not None:
                _add(kept, f"{entry.vpp_stage}:{entry.name} {part}", tensor, what)
    return kept.tensors


def _add(kept: TensorBudget, name: str, tensor: Any, what: str) -> None:
    """One tensor of the bundle, copied if it fits (float32 where NumPy lacks the dtype)."""
    shape = tuple(tensor.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * max(tensor.itemsize, 4)
    kept.add(name, shape, str(tensor.dtype), nbytes, what, lambda: as_array(tensor)[0])
