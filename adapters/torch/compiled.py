"""torch.compile: what the monitor does so that compiled models give eager's rows.

- Names: ``torch.compile(module)`` wraps a module in an ``OptimizedModule`` holding it as
  ``_orig_mod``; the monitor hooks and names the module inside (``uncompiled``; the naming drops
  ``_orig_mod`` segments of blocks compiled inside the model).
- Hook bodies: a module hook is traced into the compiled code. Its check of the monitor's
  ``collect`` flag stays traceable, so torch.compile guards on it and steps that are not
  collected run code without any break of the monitor's; the measuring body runs eagerly
  (``eager``), one graph break per hooked call on collected steps.
- Code compiled with ``fullgraph=True`` (or under ``torch._dynamo.error_on_graph_break(True)``)
  makes every graph break an error, which would end the user's run at the first collected step:
  there the hooks measure nothing (``graph_breaks_allowed``, asked while torch.compile traces) and
  the monitor says so once.
- Hooks added after the first compiled call: torch.compile does not guard on module hooks (its
  ``skip_nnmodule_hook_guards``), so compiled code never runs hooks added later, and never says
  so. When the monitor adds module hooks to a model holding compiled modules, it resets
  torch.compile's caches once (``recompile_with_hooks``, the public ``torch.compiler.reset``):
  the next call compiles again, now with the hooks. Attaching before the first compiled call
  avoids that recompilation.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger("trainmon")


def uncompiled(chunk: torch.nn.Module) -> torch.nn.Module:
    """The module that torch.compile wrapped (OptimizedModule keeps it as ``_orig_mod``), so that
    names and hooks are those of the eager model."""
    inner = getattr(chunk, "_orig_mod", None)
    if type(chunk).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module):
        return inner
    return chunk


def eager(measure: Callable[..., None]) -> Callable[..., None]:
    """``measure``, run eagerly where a hook calling it is traced by torch.compile; skipped where
    the compiled code may not break its graph."""
    disabled = torch.compiler.disable(measure, recursive=True)  # imports torch._dynamo (0.6 s) once
    from torch._dynamo.decorators import assume_constant_result

    assume_constant_result(graph_breaks_allowed)

    def run(*args: object) -> None:
        if graph_breaks_allowed():
            disabled(*args)

    return run


def graph_breaks_allowed() -> bool:
    """Whether the code torch.compile is tracing now may break its graph (True outside tracing).
    Marked (by ``eager``) as a constant for torch.compile, which calls it once while tracing and
    keeps the answer in the compiled code, so hooks traced under ``fullgraph=True`` compile to
    nothing instead of failing."""
    if not torch.compiler.is_compiling():  # the hook runs eagerly
        return True
    try:  # torch.compile's own tracer; were its private names to change, hooks break graphs as before
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tracing = InstructionTranslator.current_tx()
        if not (tracing.one_graph or tracing.error_on_graph_break):
            return True
    except Exception:
        return True
    global _said_fullgraph
    if not _said_fullgraph:
        _said_fullgraph = True
        logger.warning(
            "trainmon: module hooks run inside code compiled with fullgraph=True (or with "
            "error_on_graph_break), where measuring would break the graph and so fail your run: "
            "activations and the other module-hook data (attention features, structure, call counts) "
            "of those modules are not recorded; compile them without fullgraph to get them"
        )
    return False


_said_fullgraph = False


def has_compiled_modules(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether any of the modules, or a submodule, was compiled (wrapped by torch.compile, or
    compiled in place with ``module.compile()``)."""
    return any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for module in modules
        for m in module.modules()
    )


def recompile_with_hooks(what: str) -> None:
    """Reset torch.compile's caches once, so that compiled code runs the module hooks just added;
    nothing to do while torch.compile has compiled nothing in this process (attached before the
    first compiled call: the code compiled then holds the hooks)."""
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.utils import counters

    if not counters["frames"].get("total"):
        return
    torch.compiler.reset()
    logger.info(
        "trainmon: %s: the model holds compiled modules; torch.compile's caches are reset once so that "
        "the next call compiles again with the monitor's module hooks (compiled code never runs hooks "
        "added after it was compiled). Attach before the first compiled call to avoid recompiling.",
        what,
    )
