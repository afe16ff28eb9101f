"""torch.compile: what the monitor does so that compiled models give eager's rows.

- Names: ``torch.compile(module)`` wraps a module in an ``OptimizedModule`` holding it as
  ``_orig_mod``; the monitor hooks and names the module inside (``uncompiled``; the naming drops
  ``_orig_mod`` segments of blocks compiled inside the model).
- Module hooks do nothing while torch.compile traces them (``traced``): compiled code is the
  unmonitored model's, whenever the hooks were added, with no graph break, no guard on the
  monitor's state and so no recompilation from one step to the next.
- Steps whose hooks measure inside the model's compiled code run that code eagerly
  (``CompiledModel``): torch.compile's public ``"force_eager"`` stance is set for them, and the
  stance found is put back afterwards (``Stance``), so the hooks see eager's tensors, code
  compiled with ``fullgraph=True`` included. Only a model that runs compiled code gets it; the
  stance is the process's, so on those steps any other compiled code runs eagerly too.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

logger = logging.getLogger("trainmon")


def _wrapped_by_compile(module: torch.nn.Module) -> bool:
    """Whether torch.compile wrapped the module: an ``OptimizedModule``, also as the class that
    ``fully_shard`` makes of it (``FSDPOptimizedModule``, torchtitan's order: compile, then shard),
    which the class's name alone missed."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)


def uncompiled(chunk: torch.nn.Module) -> torch.nn.Module:
    """The module that torch.compile wrapped (OptimizedModule keeps it as ``_orig_mod``), so that
    names and hooks are those of the eager model."""
    inner = getattr(chunk, "_orig_mod", None)
    if _wrapped_by_compile(chunk) and isinstance(inner, torch.nn.Module):
        return inner
    return chunk


class _CompiledCode:
    """Whether compiled code has run hooks of the monitor in this process (``traced``), or a
    model with compiled modules was attached (``CompiledModel``)."""

    ran_hooks = False


#: one instance: torch.compile replays a store to its attribute each time the compiled code runs
COMPILED_CODE = _CompiledCode()


def traced() -> bool:
    """Whether torch.compile (or export) is tracing the calling hook rather than running it; a
    constant to the tracer, so a hook that returns on it leaves nothing in the compiled code but
    the note that compiled code ran it (``COMPILED_CODE``). The note is stored only while it is
    unset: inside a higher-order op (activation checkpointing's) torch.compile refuses any
    store, and each trace of a checkpointed block failed and left it to run eagerly for good."""
    if torch.compiler.is_compiling():
        if not COMPILED_CODE.ran_hooks:
            COMPILED_CODE.ran_hooks = True
        return True
    return False


def has_compiled_modules(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether any of the modules, or a submodule, was compiled (wrapped by torch.compile, or
    compiled in place with ``module.compile()``); False while torch.compile was never imported."""
    if "torch._dynamo" not in sys.modules:
        return False
    return any(
        _wrapped_by_compile(m) or getattr(m, "_compiled_call_impl", None) is not None
        for module in modules
        for m in module.modules()
    )


class CompiledModel:
    """One collection's view of whether its model runs compiled code, and its hold on the eager
    stance for the steps its hooks measure.

    The model is known to run compiled code when it was given compiled (or ``compiled=True``),
    when a module of it is compiled (checked at each measuring step until found, at its first
    forward too: blocks may be compiled after ``set_monitor``), or once compiled code ran a hook
    of the monitor (a whole model given uncompiled without saying so, or a compiled
    ``forward`` or function calling the model's modules: that step's hooks measured nothing,
    which is said)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], given_compiled: bool) -> None:
        self.chunks = list(chunks)
        self.known = given_compiled
        self.wanted = False
        self._held = False
        self._looked = False
        self._said_late = False
        self._step = -1
        weakref.finalize(self, Stance.hold, id(self), False)  # a collection dropped without remove()

    def register(self) -> list:
        """Pre-hooks on the chunks' roots (run first): they see compiled code run the root, and
        compiled blocks met at the first forward of a measuring step."""
        self._compiled()  # compiled blocks known before their first trace
        return [chunk.register_forward_pre_hook(self._root_called, prepend=True) for chunk in self.chunks]

    def _root_called(self, module: torch.nn.Module, args: Any) -> None:
        if traced():
            return
        if self.wanted and not self._held and not self._looked:  # outside compiled code: may switch
            self._looked = True  # once a step: the first forward finds blocks compiled since
            if self._compiled():
                self._hold(True)

    def step_begins(self, step: int, wanted: bool) -> None:
        """Before ``step``: whether its hooks measure; the stance follows."""
        if self.wanted and not self._held and COMPILED_CODE.ran_hooks and not self._said_late:
            self._said_late = True
            logger.warning(
                "trainmon: compiled code ran the monitor's hooks, a model compiled as a whole that "
                "set_monitor got uncompiled without compiled=True, or a compiled forward or "
                "function: the hooks inside it recorded nothing at step %d; from "
                "the next step on, steps they measure run it eagerly. Pass the compiled model, or "
                "compiled=True, to set_monitor to record that step too.",
                self._step,
            )
        self._step = step
        self.wanted = wanted
        self._looked = False
        self._hold(wanted and self._compiled())

    def release(self) -> None:
        self.wanted = False
        self._hold(False)

    def _compiled(self) -> bool:
        self.known = self.known or COMPILED_CODE.ran_hooks or has_compiled_modules(self.chunks)
        if self.known and not COMPILED_CODE.ran_hooks:  # set before any trace stores it (``traced``)
            COMPILED_CODE.ran_hooks = True
        return self.known

    def _hold(self, eager: bool) -> None:
        self._held = eager
        Stance.hold(id(self), eager)


class Stance:
    """torch.compile's ``"force_eager"`` stance while any collection holds it (several monitors may
    share the process). The stance found before is put back after the last holder; a stance the
    user set meanwhile is theirs: it is left, and the one put back after later holds."""

    _holders: ClassVar[set[int]] = set()
    #: torch's stance setter (its exit puts back the stance found) and the stance it set
    _setter: ClassVar[Any] = None
    _said: ClassVar[bool] = False
    _said_replaced: ClassVar[bool] = False
    #: ``_apply`` run eagerly even where a compiled optimizer step traces the monitor's hook
    _eager_apply: ClassVar[Callable[[], None] | None] = None

    @classmethod
    def hold(cls, holder: int, eager: bool) -> None:
        """Whether ``holder`` wants compiled code run eagerly from now on. Never raises: where the
        stance cannot change it is tried again at the next call, and said once."""
        if eager:
            cls._holders.add(holder)
        else:
            cls._holders.discard(holder)
        if not cls._holders and cls._setter is None:
            return
        try:
            if cls._eager_apply is None:
                cls._eager_apply = torch.compiler.disable(cls._apply)
            cls._eager_apply()
        except Exception as exc:
            if not cls._said:
                cls._said = True
                logger.warning(
                    "trainmon: could not switch torch.compile's stance (%r): on steps where it stays, "
                    "module hooks inside compiled code (activations, attention features) record nothing",
                    exc,
                )

    @classmethod
    def _apply(cls) -> None:
        current = getattr(sys.modules.get("torch._dynamo.eval_frame"), "_stance", None)
        if cls._setter is not None and current is not None and current is not cls._setter.stance:
            cls._setter = None  # the user set a stance while held: theirs from now on
            if not cls._said_replaced:
                cls._said_replaced = True
                logger.warning(
                    'trainmon: torch.compile\'s stance was changed while the monitor held "force_eager" '
                    "for a step it measures: module hooks inside compiled code may have recorded "
                    "nothing then; yours is kept on the steps the monitor does not measure"
                )
        if cls._holders and cls._setter is None:
            cls._setter = torch.compiler.set_stance("force_eager")
        elif not cls._holders and cls._setter is not None:
            setter, cls._setter = cls._setter, None
            setter.__exit__(None, None, None)
