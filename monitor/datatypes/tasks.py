"""Data types (CSV file prefixes) and the tag tasks written for them; rows of a data type.

The CSV writer names files after the data type (``grad_reduced_0-9.csv``) while tags (TensorBoard
scalars, anomaly records) end in a task (``.../rank0/post_grad``). The dashboards show data types,
so a tag's task is mapped back to its data type here, in one place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from monitor.naming import build_tag, split_tag

#: data type -> the tasks its tags end in (msprobe's tag grammar; grad_unreduced is pre_grad with main_grad).
PREFIX_TASKS: dict[str, tuple[str, ...]] = {
    "actv": ("actv",),
    "actv_grad": ("actv_grad",),
    "grad_unreduced": ("acc_grad", "pre_grad"),
    "grad_reduced": ("post_grad",),
    "exp_avg": ("exp_avg",),
    "exp_avg_sq": ("exp_avg_sq",),
    "param_origin": ("param_origin",),
    "param_updated": ("param_updated",),
    "other": ("mg_direction",),
    "attention_hook": ("qkt",),
    "linear_hook": ("sr",),
}
TASK_PREFIX: dict[str, str] = {task: prefix for prefix, tasks in PREFIX_TASKS.items() for task in tasks}
#: data types whose rows are module inputs and outputs (named after the module).
ACTIVATION_PREFIXES: tuple[str, ...] = ("actv", "actv_grad")
#: where a loss scaler's overflow shows (as Inf/NaN it then skips): the gradients, and the
#: collectives that carry them (reduce-scatters, all-reduces)
SCALED_PREFIXES: tuple[str, ...] = ("actv_grad", "grad_unreduced", "grad_reduced", "comm")
#: order in which data types are offered (and preferred for the landing view on a tie).
PREFIX_ORDER: tuple[str, ...] = (
    "grad_reduced",
    "grad_unreduced",
    "actv",
    "actv_grad",
    "exp_avg",
    "exp_avg_sq",
    "param_updated",
    "param_origin",
    "other",
    "attention_hook",
    "linear_hook",
)
#: data types whose rows come in backward order -> data types whose rows are in model order.
ROW_ORDER_FROM: dict[str, tuple[str, ...]] = {
    "grad_unreduced": ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq", "other"),
    "actv_grad": ("actv",),
}
#: ops offered first (and preferred for the landing view).
OP_ORDER: tuple[str, ...] = ("norm", "max", "min", "mean", "zeros", "nans", "id")


def prefix_of_task(task: str) -> str:
    """The data type of a tag task; an unknown task is its own data type."""
    return TASK_PREFIX.get(task, task)


def tasks_of_prefix(prefix: str) -> tuple[str, ...]:
    """The tasks written for a data type; an unknown data type is its own task."""
    return PREFIX_TASKS.get(prefix, (prefix,))


def task_of_tags(tags: Sequence[str]) -> str | None:
    """The task of a record's tags (its rows share one), None for a record without rows."""
    return split_tag(str(tags[0]))[3] if len(tags) else None


def order_key(name: str, order: tuple[str, ...]) -> tuple[int, str]:
    """Sort key: known names in ``order`` first, then the others alphabetically."""
    return (order.index(name), "") if name in order else (len(order), name)


class RowKey(NamedTuple):
    """One row of a data type: virtual-pipeline chunk, name, micro-step (-1: none)."""

    vpp_stage: int
    name: str
    micro_step: int

    def label(self, show_vpp: bool, root_class: str = "") -> str:
        """``[N:]name[:m]``: the chunk prefix only when the run has several chunks.

        An activation row of the chunk's root module (``.input``, ``[1].output_grad``: the module
        name is empty) is shown with ``root_class`` in front (``GPT.input``) when it is given.
        """
        name = root_class + self.name if root_class and self.name.startswith((".", "[")) else self.name
        text = f"{self.vpp_stage}:{name}" if show_vpp else name
        return text if self.micro_step < 0 else f"{text}:{self.micro_step}"


class ParsedTag(NamedTuple):
    """A scalar or anomaly tag split into data type, row and op."""

    prefix: str
    row: RowKey
    rank: int | None


def parse_tag(tag: str) -> ParsedTag | None:
    """``N:name[:m]/rankR/task`` -> (data type, row, rank); None for a tag without a task."""
    _, sep, rest = tag.partition("/")
    if not sep or not rest:
        return None
    vpp, name, micro, task = split_tag(tag)
    rank = None
    middle = rest.rsplit("/", 1)[0] if "/" in rest else ""
    if middle.startswith("rank") and middle[4:].isdigit():
        rank = int(middle[4:])
    return ParsedTag(prefix_of_task(task), RowKey(vpp, name, -1 if micro is None else micro), rank)


def scalar_tag_pattern(prefix: str, op: str, row: RowKey) -> str:
    """A regular expression matching the TensorBoard scalars of one row's ``op`` on every rank
    (what TensorBoard's tag filter takes to show that row's charts, and nothing else)."""
    head = build_tag(row.vpp_stage, row.name, None, "", None if row.micro_step < 0 else row.micro_step)
    tasks = "|".join(re.escape(task) for task in PREFIX_TASKS[prefix])
    return f"^{re.escape(head.removesuffix('/'))}/rank[0-9]+/(?:{tasks})_{re.escape(op)}$"


def parse_scalar_tag(tag: str) -> tuple[ParsedTag, str] | None:
    """A trainmon scalar tag ``"{tag}_{op}"`` -> (parsed tag, op); None for any other tag.

    The op follows the longest known task (``exp_avg_sq`` before ``exp_avg``; l2 ops such as
    ``softmax_max`` hold underscores themselves), else the last underscore."""
    head, _, last = tag.rpartition("/")
    task = max((t for t in TASK_PREFIX if last.startswith(f"{t}_")), key=len, default=None)
    if task is not None:
        base, op = f"{head}/{task}" if head else task, last[len(task) + 1 :]
    else:
        base, sep, op = tag.rpartition("_")
        if not sep:
            return None
    if not op:
        return None
    parsed = parse_tag(base)
    return None if parsed is None else (parsed, op)


def params_of_records(records: Iterable[Mapping[str, Any]], params: Sequence[Any]) -> Iterator[Any]:
    """The monitored parameters (entries with ``vpp_stage`` and ``name``) the records' tags point
    at, in order, each once: a parameter's own rows, or every parameter of the module whose
    activation a row describes (what evidence bundles keep)."""
    by_name: dict[tuple[int, str], list[Any]] = {}  # a parameter's name and its modules' -> parameters
    for entry in params:
        name = entry.name
        by_name.setdefault((entry.vpp_stage, name), []).append(entry)
        while "." in name:
            name = name.rpartition(".")[0]
            by_name.setdefault((entry.vpp_stage, name), []).append(entry)
    seen: set[int] = set()
    for record in records:
        parsed = parse_tag(str(record.get("tag_name", "")))
        if parsed is None:
            continue
        name = parsed.row.name
        if parsed.prefix in ACTIVATION_PREFIXES:  # layers.1[1].output_0 -> the module layers.1
            name = re.sub(r"\[\d+\]$", "", name.rsplit(".", 1)[0] if "." in name else "")
        for entry in by_name.get((parsed.row.vpp_stage, name), ()):
            if id(entry) not in seen:
                seen.add(id(entry))
                yield entry


def module_calls_of_records(records: Iterable[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """``(vpp_stage, module call)`` of each record's tag, in order, each once: the module call
    (``layers.1``, ``layers.1[1]`` for its second call in a micro-batch) whose input or output an
    activation row describes, or the module that owns a parameter (what bundles keep the inputs of)."""
    calls: list[tuple[int, str]] = []
    for record in records:
        parsed = parse_tag(str(record.get("tag_name", "")))
        if parsed is None:
            continue
        name = parsed.row.name
        if parsed.prefix in ACTIVATION_PREFIXES:  # layers.1[1].output_0 -> layers.1[1]
            call = name.rsplit(".", 1)[0] if "." in name else ""
        else:
            call = name.rpartition(".")[0]
        if (parsed.row.vpp_stage, call) not in calls:
            calls.append((parsed.row.vpp_stage, call))
    return calls
