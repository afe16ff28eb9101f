"""Which object measures a model's unreduced gradients (``grad_unreduced``): one per model, picked
by how its gradients come to exist (FSDP's flat or unsharded parameters, Megatron's buckets, or
torch's per-parameter hooks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from adapters.torch.grads import GradCounting, UnreducedGrads
from adapters.torch.params import ParamRegistry


def unreduced_source(
    chunks: Sequence[torch.nn.Module], backend: Any, registry: ParamRegistry, counting: GradCounting
) -> Any:
    """The one source of grad_unreduced (never two: msprobe 1.2.2 could install both under Megatron).

    Megatron DistributedDataParallel chunks: their bucket reductions (adapters.torch.sharded.megatron_grads),
    unless per-micro-batch gradients are asked for; FSDP2 models: hooks on the unsharded
    parameters (adapters.torch.sharded.fsdp); FSDP1 models: hooks on the flat parameters
    (adapters.torch.sharded.fsdp_flat); every other model: per-parameter hooks.
    """
    from adapters.torch.sharded.fsdp import UnshardedGrads, fsdp2_modules

    slots = getattr(backend, "slots", None)  # FSDP1's flat parameters
    if slots is not None:
        from adapters.torch.sharded.fsdp_flat import FlatGrads

        found = {
            i: slots[id(entry.param)] for i, entry in enumerate(registry.params) if id(entry.param) in slots
        }
        return FlatGrads(found, registry, counting)
    fsdp_modules = fsdp2_modules(chunks)
    if fsdp_modules:
        return UnshardedGrads(fsdp_modules, registry, counting)
    if not counting.per_micro_batch and any(type(c).__module__.startswith("megatron.") for c in chunks):
        from adapters.torch.sharded.megatron_grads import BucketGrads, bucket_groups

        groups = bucket_groups(chunks)
        if groups:
            return BucketGrads(groups, registry, counting.ops, counting.eps, counting.on_error)
    return UnreducedGrads(registry, counting)
