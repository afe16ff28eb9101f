"""Reversible, per-instance wrapping of MindSpore's collective primitives, shared by every monitor.

In PyNative mode a collective is a primitive *instance* (``ops.AllReduce()``, usually created
once in a Cell's ``__init__`` and called in ``construct``); calling it runs
``Primitive.__call__``. MindSpore looks special methods up on the class, so an instance is
wrapped by giving it a subclass of its own class (same name and module) whose ``__call__``
tells the monitors (as a ``PrimitiveCall``) and calls the original ``__call__`` with the
caller's arguments, returning its result unchanged. Nothing is changed on MindSpore's classes or
modules; ``isinstance`` checks keep working; ``type(p) is ops.AllReduce`` is False while ``p``
is wrapped.

The instances are found by a scan of the live objects (``gc.get_objects()``, tens of
milliseconds, at install and once more at the start of the second step, when the training
loop's own objects exist). Instances created later (``ops.AllReduce()(x)`` written inline makes
a new one per call) are not seen.

One process-wide ``REGISTRY`` owns the wrapping (``monitor.collectives.registry``): the first subscriber
wraps, the last one to leave gives every instance its own class back; monitors in between only
subscribe.

Calls made inside a ``jit``-compiled Cell (``nn.DistributedGradReducer`` is one) run in the
compiled graph and never reach ``__call__``: they are not seen.
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref

from mindspore import ops

from monitor.collectives.registry import WrapperRegistry

logger = logging.getLogger("trainmon")

#: the collective primitives that run on CPU (mccl); ReduceScatter has no CPU kernel in MindSpore.
COLLECTIVES: tuple[type, ...] = (ops.AllReduce, ops.AllGather, ops.Broadcast)


class PrimitiveCall:
    """One call of a wrapped primitive, as the monitors see it."""

    __slots__ = ("args", "name", "primitive")

    def __init__(self, name: str, args: tuple, kwargs: dict) -> None:
        self.name, self.primitive, self.args = name, args[0], args[1:]


class WrapRegistry(WrapperRegistry):
    """The wrapped primitive instances: subscribe wraps, the last unsubscribe gives them their class back."""

    def __init__(self) -> None:
        super().__init__()
        self._subclasses: dict[type, type] = {}
        #: id -> (weak reference to the instance, its own class) of every wrapped instance.
        self._wrapped: dict[int, tuple[weakref.ref, type]] = {}

    @property
    def wrapped(self) -> list[str]:
        """``AllReduce`` ... of the live wrapped instances, sorted."""
        return sorted(original.__name__ for ref, original in self._wrapped.values() if ref() is not None)

    def rescan(self) -> None:
        """Wrap the instances created since the last scan (while anyone subscribes)."""
        with self._lock:
            if self.subscribers:
                self._wrap()

    def _wrap(self) -> None:
        """Wrap the instances alive now."""
        self._wrapped = {key: entry for key, entry in self._wrapped.items() if entry[0]() is not None}
        new = [obj for obj in gc.get_objects() if type(obj) in COLLECTIVES]  # wrapped ones have our class
        for obj in new:
            original = type(obj)
            obj.__class__ = self._subclass(original)
            self._wrapped[id(obj)] = (weakref.ref(obj), original)
        if new:
            logger.info(
                "trainmon: watching %d MindSpore collective primitives (%s)",
                len(new),
                ", ".join(sorted({type(obj).__name__ for obj in new})),
            )

    def _restore(self) -> None:
        for ref, original in self._wrapped.values():
            obj = ref()
            if obj is not None and type(obj) is self._subclasses.get(original):
                obj.__class__ = original
        self._wrapped = {}

    def _subclass(self, original: type) -> type:
        subclass = self._subclasses.get(original)
        if subclass is None:
            subclass = self._subclasses[original] = type(
                original.__name__,
                (original,),
                {
                    "__call__": self.observed(
                        original.__call__, functools.partial(PrimitiveCall, original.__name__)
                    ),
                    "__module__": original.__module__,
                    "__qualname__": original.__qualname__,
                },
            )
        return subclass


#: the one registry of this process.
REGISTRY = WrapRegistry()
