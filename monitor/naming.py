"""Tags and names: chunk prefix "N:", squash_name, target matching, tag grammar, as msprobe spells them.

Everything here runs at attach time; hooks only look up precomputed strings.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

#: separator between the virtual-pipeline chunk index and a name, as in "0:layers.0.fc1".
CHUNK_SEP = ":"

# Later msprobe releases' rule: the keyword is kept and its last occurrence after a dot wins;
# the first pattern that matches decides. Unlike msprobe, the start of the name counts as
# a dot, so "layers.0.norm2.weight" stays whole instead of collapsing to "norm2.weight" (which
# collides across layers); every name msprobe keeps whole is unchanged.
_SQUASH_PATTERNS = tuple(
    re.compile(p)
    for p in (
        r".*\.(layers?\..*)",
        r".*\.(embeddings?\..*)",
        r".*\.(final.*)",
        r".*\.(output.*)",
        r".*\.(norm.*)",
    )
)


#: name segments that wrappers insert and no model names itself: torch.compile, FSDP1, checkpointing.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
#: the module a model chunk's wrappers hold (DDP, DeepSpeed, Float16Module, nested).
_CHUNK_WRAPPER_CHILD = re.compile(r"(module\.)*module")


def wrapped_twins(named: Iterable[tuple[int, str]]) -> set[tuple[int, str]]:
    """The modules among ``(vpp_stage, raw_name)`` that a wrapper holds as its only child: the
    ``module`` of a model chunk's wrappers (DDP, DeepSpeed, Megatron's Float16Module) and the
    wrapped module of FSDP1, checkpointing and torch.compile anywhere. The wrapper's call is
    theirs, with the same tensors (Float16Module casts fp32 inputs to fp16 on the way in), so
    their rows would repeat the wrapper's under another name."""
    named = list(named)
    children: Counter = Counter((vpp, raw.rpartition(".")[0]) for vpp, raw in named if raw)
    twins = set()
    for vpp, raw in named:
        parent, _, last = raw.rpartition(".")
        wrapper_child = last in _WRAPPER_SEGMENTS or _CHUNK_WRAPPER_CHILD.fullmatch(raw) is not None
        if raw and wrapper_child and children[(vpp, parent)] == 1:
            twins.add((vpp, raw))
    return twins


def unwrapped_name(name: str) -> str:
    """The name without what wrappers add: leading ``module.`` (DDP, DeepSpeed, Megatron's
    Float16Module) and the segments of torch.compile, FSDP1 and activation checkpointing."""
    name = _without_ddp_prefix(name)
    if "_" in name:
        name = ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)
    return name


def squash_name(name: str) -> str:
    """Shorten a module or parameter name the way msprobe's later versions do.

    ``module.decoder.layers.3.mlp.weight`` -> ``layers.3.mlp.weight``;
    ``module.language_model.output_layer.weight`` -> ``output_layer.weight``. Unlike msprobe,
    what wrappers add is dropped first, so that ``module.lm_head.weight`` (no keyword) becomes
    ``lm_head.weight`` like its neighbours instead of keeping DDP's prefix alone among them.
    """
    name = unwrapped_name(name)
    dotted = "." + name
    for pattern in _SQUASH_PATTERNS:
        match = pattern.fullmatch(dotted)
        if match:
            return match.group(1)
    return name


def chunk_name(vpp_stage: int, name: str) -> str:
    """``"{vpp_stage}:{name}"``."""
    return f"{vpp_stage}{CHUNK_SEP}{name}"


def build_tag(vpp_stage: int, name: str, rank: int | None, task: str, micro_step: int | None = None) -> str:
    """msprobe's tag grammar: ``N:name[:m]/rank{R}/task`` (no rank segment when rank is None)."""
    head = chunk_name(vpp_stage, name)
    if micro_step is not None:
        head = f"{head}{CHUNK_SEP}{micro_step}"
    if rank is None:
        return f"{head}/{task}"
    return f"{head}/rank{rank}/{task}"


def split_tag(tag: str) -> tuple[int, str, int | None, str]:
    """Inverse of build_tag: ``(vpp_stage, name, micro_step or None, task)``.

    Tags without a chunk prefix get vpp_stage 0 and the whole head as name.
    """
    head, _, rest = tag.partition("/")
    task = rest.rsplit("/", 1)[-1] if rest else ""
    vpp_text, sep, remainder = head.partition(CHUNK_SEP)
    if not sep or not vpp_text.isdigit():
        return 0, head, None, task
    name, sep, micro_text = remainder.rpartition(CHUNK_SEP)
    if sep and micro_text.isdigit():
        return int(vpp_text), name, int(micro_text), task
    return int(vpp_text), remainder, None, task


def display_name(raw_name: str, squash: bool) -> str:
    """Name shown in outputs for a raw module/parameter name."""
    return squash_name(raw_name) if squash else raw_name


def name_candidates(vpp_stage: int, raw_name: str, squashed: str) -> tuple[str, ...]:
    """The spellings a targets key may use for one module/parameter.

    Raw and squashed names, with and without the chunk prefix, and without the leading segments
    that wrappers add (``WRAPPER_PREFIXES``).
    """
    names = dict.fromkeys((raw_name, squashed, _without_wrapper_prefix(raw_name)))
    prefixed = [chunk_name(vpp_stage, n) for n in names]
    return tuple(dict.fromkeys([*names, *prefixed]))


#: leading segments that wrappers add to every name of the model they wrap: DDP, DeepSpeed and
#: Megatron (``module.``), PEFT's PeftModel around a LoRA model (``base_model.model.``)
WRAPPER_PREFIXES = ("module.", "base_model.model.")


def without_wrapper(keys: Iterable[str], raw_names: Iterable[str]) -> tuple[str, ...]:
    """The targets keys as they select among a model's ``raw_names``: a wrapper's leading
    segments are dropped from the keys where no name of the model starts with them (a config
    written for a DDP- or PEFT-wrapped model, reused on the bare one); where one does (the
    wrapper, or a submodule really called ``module``), every key is taken as written."""
    keys = tuple(keys)
    prefixes = [p for p in WRAPPER_PREFIXES if any(key.startswith(p) for key in keys)]
    if not prefixes:
        return keys
    raw_names = tuple(raw_names)
    if any(raw == p[:-1] or raw.startswith(p) for p in prefixes for raw in raw_names):
        return keys
    return tuple(_without_wrapper_prefix(key) for key in keys)


def _without_ddp_prefix(name: str) -> str:
    """The name without the leading ``module.`` segments that DDP-like wrappers add."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _without_wrapper_prefix(name: str) -> str:
    """The name without the leading segments that wrappers add."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


def key_selects(key: str, candidate: str) -> bool:
    """True when a targets key selects a name: exact, or a dotted prefix on a name boundary.

    ``layers.1`` selects ``layers.1`` and ``layers.1.fc.weight`` but not ``layers.10``.
    """
    if not key:
        return True
    if key.endswith("."):  # "layers." is already a boundary: every child of layers
        return candidate.startswith(key)
    return candidate == key or candidate.startswith(key + ".")


def is_selected_exactly(keys: Iterable[str], candidates: Iterable[str]) -> bool:
    """True when a targets key names one spelling of the name exactly (modules, as msprobe does)."""
    keys = set(keys)
    return any(c in keys for c in candidates)


def is_selected(keys: Iterable[str], candidates: Iterable[str]) -> bool:
    """True when any targets key selects any spelling of the name (no keys: everything)."""
    keys = tuple(keys)
    if not keys:
        return True
    candidates = tuple(candidates)
    return any(key_selects(k, c) for k in keys for c in candidates)


def select_names(
    named: Iterable[tuple[int, str]],
    targets: Iterable[str],
    squash: bool,
    identities: Sequence[Hashable] | None = None,
) -> list[tuple[int, str]]:
    """The monitored ones among ``(vpp_stage, raw_name)`` pairs, with their display names.

    Returns ``(position, display_name)`` for every pair that ``targets`` selects (all of them
    when there are no targets), in input order, with names made distinct (``distinct_names``).
    With ``identities`` (one per pair, e.g. ``id()`` of the parameter), an object already
    selected under another name is skipped: a parameter shared by several chunks is monitored
    once, under its first selected name.
    """
    named = list(named)
    keys = without_wrapper(targets, (raw for _, raw in named))
    chosen: list[tuple[int, int, str]] = []
    seen: set[Hashable] = set()
    for position, (vpp, raw) in enumerate(named):
        if identities is not None and identities[position] in seen:
            continue
        if not is_selected(keys, name_candidates(vpp, raw, squash_name(raw))):
            continue
        if identities is not None:
            seen.add(identities[position])
        chosen.append((position, vpp, raw))
    names = distinct_names([(vpp, raw) for _, vpp, raw in chosen], squash)
    return [(position, name) for (position, _, _), name in zip(chosen, names)]


def unmatched_targets(
    targets: Iterable[str], named: Iterable[tuple[int, str]], suggest: int = 5, prefixes: bool = True
) -> list[tuple[str, str | None]]:
    """Each targets key that selects none of the ``(vpp_stage, raw_name)`` pairs (a model's
    modules and parameters), with the closest name there for the first ``suggest`` of them (None
    when none is close): such a key is a typo or a name of another model, and would otherwise be
    ignored in silence. Without ``prefixes`` a key must be a whole name (``l2_targets``).

    One pass over the names: a key selects a name when it is one of the name's spellings or a
    dotted prefix of one (``key_selects``), so the set of every spelling's dotted prefixes answers
    each key at once.
    """
    keys = [key for key in targets if key]
    if not keys:
        return []
    named = list(named)
    spellings = {c for vpp, raw in named for c in name_candidates(vpp, raw, squash_name(raw))}
    parents: set[str] = set()  # dotted prefixes that have a child
    for spelling in spellings:
        cut = spelling.rfind(".")
        while cut > 0 and spelling[:cut] not in parents:
            parents.add(spelling[:cut])
            cut = spelling.rfind(".", 0, cut)
    bare = dict(zip(keys, without_wrapper(keys, (raw for _, raw in named)), strict=True))
    unmatched = [
        key
        for key, b in bare.items()
        if not (b in spellings or (prefixes and (b in parents or (b.endswith(".") and b[:-1] in parents))))
    ]
    short = list(dict.fromkeys(squash_name(raw) for _, raw in named)) if unmatched else []  # a spelling
    return [(key, _closest(key, short) if i < suggest else None) for i, key in enumerate(unmatched)]


def _closest(key: str, names: list[str]) -> str | None:
    """The name closest to ``key``, among at most 500 that share its first segment where possible."""
    head = key.split(".", 1)[0]
    near = [name for name in names if name.split(".", 1)[0] == head]
    close = difflib.get_close_matches(key, (near or names)[:500], n=1)
    return close[0] if close else None


def select_objects(
    found: Sequence[tuple[int, str, Any]], targets: Iterable[str], squash: bool
) -> list[tuple[int, str, str, Any]]:
    """The monitored ones among ``(vpp_stage, raw_name, object)`` triples (a framework's named
    parameters), as ``(vpp_stage, display_name, raw_name, object)`` in input order: selected by
    ``targets``, names made distinct, an object shared by several chunks once (``select_names``)."""
    chosen = select_names(
        [(vpp, raw) for vpp, raw, _ in found], targets, squash, identities=[id(obj) for _, _, obj in found]
    )
    return [(found[i][0], name, found[i][1], found[i][2]) for i, name in chosen]


def distinct_names(named: Sequence[tuple[int, str]], squash: bool) -> list[str]:
    """Display names of ``(vpp_stage, raw_name)`` pairs, distinct within each chunk.

    Where squashing gives two names of one chunk the same short name (``blocks.0.norm.weight``
    and a final ``norm.weight`` both become ``norm.weight``), every one of them keeps its full
    name instead, so neither takes the other's rows (msprobe lets them collide).
    """
    shown = [display_name(raw, squash) for _, raw in named]
    counts = Counter((vpp, name) for (vpp, _), name in zip(named, shown))
    return [
        unwrapped_name(raw) if counts[(vpp, name)] > 1 else name for (vpp, raw), name in zip(named, shown)
    ]
