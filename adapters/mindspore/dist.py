"""mindspore.communication facts the monitor needs: rank, pipeline stage, group membership, and
whether any rank holds a flag.

MindSpore names its communication groups with strings; ``process_group``, ``tp_group`` and
``dp_group`` are such names (None: the world group, or no group).
"""

from __future__ import annotations

import functools
from typing import Any

from mindspore.communication import (
    GlobalComm,
    get_group_rank_from_world_rank,
    get_group_size,
    get_process_group_ranks,
    get_rank,
)


def initialized() -> bool:
    """True once ``mindspore.communication.init()`` has run in this process."""
    return bool(GlobalComm.INITED)


def global_rank() -> int:
    """This process's rank in the world (0 before ``init()``)."""
    return get_rank(GlobalComm.WORLD_COMM_GROUP) if initialized() else 0


def world_size() -> int:
    """The number of ranks in the world (1 before ``init()``)."""
    return get_group_size(GlobalComm.WORLD_COMM_GROUP) if initialized() else 1


def pipeline_info(process_group: Any) -> tuple[int, list[int]]:
    """``(pp_stage, group_mates)`` of this rank in the pipeline group ``process_group`` (a name).

    Without one the rank is its own pipeline: stage 0, mates [rank], as on torch.
    """
    if not initialized():
        return 0, [0]
    if process_group is None:
        return 0, [global_rank()]
    world = GlobalComm.WORLD_COMM_GROUP
    if not isinstance(process_group, str) or process_group == world:
        return global_rank(), list(range(get_group_size(world)))
    return get_group_rank_from_world_rank(global_rank(), process_group), list(
        get_process_group_ranks(process_group)
    )


def group_ranks(group: Any) -> list[int] | None:
    """The world ranks of the named ``group``; None where there is no usable group."""
    if not isinstance(group, str) or not initialized():
        return None
    if group == GlobalComm.WORLD_COMM_GROUP:
        return list(range(world_size()))
    return list(get_process_group_ranks(group))


def rank_in_group(group: Any) -> int | None:
    """This rank's index in the named ``group``, or None when there is no usable group."""
    if not isinstance(group, str) or not initialized():
        return None
    if group == GlobalComm.WORLD_COMM_GROUP:
        return global_rank()
    return get_group_rank_from_world_rank(global_rank(), group)


@functools.cache
def _sum_reduce() -> Any:
    from mindspore import ops

    return ops.AllReduce(ops.ReduceOp.SUM)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the world (one small AllReduce, unseen by
    cc_distribution); every rank must call it at the same point. A float32 sum: the one
    AllReduce MindSpore's CPU kernels offer for every back-end."""
    if world_size() <= 1:
        return flag
    import mindspore as ms
    import numpy as np

    from adapters.mindspore.cc_wrap import REGISTRY

    with REGISTRY.unobserved():
        value = _sum_reduce()(ms.Tensor(np.array([1.0 if flag else 0.0], dtype=np.float32)))
    return bool(value.asnumpy()[0] > 0)
