"""torch.distributed facts the monitor needs: rank, pipeline stage, group membership, DTensors,
whether any rank holds a flag, and when DDP writes its reduction into the gradients."""

from __future__ import annotations

import datetime
import functools
import gc
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from adapters.torch.cc_wrap import REGISTRY

logger = logging.getLogger("trainmon")


@functools.cache
def dtensor_type() -> type | tuple:
    """torch's DTensor class (an empty tuple, matching nothing, where torch has no distributed)."""
    if not dist.is_available():
        return ()
    from torch.distributed.tensor import DTensor

    return DTensor


def local_tensor(tensor: Any) -> torch.Tensor:
    """A DTensor's local tensor, to read (never to write or to differentiate through).

    ``to_local()`` gives the same tensor, but at a price paid per tensor and data type at every
    collected step: for a parameter it makes a new view each call (about 7 us), and with
    gradients enabled (a forward hook) it adds an autograd node. The DTensor's own reference is
    read instead, through ``to_local()`` where a torch keeps it elsewhere.
    """
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    with torch.no_grad():
        return tensor.to_local()


def collective_device() -> torch.device:
    """Where the monitor's own small collectives run: the host, unless the world's backend
    reduces device tensors only (NCCL)."""
    if "gloo" in str(dist.get_backend()) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
    """All-gather ``tensor`` into one ``output`` tensor (the form gloo accepts), by the name this
    torch offers without a deprecation warning (``all_gather_single`` from torch 2.13 on). The
    monitor's own call: cc_distribution does not count it among the run's collectives."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with REGISTRY.unobserved():
        gather(output, tensor, group=group)


def partials_summed(tensor: Any) -> Any:
    """A DTensor with its pending partial sums done (one all-reduce over the mesh dimensions
    that are partial); the same object when there are none. A gradient of a replicated parameter
    whose input was sharded (a LayerNorm under sequence parallelism) is such a partial sum: its
    local piece alone is not the rank's gradient."""
    if not any(placement.is_partial() for placement in tensor.placements):
        return tensor
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
    with torch.no_grad(), REGISTRY.unobserved():  # the monitor's own all-reduce, not the run's
        return tensor.redistribute(tensor.device_mesh, placements)


def ddp_reduces_after_pass_end(wrappers: Sequence[torch.nn.Module] | None) -> bool:
    """Whether the DDP modules that reduce the model's gradients (``ddp_wrappers``; None where a
    chunk has none) leave each gradient as the backward pass accumulated it until the pass ends.

    DDP copies each gradient into its bucket, reduces the copies, and writes the results back
    from a callback it queues once every gradient is ready: a callback queued at the pass's first
    gradient runs before that. Not so where the gradients are the buckets' views
    (``gradient_as_bucket_view``), where a static graph's first pass reduces from a callback
    queued before any gradient exists, or where DDP reduces through hooks of its own (its mixed
    precision, compiled DDP's Python reducer, parameters whose all-reduce is delayed).
    """
    return bool(wrappers) and all(
        not wrapper.gradient_as_bucket_view
        and not wrapper.static_graph
        and getattr(wrapper, "mixed_precision", None) is None
        and not getattr(wrapper, "_use_python_reducer", False)
        and not getattr(wrapper, "_delay_all_reduce_params", None)
        for wrapper in wrappers
    )


def ddp_wrappers(chunks: Sequence[torch.nn.Module], look_around: bool = True) -> list[torch.nn.Module] | None:
    """The DDP modules that reduce the chunks' gradients, or None where a chunk has none.

    A chunk is its own when it is a DDP module. A trainer (Hugging Face's, Lightning's) hands its
    callbacks the model inside its DDP wrapper, which the model does not point back to: with a
    process group and ``look_around``, those wrappers are looked for among the process's live
    objects (``live_wrappers``). A wrapper of an earlier run not
    yet collected may be found too; every one found is returned, so that a verdict on them holds
    for all. A search that fails gives None, as a chunk without a wrapper does.
    """
    ddp = torch.nn.parallel.DistributedDataParallel
    wrappers = [chunk for chunk in chunks if isinstance(chunk, ddp)]
    inner = [chunk for chunk in chunks if not isinstance(chunk, ddp)]
    if not inner:
        return wrappers
    if not (look_around and initialized()):
        return None
    try:
        around = live_wrappers(ddp, "module")
        for chunk in inner:
            holding = [w for w, module in around if module is not None and _holds(module, chunk)]
            if not holding:
                return None
            wrappers += [wrapper for wrapper in holding if wrapper not in wrappers]
    except Exception:
        return None
    return wrappers


def live_wrappers(cls: type, child: str) -> list[tuple[Any, Any]]:
    """Every live instance of the wrapper class ``cls`` in this process, with the module it
    holds as ``child`` (None where it holds none: one whose ``__init__`` raised, kept alive by a
    traceback). A wrapper is not pointed back to by the module it wraps, so a module handed over
    without its wrapper is matched to it here, once, at attach (about 0.1 s per 350,000 objects)."""
    # the type, not isinstance: a proxy's __class__ could run code of its own
    return [
        (obj, obj.__dict__.get("_modules", {}).get(child))
        for obj in gc.get_objects()
        if issubclass(type(obj), cls)
    ]


def _holds(module: torch.nn.Module, part: torch.nn.Module) -> bool:
    """Whether ``part`` is ``module`` or one of its submodules."""
    return any(m is part for m in module.modules())


def initialized() -> bool:
    """Whether torch.distributed has a default process group in this process."""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's rank in the world (0 without a process group)."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """The number of ranks in the world (1 without a process group)."""
    return dist.get_world_size() if initialized() else 1


def pipeline_info(process_group: Any) -> tuple[int, list[int]]:
    """``(pp_stage, group_mates)`` of this rank in the pipeline group ``process_group``.

    Without one the rank is its own pipeline: stage 0, mates [rank] (msprobe's later releases use
    stage 0 too; 1.2.2 used the global rank, which ordered data-parallel replicas as if they were
    pipeline stages, the last rank first in backward).
    """
    if not initialized():
        return 0, [0]
    if process_group is None:
        return 0, [dist.get_rank()]
    group = process_group if isinstance(process_group, dist.ProcessGroup) else dist.group.WORLD
    return dist.get_group_rank(group, dist.get_rank()), list(dist.get_process_group_ranks(group))


def group_ranks(group: Any) -> list | None:
    """The global ranks of ``group``, or of each group of a tuple (a device mesh's dimensions);
    None where there is no usable group."""
    if isinstance(group, tuple):
        return [group_ranks(member) for member in group]
    if group is None or not initialized() or not isinstance(group, dist.ProcessGroup):
        return None
    return list(dist.get_process_group_ranks(group))


def rank_in_group(group: Any) -> int | None:
    """This rank's index in ``group``, or None when there is no usable group."""
    if group is None or not initialized() or not isinstance(group, dist.ProcessGroup):
        return None
    return dist.get_group_rank(group, dist.get_rank())


#: (the world's group, the monitor's gloo group over it or None), made at the first agreement
_agreement_groups: list[tuple[Any, Any]] = []


def same_on_every_rank(value: int, device: torch.device) -> bool:
    """Whether ``value`` (below 2**62) is the same on every rank of the world; every rank must
    call it at the same point (one small all_reduce of the maximum and the negated minimum, in
    the group ``any_rank`` agrees in)."""
    if world_size() <= 1:
        return True
    group, on_cpu = _agreement_group(device)
    pair = torch.tensor([value, -value], dtype=torch.int64, device="cpu" if on_cpu else device)
    with REGISTRY.unobserved():
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = pair.tolist()
    return highest == -lowest


def _agreement_group(device: torch.device) -> tuple[Any, bool]:
    """The group the monitor's agreements reduce in, and whether they reduce CPU tensors there."""
    world = dist.group.WORLD
    if not _agreement_groups or _agreement_groups[-1][0] is not world:
        _agreement_groups[:] = [(world, _gloo_group())]
    group = _agreement_groups[-1][1]
    return group, group is not None or "gloo" in str(dist.get_backend()) or device.type == "meta"


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of the world (one small all_reduce, unseen by
    cc_distribution); every rank must call it at the same point.

    The flag is reduced on the CPU, in a gloo group of the monitor's own over the world (made at
    the first call, which every rank reaches at the same point): reading the result of an
    all-reduce on an accelerator's group (NCCL) would wait for everything queued on the device,
    a host sync at every step. A torch built without gloo reduces on the default group instead,
    on ``device`` where that group cannot reduce CPU tensors.
    """
    if world_size() <= 1:
        return flag
    group, on_cpu = _agreement_group(device)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device="cpu" if on_cpu else device)
    with REGISTRY.unobserved():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _gloo_group() -> Any:
    """A gloo group over the world, or None where this torch has no gloo or the group cannot be
    made (said once): the agreement then runs on the default group."""
    fallback = "alert.actions agree on the default process group, which waits for the device at every step"
    if not dist.is_gloo_available():
        logger.warning("trainmon: this torch has no gloo backend: %s", fallback)
        return None
    try:
        return dist.new_group(backend="gloo", timeout=_world_timeout())
    except Exception as exc:  # gloo cannot connect (a node that needs GLOO_SOCKET_IFNAME, say)
        logger.warning("trainmon: no gloo group could be made (%r): %s", exc, fallback)
        return None


def _world_timeout() -> datetime.timedelta | None:
    """The timeout the run gave its default group, so that the monitor's own group waits as long
    as the training's collectives do (a rank that saves a checkpoint for an hour is no fault);
    None (torch's default) where this torch does not tell it."""
    world = dist.group.WORLD
    for device in getattr(world, "_device_types", ()):
        try:
            timeout = world._get_backend(device).options._timeout
        except Exception:  # a private accessor: absent in some versions and back-ends
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


class StoreChannel:
    """Dynamic mode's announcements through the default process group's key-value store (the
    rendezvous store every rank already talks to): rank 0 stores each announcement under its
    number and counts it; the other ranks read the count each step (one round trip) and the
    announcements it grew by."""

    ANNOUNCEMENT, COUNT = "announcement", "count"

    def __init__(self, store: Any) -> None:
        self._store = dist.PrefixStore("trainmon/dynamic/", store)
        #: announcements made before this watch began (an earlier attach) are not followed
        self._seen = self._store.add(self.COUNT, 0)

    def publish(self, announcement: bytes) -> None:
        number = self._store.add(self.COUNT, 0) + 1  # rank 0 alone publishes
        self._store.set(f"{self.ANNOUNCEMENT}/{number}", announcement)
        self._store.add(self.COUNT, 1)

    def poll(self) -> list[bytes]:
        count = self._store.add(self.COUNT, 0)
        news = [bytes(self._store.get(f"{self.ANNOUNCEMENT}/{n}")) for n in range(self._seen + 1, count + 1)]
        self._seen = count
        return news


def schedule_channel() -> StoreChannel | None:
    """The channel of dynamic mode across ranks, None in one process or where torch offers no
    default store (reached through a private accessor: where a torch lacks it, the ranks follow
    the schedule file next to the config instead)."""
    if world_size() <= 1:
        return None
    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is None:
        return None
    try:
        return StoreChannel(default_store())
    except Exception:  # no store behind this process group: the schedule file
        return None
