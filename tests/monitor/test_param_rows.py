"""Framework-free row tables of the per-parameter data types and the selection of names."""

from __future__ import annotations

from monitor.datatypes.params import PARAM_TASKS, param_row_tables, reduced_index, unreduced_rows
from monitor.naming import select_names
from monitor.record import RowSet


def test_select_names_follows_targets_and_keeps_input_positions():
    named = [(0, "module.layers.1.fc.weight"), (0, "module.layers.10.fc.weight"), (1, "layers.1.fc.bias")]
    assert select_names(named, ["layers.1"], squash=True) == [
        (0, "layers.1.fc.weight"),
        (2, "layers.1.fc.bias"),
    ]
    assert select_names(named, [], squash=False) == [(0, named[0][1]), (1, named[1][1]), (2, named[2][1])]


def test_select_names_keeps_every_raw_name_that_squashing_makes_collide():
    named = [(0, "a.layers.0.w"), (0, "b.layers.0.w"), (1, "b.layers.0.w")]
    assert select_names(named, [], squash=True) == [
        (0, "a.layers.0.w"),
        (1, "b.layers.0.w"),
        (2, "layers.0.w"),
    ]


def test_select_names_monitors_a_shared_object_once_under_its_first_selected_name():
    named = [(0, "embed.weight"), (1, "head.weight"), (1, "head.bias")]
    assert select_names(named, ["head"], squash=True, identities=["w", "w", "b"]) == [
        (1, "head.weight"),
        (2, "head.bias"),
    ]
    assert select_names(named, [], squash=True, identities=["w", "w", "b"]) == [
        (0, "embed.weight"),
        (2, "head.bias"),
    ]


def test_reduced_rows_belong_to_data_parallel_rank_zero_and_tensor_parallel_shards():
    shards = [False, True, False]
    assert reduced_index(shards, None, None) == [0, 1, 2]
    assert reduced_index(shards, 0, 0) == [0, 1, 2]
    assert reduced_index(shards, 1, None) == []
    assert reduced_index(shards, 0, 1) == [1]


def test_param_row_tables_cover_every_data_type_with_the_torch_tags():
    tables = param_row_tables([0, 1], ["fc.weight", "fc.bias"], 3, reduced=[1])
    assert set(tables) == set(PARAM_TASKS)
    index, rows = tables["grad_reduced"]
    assert index == [1] and rows.tags == ("1:fc.bias/rank3/post_grad",)
    index, rows = tables["other"]
    assert index == [0, 1] and rows.tags == ("0:fc.weight/rank3/mg_direction", "1:fc.bias/rank3/mg_direction")
    assert param_row_tables([0], ["w"], 0, [0], "pre_grad")["grad_unreduced"][1].tags == (
        "0:w/rank0/pre_grad",
    )


def test_unreduced_rows_in_firing_order_with_and_without_micro_steps():
    base = RowSet.build([0, 0], ["a", "b"], 0, "acc_grad")
    assert unreduced_rows(base, [1, 0], None, 0).tags == ("0:b/rank0/acc_grad", "0:a/rank0/acc_grad")
    rows = unreduced_rows(base, [1, 1], [0, 1], 0)
    assert rows.tags == ("0:b:0/rank0/acc_grad", "0:b:1/rank0/acc_grad") and rows.micro_steps == (0, 1)


def test_the_same_rows_as_the_previous_step_are_the_same_rowset_object():
    from monitor.record import SameRows

    base = RowSet.build([0, 0, 0], ["a", "b", "c"], 0, "acc_grad")
    same = SameRows()
    built = []

    def rows(index):
        built.append(index)
        return base.take(index)

    first = same.get([2, 0], lambda: rows([2, 0]))
    assert same.get([2, 0], lambda: rows([2, 0])) is first  # a writer's per-RowSet cache hits
    changed = same.get([0, 2], lambda: rows([0, 2]))
    assert changed is not first and changed.names == ("a", "c")
    assert built == [[2, 0], [0, 2]]
