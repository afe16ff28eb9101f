"""The torch part of an evidence bundle: topology, versions, random generator states, and the
tensors an incident's records point at (see ``monitor.alerts.bundle``).

A record's tag names a parameter (gradients, values, moments) or a module's input or output; for
a parameter the bundle holds its value, its gradient and its Adam moments as they are now, for an
activation the parameters of that module. While bundles are wanted and activations are
monitored, each collected step holds on to its modules' inputs (references, within the bundle's
size limit) until its end, so that a bundle also holds the inputs of the module where the
incident appeared, as that module received them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import monitor
from adapters.torch.dist import group_ranks
from monitor.alerts.bundle import TensorBudget, Tensors, host_generators
from monitor.datatypes.tasks import module_calls_of_records, params_of_records


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
            "groups": {
                "tp_group": group_ranks(session.groups[0]),
                "dp_group": group_ranks(session.groups[1]),
                "optimizer_shards": group_ranks(session.backend.shard_group),
            },
        },
        "versions": {"trainmon": monitor.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "rng": rng,
    }
    return info, tensors


def _add(kept: TensorBudget, name: str, tensor: torch.Tensor, what: str) -> None:
    """One tensor of the bundle, copied if it fits (float32 where NumPy lacks the dtype)."""
    shape, dtype = tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
    nbytes = tensor.numel() * max(tensor.element_size(), 4)
    kept.add(name, shape, dtype, nbytes, what, lambda: as_array(tensor)[0])


def _add_parameter(kept: TensorBudget, session: Any, entry: Any) -> None:
    """A parameter now, its gradient and Adam's moments."""
    registry, backend = session.collection.registry, session.backend
    dropped = getattr(session, "skipped_grads", {}).get(id(entry.param))
    parts = [
        ("value", entry.param, "the parameter now (after the update of the step that ended)"),
        ("grad", registry.grad(entry.param), "its gradient as the optimizer used it"),
    ]
    if dropped is not None:  # skip_step dropped the gradient: the update never happened
        parts = [
            ("value", entry.param, "the parameter now (the step's update was skipped)"),
            ("grad", dropped, "its gradient, which the skipped update did not use"),
        ]
    parts += [
        ("exp_avg", backend.moment(entry.param, "exp_avg"), "Adam's first moment"),
        ("exp_avg_sq", backend.moment(entry.param, "exp_avg_sq"), "Adam's second moment"),
    ]
    for part, tensor, what in parts:
        if isinstance(tensor, torch.Tensor):
            _add(kept, f"{entry.vpp_stage}:{entry.name} {part}", tensor, what)


def _add_module_inputs(kept: TensorBudget, session: Any, incident: dict[str, Any]) -> dict[str, Any] | None:
    """The inputs of the first module the incident's records point at whose inputs this step kept
    (at the onset micro-batch where there are several); returns what the manifest says of them."""
    activations = session.collection.activations
    if activations is None or not activations.kept.inputs:
        return None
    micro = int(incident.get("onset_micro_step", 0))
    for vpp, call in module_calls_of_records([incident.get("root", {}), *incident.get("records", [])]):
        steps = sorted(m for v, c, m in activations.kept.inputs if (v, c) == (vpp, call))
        if not steps:
            continue
        chosen = micro if micro in steps else steps[-1]
        module = f"{vpp}:{call or '[the model]'}"  # the root module's call has no name of its own
        changed = []
        for index, (tensor, version) in enumerate(activations.kept.inputs[(vpp, call, chosen)]):
            if tensor._version != version:  # written in place after the call: not what the module saw
                changed.append(index)
                continue
            what = f"input {index} of the module's call at micro-batch {chosen}"
            _add(kept, f"{module} input_{index}", tensor, what)
        return {"module": module, "micro_step": chosen, "changed_in_place": changed}
    return None


def record_tensors(session: Any, incident: dict[str, Any], budget: int) -> tuple[dict[str, Any], Tensors]:
    """The tensors behind the incident, within ``budget`` bytes of host copies (the rest are
    listed): the root's parameters, the inputs of its module (when activations are monitored),
    then the parameters of its other records, each once. Returns the manifest's word on the
    module inputs and the tensors."""
    collection = session.collection
    if collection is None:
        return {}, {}
    kept = TensorBudget(budget)
    root = incident.get("root", {})
    first = list(params_of_records([root], collection.registry.params))
    for entry in first:
        _add_parameter(kept, session, entry)
    inputs = _add_module_inputs(kept, session, incident)
    for entry in params_of_records([root, *incident.get("records", [])], collection.registry.params):
        if all(entry is not done for done in first):
            _add_parameter(kept, session, entry)
    return ({"module_inputs": inputs} if inputs else {}), kept.tensors
