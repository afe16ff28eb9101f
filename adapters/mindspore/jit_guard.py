"""Hooks that a function compiled with ``mindspore.jit`` leaves out instead of failing to compile.

MindSpore compiles the hooks of every Cell and tensor a ``jit`` function reaches into its graph.
The monitor's hooks keep Python state (counters, dicts, the statistics engine), which the graph
compiler rejects: a PyNative loop whose step was decorated with ``mindspore.jit`` and attached
without ``graph_mode=True`` stopped at its first step with a compiler error pointing into the
monitor. Each hook is therefore wrapped so that it returns at once in a compilation. The test is
a ``constexpr``: PyNative calls it as a plain function (about a microsecond), while the compiler
evaluates it in Python during compilation, with the function given to it turned into None, and
folds the branch, so the hook's body is never read there.

That evaluation is also how the monitor learns that a compiled function holds its hooks: it says
what to do, once, and removes the hooks of the Cells and Parameters of the model: MindSpore parses
a tensor hook whole (a guard does not keep the compiler out of it) and fails to compile even an
empty forward hook of a Cell called in a loop of ``construct``. A do-nothing pre-hook, first on
each chunk's root, is met before the compiler reads any of them. The collection registers them
again at the optimizer's next update (``restore``): a function that reuses its compiled graph
meets none of them, and one compiled again removes them again.

The function-becomes-None behaviour is MindSpore's own test for running in ``jit``
(``mindspore.graph.api._run_in_jit``, which cannot be called from a hook: it imports inside its
body, a statement the compiler refuses). Where ``constexpr`` is missing or no longer behaves so,
hooks are registered as they are, and a compiled step fails as before.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("trainmon")

#: whose hooks a compilation met -> what the user is told
TRAINING_STEP = "training step"
MODEL_CALLS = "model calls"
_MESSAGES = {
    TRAINING_STEP: (
        "trainmon: the training step is compiled with mindspore.jit: the monitor's hooks are left out "
        "of it and record nothing. Attach with set_monitor(..., graph_mode=True) and call "
        "mon.step_end() after each step: parameters and Adam's moments are then read between steps"
    ),
    MODEL_CALLS: (
        "trainmon: a function compiled with mindspore.jit calls the monitored model. MindSpore "
        "compiles the hooks of every Cell and Parameter such a function reaches and refuses most "
        "Python in them (even an empty forward hook of a Cell called in a loop), so the monitor "
        "removed its hooks while it compiles: gradients before the optimizer, activations, attention "
        "features, print_struct and stack_info record nothing from then until the optimizer's next "
        "update puts them back (a compiled evaluation, say); if it is the training step, attach with "
        "set_monitor(..., graph_mode=True) and call mon.step_end() after each step"
    ),
}
#: key (a constant the compiler hands back) -> the hooks registered under it
_OWNERS: weakref.WeakValueDictionary[int, LeftOutOfJit] = weakref.WeakValueDictionary()
_keys = itertools.count()


def _probe() -> int:
    return 0


def _compiling_for(func: Any, key: int) -> bool:
    """True while the compiler evaluates a hook (it passes None for ``func``), after telling its
    owner; False when called from Python."""
    if func is not None:
        return False
    owner = _OWNERS.get(key)
    if owner is not None:
        try:
            owner.met()
        except Exception:  # a fault of ours never fails the user's compilation
            logger.debug("trainmon: leaving hooks out of a jit compilation failed", exc_info=True)
    return True


def _nothing(cell: Any, args: Any) -> None:
    return None


def _constexpr() -> Callable[[Callable], Callable] | None:
    try:
        from mindspore.ops import constexpr
    except ImportError:
        return None
    return constexpr(check=False, reuse_result=False)


_DECORATE = _constexpr()
_compiling = _DECORATE(_compiling_for) if _DECORATE is not None else None
if _compiling is not None and _compiling(_probe, -1) is not False:
    _compiling = None


class LeftOutOfJit:
    """The hooks of one part of the monitor, each returning at once where a ``jit`` compilation
    meets it. The first meeting says so (``whose`` picks the words) and, with
    ``removes``, removes the handles given to ``keep``."""

    def __init__(self, whose: str, removes: bool = False) -> None:
        self.whose, self.removes = whose, removes
        self.said = False
        self.key = next(_keys)
        #: each registration kept, with the handles its last call returned (None: removed)
        self._kept: list[tuple[Callable[[], list[Any]], list[Any] | None]] = []
        self._closed = False
        _OWNERS[self.key] = self

    def cell_hook(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """A Cell hook (forward or pre-forward, with or without keyword arguments). Not
        ``functools.wraps``: the compiler follows ``__wrapped__`` and would read the hook itself."""
        if _compiling is None:
            return hook
        probe, compiling, key = _probe, _compiling, self.key

        def guarded(cell: Any, *rest: Any) -> Any:
            if compiling(probe, key):
                return None
            return hook(cell, *rest)

        return guarded

    def sentinels(self, chunks: Sequence[Any]) -> list[Any]:
        """Pre-hooks, first on each chunk's root, that do nothing in Python: a compilation that
        calls the model meets them before it reads a hook of the Cells or Parameters inside."""
        return self.keep(
            lambda: [
                chunk.register_forward_pre_hook(self.cell_hook(_nothing), prepend=True) for chunk in chunks
            ]
        )

    def keep(self, register: Callable[[], list[Any]]) -> list[Any]:
        """Register hooks now (``register()`` returns their handles) and again at ``restore()``
        after a compilation removed them (with ``removes``); returns the handles."""
        handles = register()
        self._kept.append((register, handles))
        return handles

    def met(self) -> None:
        """A compilation met one of these hooks: say so once, and remove them where asked."""
        if not self.said:
            self.said = True
            logger.warning(_MESSAGES[self.whose])
        if self.removes:
            self._take_off()

    def restore(self) -> None:
        """Register again what a compilation removed (call outside any call of the model's
        Cells: MindSpore iterates a Cell's hook dict while it calls them). A compilation that
        reuses its graph meets none of them; one that compiles again removes them again."""
        if self._closed:
            return
        try:
            for index, (register, handles) in enumerate(self._kept):
                if handles is None:
                    self._kept[index] = (register, register())
        except Exception as exc:  # never the training's problem: the hooks stay off, said once
            self.remove()
            logger.error(
                "trainmon: putting back the hooks a jit compilation removed failed (%r); they stay off", exc
            )

    def remove(self) -> None:
        """Remove every hook kept, for good (a handle of the collection that owns them: at its end)."""
        self._closed = True
        self._take_off()

    def _take_off(self) -> None:
        for _, handles in self._kept:
            for handle in handles or ():
                handle.remove()
        self._kept = [(register, None) for register, _ in self._kept]
