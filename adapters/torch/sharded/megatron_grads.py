"""grad_unreduced from Megatron's gradient buckets, as msprobe reads them: each bucket's gradient just
before its data-parallel reduction starts.

Megatron's DistributedDataParallel accumulates every micro-batch into ``main_grad`` (views of
one flat buffer per dtype) and reduces the buffer bucket by bucket, in place, from
``start_grad_sync`` of its bucket groups: at the end of the step (``finish_grad_sync``) or,
with ``overlap_grad_reduce``, during the last backward, as soon as a bucket is complete. Right
before that call each parameter's ``main_grad`` is this rank's fully accumulated gradient.

``start_grad_sync`` is wrapped on the bucket-group objects of the monitored chunks only (never
on the class) and restored exactly at removal. Statistics of a whole bucket group are taken
in one fused pass and kept; nothing is copied. When this source is used, the per-parameter
gradient hooks are not installed at all: under Megatron they would see a single
micro-batch's ``.grad`` rather than the accumulated gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from adapters.torch.method_wrap import MethodWrap
from adapters.torch.params import ParamRegistry
from adapters.torch.stats import stat_matrix


def bucket_groups(chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """The gradient bucket groups of Megatron DistributedDataParallel chunks (empty for others)."""
    groups = []
    for chunk in chunks:
        if type(chunk).__module__.split(".", 1)[0] != "megatron":
            continue
        groups += list(getattr(chunk, "bucket_groups", ()))
        groups += list(getattr(chunk, "expert_parallel_bucket_groups", ()))
    return groups


class BucketGrads:
    """The unreduced-gradient source for Megatron DDP chunks; same interface as UnreducedGrads.

    ``register()`` wraps the bucket groups and returns removable handles; ``collect`` is set by
    the collection before each step; ``take()`` gives the step's rows; ``reset()`` forgets them.
    """

    #: the task of the rows' tags: gradients seen right before the data-parallel reduction.
    task = "pre_grad"

    def __init__(
        self,
        groups: Sequence[Any],
        registry: ParamRegistry,
        ops: tuple[str, ...],
        eps: float,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.ops, self.eps, self.on_error = ops, eps, on_error
        self.collect = False
        index_of = {id(entry.param): i for i, entry in enumerate(registry.params)}
        self.groups: list[Any] = []
        #: per wrapped group: registry indices and parameters of its monitored members.
        self._members: list[tuple[list[int], list[torch.nn.Parameter]]] = []
        for group in groups:
            params = [p for bucket in group.buckets for p in bucket.params_list if id(p) in index_of]
            if params:
                self.groups.append(group)
                self._members.append(([index_of[id(p)] for p in params], params))
        #: group position -> statistics of its members at its latest reduction this step.
        self._stats: dict[int, torch.Tensor] = {}

    def register(self) -> list:
        """Wrap ``start_grad_sync`` of every bucket group holding a monitored parameter."""
        return [
            MethodWrap(group, "start_grad_sync", self._before_sync(k)) for k, group in enumerate(self.groups)
        ]

    def _before_sync(self, k: int) -> Callable[[Any, Any, Any], None]:
        params = self._members[k][1]

        def capture(group: Any, args: Any, kwargs: Any) -> None:
            if not self.collect:
                return
            # Megatron makes this call a no-op when the reduction already started (first batch).
            if getattr(group, "is_first_batch", False) and getattr(group, "grad_reduce_handle", None):
                return
            try:
                grads = [p.main_grad.detach() for p in params]
                self._stats.pop(k, None)  # a repeat keeps the latest, in firing order
                self._stats[k] = stat_matrix(grads, self.ops, self.eps)
            except Exception as exc:
                self.collect = False
                self.on_error("grad_unreduced", exc)

        return capture

    def passes(self) -> int:
        """0: the buckets count no backward passes."""
        return 0

    def take(self) -> tuple[list[int], None, torch.Tensor]:
        """This step's rows in firing order: parameter indices, no micro-steps, statistics."""
        items = list(self._stats.items())
        self.reset()
        if not items:
            return [], None, stat_matrix((), self.ops, self.eps)
        index = [i for k, _ in items for i in self._members[k][0]]
        return index, None, torch.cat([matrix for _, matrix in items])

    def reset(self) -> None:
        """Forget the step's statistics."""
        self._stats.clear()
