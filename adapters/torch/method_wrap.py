"""Reversible wrapping of one method of one object (never of its class, which would reach every instance).

For framework objects that offer no hook API at the point the monitor must observe: the
``step`` of Megatron and DeepSpeed optimizer wrappers, ``start_grad_sync`` of Megatron's
gradient bucket groups. The wrapper is an instance attribute that shadows the class method;
``remove()`` puts back exactly what the instance had before (usually nothing, so the class
method shows through again). If something else wrapped the same method after us, ours stays in
that chain as a plain pass-through, and is skipped when the later wrapper restores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class MethodWrap:
    """Runs ``before(obj, args, kwargs)`` before each call of ``obj.<name>`` and, if given,
    ``after(obj, args, kwargs)`` after it returns.

    The original gets the caller's arguments and its result is returned unchanged (and kept as
    ``last_result`` until the next call: what a step reported, read by ``after``'s owner); an
    exception from ``before`` or from the original propagates and skips the rest, as with
    torch's optimizer step hooks.
    """

    def __init__(self, target: Any, name: str, before: Callable, after: Callable | None = None) -> None:
        self.target, self.name = target, name
        own = vars(target)
        self._had_own, self._previous = name in own, own.get(name)
        inner = getattr(target, name)
        self.active = True
        self.last_result: Any = None

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return inner(*args, **kwargs)
            before(target, args, kwargs)
            self.last_result = None
            result = self.last_result = inner(*args, **kwargs)
            if after is not None:
                after(target, args, kwargs)
            return result

        wrapper.method_wrap = self
        self._wrapper = wrapper
        setattr(target, name, wrapper)

    def remove(self) -> None:
        """Restore the method (idempotent), skipping wrappers of ours below that were removed."""
        if not self.active:
            return
        self.active = False
        if vars(self.target).get(self.name) is not self._wrapper:
            return  # wrapped again after us: stay a pass-through until that wrapper is gone
        had_own, previous = self._had_own, self._previous
        below = getattr(previous, "method_wrap", None)
        while had_own and isinstance(below, MethodWrap) and not below.active:
            had_own, previous = below._had_own, below._previous
            below = getattr(previous, "method_wrap", None)
        if had_own:
            setattr(self.target, self.name, previous)
        else:
            delattr(self.target, self.name)
