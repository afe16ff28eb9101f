"""Row labels of the per-parameter data types, built once per collection (framework-free).

Every adapter reports the same per-parameter data types under the same CSV prefixes and tag
tasks; this module is the one place that says which ones, and which rows a rank writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from monitor.record import RowSet

#: CSV prefix -> tag task of the data types with one row per monitored parameter. The unreduced
#: gradient is ``acc_grad``, or ``pre_grad`` where it is read from Megatron's ``main_grad``.
PARAM_TASKS = {
    "grad_reduced": "post_grad",
    "param_origin": "param_origin",
    "param_updated": "param_updated",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "other": "mg_direction",
    "grad_unreduced": "acc_grad",
}


def reduced_index(tensor_parallel: Sequence[bool], dp_rank: int | None, tp_rank: int | None) -> list[int]:
    """Parameters whose reduced gradient this rank writes.

    Reduced gradients are equal on every data-parallel rank, so only dp rank 0 writes them; of
    a tensor-parallel group, rank 0 writes the replicated parameters and every rank its own
    shards (``tensor_parallel[i]``). A rank without a group (None) counts as rank 0.
    """
    if dp_rank not in (None, 0):
        return []
    return [i for i, shard in enumerate(tensor_parallel) if tp_rank in (None, 0) or shard]


def param_row_tables(
    vpp_stages: Sequence[int],
    names: Sequence[str],
    rank: int | None,
    reduced: Sequence[int],
    unreduced_task: str = PARAM_TASKS["grad_unreduced"],
) -> dict[str, tuple[list[int], RowSet]]:
    """Per data type (CSV prefix): the parameter indices it covers and their row labels."""
    everything = list(range(len(names)))
    tasks = {**PARAM_TASKS, "grad_unreduced": unreduced_task}
    tables = {}
    for prefix, task in tasks.items():
        index = list(reduced) if prefix == "grad_reduced" else everything
        tables[prefix] = (
            index,
            RowSet.build([vpp_stages[i] for i in index], [names[i] for i in index], rank, task),
        )
    return tables


def unreduced_rows(
    base: RowSet, index: Sequence[int], micro_steps: Sequence[int] | None, rank: int | None
) -> RowSet:
    """Rows of one step's unreduced gradients: ``base`` rows in firing order, with micro-steps if any."""
    if micro_steps is None:
        return base.take(index)
    task = base.tags[0].rsplit("/", 1)[-1] if len(base) else PARAM_TASKS["grad_unreduced"]
    return RowSet.build(
        [base.vpp_stages[i] for i in index], [base.names[i] for i in index], rank, task, micro_steps
    )
