"""Which abnormal value of an incident's first step is its root, and why (and the root in words:
``describe_root``).

Works on anomaly records as the incidents file holds them (``Anomaly.details()``: rank, step,
micro_step, call_id, tag_name, op, value, baseline, rule, prefix, ratio, common), from one rank
while training or from every rank in ``anomaly-analyse``. The heuristics, in order:

1. **Causal phase.** Within a step things happen in a fixed order: the parameters the step
   starts from (``param_origin``), forward activations, activation gradients, each rank's local
   weight gradients, collectives, reduced weight gradients, optimizer state, the update. The
   earliest phase with an abnormal value holds the root; later ones are its consequences.
2. **Non-finite first.** Within that phase a NaN/Inf outranks a merely large value.
3. **The one that moved alone.** Clipping and loss scaling rescale every gradient by one factor,
   so a single corrupted tensor drags all the others with it and they are flagged too. Each
   record carries its ratio to its own recent level and the common ratio of its data type (the
   median over every tensor, flagged or not, where they moved together: at least three and half
   of them within a factor 2 of it); the record whose ratio differs from the common
   one by far the most is the root (of its micro-steps, the earliest that moved so).
4. **Call order.** Otherwise the earliest in the order the monitor saw them: in forward the one
   nearest the input, in backward the one nearest the loss; across pipeline stages, earlier
   stages first in forward and later ones first from the backward pass on.
5. **Ranks.** With several ranks, the ranks that show the first phase while their peers do not
   are named (a bad batch or a corrupted local gradient on one rank); with three or more ranks
   showing the same tensor, one whose value is far from its peers' median is preferred.
6. **Shared causes.** When the root's whole data type moved by SHARED_FACTOR or more with it
   (the median over every tensor, flagged or not), the evidence says that the cause is shared
   (the loss or its scale, the batch, the learning rate), even when the root is the only record.
   A root in the parameters or the forward pass whose gradients then moved as a whole (a loss
   computed inside the model) gets that said of the first gradient phase that did.
7. **Changed after backward.** Reduced gradients abnormal while no local gradient was (a step-wide
   comparison, not tensor by tensor) are said to have changed after backward: rescaled together
   (clipping, a loss scaler) when they moved as a whole, else in the reduction or in place; in
   one rank's own records, also that another rank's gradient may have reached them.
8. **Non-finite at once.** When three or more local weight gradients turned NaN/Inf at once
   (and no activation was abnormal before them), the tensor named is merely the one nearest the
   loss: the evidence says so.

Where they fail: a fault that first shows in a phase the monitor does not collect is named at
the first phase it does collect; when two faults start at one step the earlier phase wins; a
loss spike has no module of its own (every gradient rises together; the root is then the
tensor nearest the loss, with that evidence); the common ratio needs at least three tensors of
the data type with a history.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from monitor.anomaly.ordering import PHASES, phase_of
from monitor.anomaly.rules import NONFINITE
from monitor.naming import split_tag

Record = Mapping[str, Any]

PHASE_NAMES = {
    0: "parameters the step started from",
    1: "forward activations",
    2: "activation gradients",
    3: "local weight gradients (before reduction)",
    4: "collectives",
    5: "reduced weight gradients",
    6: "optimizer state",
    7: "parameter update",
    8: "other values",
}
#: a tensor must have moved this many times more (or less) than its data type's common move.
ALONE_FACTOR = 4.0
#: with three or more ranks, a value this far from its peers' median marks its rank.
PEER_FACTOR = 4.0
#: a data type whose tensors moved this much as a whole (their median), with the root, shares a cause.
SHARED_FACTOR = 2.0


def module_of(record: Record) -> str:
    """The module or parameter name of a record's tag (without chunk prefix, micro-step, rank, task)."""
    return split_tag(str(record["tag_name"]))[1]


def number(value: Any) -> float:
    """A record's number: JSON numbers, or non-finite ones written as strings; NaN when absent."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _order(record: Record) -> tuple:
    """When a record's value was computed, as far as records tell: by micro-step, then by
    pipeline stage (earlier stages first in forward, later ones first from the backward pass on,
    as in anomaly-analyse's ranking), then in the order one rank computed them."""
    stages = (int(record.get("vpp_stage") or 0), int(record.get("pp_stage") or 0))
    if phase_of(record) != PHASES["actv"]:
        stages = (-stages[0], -stages[1])
    return (
        int(record.get("micro_step", 0)),
        *stages,
        int(record.get("call_id", -1)),
        int(record["rank"]),
        str(record["tag_name"]),
    )


def _tensor_of(record: Record) -> tuple[str, str, Any]:
    """What a record describes whatever the rank: module, task and op (the reduced gradient of
    one tensor is the same on every data-parallel rank)."""
    return module_of(record), str(record["tag_name"]).rpartition("/")[2], record.get("op")


def _moved_alone(group: Sequence[Record]) -> tuple[Record, float, float] | None:
    """The record whose ratio to its level differs most from its data type's common ratio, when
    it differs by ALONE_FACTOR and by that factor more than any record of another tensor (the
    same tensor on other ranks does not count against it); else None."""
    scored = []
    for record in group:
        ratio, common = number(record.get("ratio")), number(record.get("common"))
        if ratio > 0 and common > 0 and math.isfinite(ratio) and math.isfinite(common):
            scored.append((abs(math.log(ratio / common)), record, ratio, common))
    if not scored:
        return None
    scored.sort(key=lambda item: (-item[0], _order(item[1])))
    best = scored[0]
    others = [item[0] for item in scored[1:] if _tensor_of(item[1]) != _tensor_of(best[1])]
    runner_up = others[0] if others else 0.0
    if best[0] < math.log(ALONE_FACTOR) or best[0] - runner_up < math.log(ALONE_FACTOR):
        return None
    # the same tensor on the same rank at an earlier micro-step, moved alone as well, came first
    same = [
        item
        for item in scored
        if _tensor_of(item[1]) == _tensor_of(best[1])
        and item[1]["rank"] == best[1]["rank"]
        and item[0] - runner_up >= math.log(ALONE_FACTOR)
    ]
    earliest = min(same, key=lambda item: _order(item[1]))
    return earliest[1], earliest[2], earliest[3]


def _peer_outlier(group: Sequence[Record], root: Record) -> tuple[Record, float] | None:
    """With 3+ ranks showing the root's tensor: the rank whose value is far from its peers' median."""
    same = [r for r in group if _tensor_of(r) == _tensor_of(root)]
    if len({int(r["rank"]) for r in same}) < 3:
        return None
    best = None
    for record in same:
        value = abs(number(record.get("value")))
        peers = [abs(number(r.get("value"))) for r in same if r is not record]
        peers = [p for p in peers if math.isfinite(p)]
        if not math.isfinite(value) or not peers:
            continue
        median = statistics.median(peers)
        factor = value / median if median > 0 else math.inf
        factor = max(factor, 1.0 / factor) if factor > 0 else math.inf
        if factor >= PEER_FACTOR and (best is None or factor > best[1]):
            best = (record, factor)
    return best


def choose_root(
    records: Sequence[Record], world_size: int | None = None, local_recorded: bool = True
) -> tuple[Record, list[str]]:
    """The root of an incident's first-step records and the evidence for it, in words;
    ``world_size`` (None where unknown) says whether peers' gradients may have reached them;
    ``local_recorded``: whether local gradients (before reduction) were recorded at that step.

    Raises:
        ValueError: no records.
    """
    if not records:
        raise ValueError("choose_root: no records")
    phase = min(phase_of(r) for r in records)
    group = [r for r in records if phase_of(r) == phase]
    evidence = [f"first abnormal phase of the step: {PHASE_NAMES[phase]}"]
    all_ranks = sorted({int(r["rank"]) for r in records})
    first_ranks = sorted({int(r["rank"]) for r in group})
    if len(all_ranks) > 1 and len(first_ranks) < len(all_ranks):
        others = [r for r in all_ranks if r not in first_ranks]
        evidence.append(
            f"only rank{'s' if len(first_ranks) > 1 else ''} {', '.join(map(str, first_ranks))} "
            f"show{'' if len(first_ranks) > 1 else 's'} it; rank{'s' if len(others) > 1 else ''} "
            f"{', '.join(map(str, others))} only later phases"
        )
    nonfinite = [r for r in group if r.get("rule") == NONFINITE]
    if nonfinite:
        group = nonfinite
        evidence.append("a non-finite value (NaN/Inf) is the earliest")
    alone = _moved_alone(group)
    if alone is not None:
        root, ratio, common = alone
        if _as_a_whole(common) and phase in (PHASES["acc_grad"], PHASES["post_grad"]):
            # local gradients are read before clipping: only a loss scale rescales them all
            why = "clipping or loss scaling" if phase == PHASES["post_grad"] else "loss scaling"
            evidence.append(
                f"it moved x{ratio:.3g} while its data type moved x{common:.3g} together "
                f"({why} rescales every tensor alike)"
            )
        elif _as_a_whole(common) and (ratio > 1) == (common > 1):
            evidence.append(f"it moved x{ratio:.3g}, far beyond its data type's common move (x{common:.3g})")
        elif _as_a_whole(common):
            evidence.append(f"it moved x{ratio:.3g}, against its data type's common move (x{common:.3g})")
        else:
            evidence.append(f"it moved x{ratio:.3g} while the rest of its data type stayed (x{common:.3g})")
    else:
        root = min(group, key=_order)
        if len(group) > 1:
            where = "nearest the input" if phase <= 1 else "nearest the loss" if phase <= 3 else "first"
            evidence.append(f"earliest of {len(group)} in the order they were computed ({where})")
        tensors = len({module_of(r) for r in group})
        if nonfinite and tensors >= 3 and phase == PHASES["acc_grad"]:
            evidence.append(
                f"{tensors} tensors turned NaN/Inf at once: the one nearest the loss is named, though "
                "it may have begun in the loss or the forward pass (recording activations, "
                "xy_distribution, narrows it down)"
            )
    common = _shared_move(root) if alone is None else math.nan
    after_backward = phase == PHASES["post_grad"] and not any(
        phase_of(r) == PHASES["acc_grad"] for r in records
    )
    if not math.isnan(common) and not after_backward:
        evidence.append(
            f"its data type moved x{common:.3g} as a whole: the cause is shared by all its tensors "
            "(the loss or its scale, the batch, the learning rate)"
        )
    elif phase <= PHASES["actv"]:
        evidence.extend(_followed_as_a_whole(records, root))
    peer = _peer_outlier(group, root)
    if peer is not None and peer[0] is not root:
        root = peer[0]
    if peer is not None:
        evidence.append(f"rank {root['rank']}'s value is x{peer[1]:.3g} off its peers' median")
    if after_backward and not local_recorded:
        evidence.append(
            "local gradients (before reduction) were not recorded at this step (FSDP reducing at "
            "every micro-batch leaves none): it may have begun on any rank, before the reduction"
        )
    elif after_backward:
        evidence.append(_changed_after_backward(records, common, world_size))
    evidence.extend(_same_on_ranks(records, root))
    return root, evidence


def _same_on_ranks(records: Sequence[Record], root: Record) -> list[str]:
    """When other ranks show the root's tensor with the very same value (replicas, or pieces
    merged with shard_reduce), or non-finite too, the rank named is only the lowest: said, in
    words."""
    value = number(root.get("value"))
    place = (root.get("step"), root.get("micro_step", 0))
    finite = math.isfinite(value)
    ranks = sorted(
        {
            int(r["rank"])
            for r in records
            if _tensor_of(r) == _tensor_of(root)
            and (r.get("step"), r.get("micro_step", 0)) == place
            and (number(r.get("value")) == value if finite else not math.isfinite(number(r.get("value"))))
        }
    )
    if len(ranks) < 2:
        return []
    if not finite:  # NaN/Inf spreads through the collectives between ranks (tensor parallelism)
        return [
            f"ranks {', '.join(map(str, ranks))} show it non-finite at the same place: NaN/Inf "
            "spreads through the collectives between them, so the rank named is not known to be "
            "where it began"
        ]
    return [
        f"ranks {', '.join(map(str, ranks))} show the same value (replicas, or pieces merged with "
        "shard_reduce): it does not tell which rank's data it came from (the rows of each rank's "
        "piece, without shard_reduce, do)"
    ]


#: the gradient phases a root in the parameters or the forward pass may move as a whole
_GRADIENT_PHASES = (PHASES["actv_grad"], PHASES["acc_grad"], PHASES["post_grad"])


def _followed_as_a_whole(records: Sequence[Record], root: Record) -> list[str]:
    """The first gradient phase after a root in the parameters or the forward pass whose data
    type moved as a whole the way the root moved (the loss the model computes, a spike of its
    own output), in words."""
    ratio = number(root.get("ratio"))
    for later in _GRADIENT_PHASES:
        moves = [number(r.get("common")) for r in records if phase_of(r) == later]
        moves = [m for m in moves if m > 0 and math.isfinite(m)]
        common = statistics.median(moves) if moves else math.nan
        if _moved_with(ratio, common):
            return [
                f"the {PHASE_NAMES[later]} that followed moved x{common:.3g} as a whole: its "
                "cause reached every gradient (a loss computed inside the model, the batch, or "
                "weights the last update moved, as a raised learning rate does)"
            ]
    return []


def _shared_move(root: Record) -> float:
    """The common move of the root's data type when it is SHARED_FACTOR or more and the root
    moved the same way, else NaN."""
    common = number(root.get("common"))
    return common if _moved_with(number(root.get("ratio")), common) else math.nan


def _as_a_whole(common: float) -> bool:
    """Whether a data type's common move is SHARED_FACTOR or more, either way."""
    return common > 0 and abs(math.log(common)) >= math.log(SHARED_FACTOR)


def _moved_with(ratio: float, common: float) -> bool:
    """Whether a data type moved as a whole the way a tensor's ``ratio`` did (any way where the
    ratio is unknown)."""
    return _as_a_whole(common) and not (ratio > 0 and (ratio > 1) != (common > 1))


def _changed_after_backward(records: Sequence[Record], common: float, world_size: int | None) -> str:
    """Why reduced gradients are abnormal while no local gradient was."""
    # one rank's own records cannot tell its reduction's fault from a peer's gradient it received
    alone = world_size != 1 and len({r.get("rank") for r in records}) == 1
    if not math.isnan(common):
        averaging = "" if world_size == 1 else ", the reduction's averaging"
        peers = " or another rank's gradients reached them in the reduction" if alone else ""
        return (
            f"its reduced gradient is abnormal while no local gradient was, and the reduced gradients "
            f"moved x{common:.3g} together: they were rescaled after backward (gradient clipping, a "
            f"loss scaler{averaging}){peers}, their local gradients' change left unflagged"
        )
    if world_size == 1:  # nothing was reduced: only an edit between backward and the step is left
        return (
            "its reduced gradient is abnormal while no local gradient was: it changed after backward "
            "(edited in place, by a hook or a gradient transform, before the optimizer step)"
        )
    peers = "another rank's gradient reached it, " if alone else ""
    return (
        "its reduced gradient is abnormal while no local gradient was: it changed after backward "
        f"({peers}in the reduction, or edited in place before the optimizer step)"
    )


def describe_root(root: dict[str, Any]) -> str:
    """``root <tag> <op> <value> (<rule>, baseline <b>)`` for console lines and tables; the root
    module's rows, which the files name ``.input`` / ``.output`` as msprobe does, say so, and so
    does a root in a later pipeline stage, whose layers Megatron numbers from 0 again."""
    value, baseline = number(root.get("value")), number(root.get("baseline"))
    base = f", baseline {baseline:.3g}" if baseline == baseline else ""
    tag = str(root["tag_name"])
    name = split_tag(tag)[1]
    model = ""
    if name.startswith((".input", ".output")):
        what = "input" if name.startswith(".input") else "output"
        if "_grad" in name:
            what += "'s gradient"
        model = f" [the model's own {what}]"
    stage = root.get("pp_stage")
    if isinstance(stage, int) and stage > 0:
        model += f" [pipeline stage {stage}, whose layers count from 0]"
    return f"root {tag}{model} {root.get('op', '')} = {value:.3g} ({root.get('rule')}{base})"
