"""Names and tags (monitor/naming.py): squash_name, target matching, tag grammar."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.naming import (
    build_tag,
    distinct_names,
    is_selected,
    key_selects,
    name_candidates,
    select_names,
    split_tag,
    squash_name,
    unmatched_targets,
    without_wrapper,
)

# --------------------------------------------------------------------------------------------- squash_name

#: msprobe's later squash rule: keyword kept, must follow a dot, last occurrence wins, first pattern decides.
LATER_RULE_EXAMPLES = [
    ("module.decoder.layers.3.mlp.weight", "layers.3.mlp.weight"),
    (
        "module.language_model.encoder.layers.3.mlp.dense_h_to_4h.weight",
        "layers.3.mlp.dense_h_to_4h.weight",
    ),
    ("module.language_model.embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("module.language_model.output_layer.weight", "output_layer.weight"),
    ("decoder.final_layernorm.weight", "final_layernorm.weight"),
    ("model.norm.weight", "norm.weight"),
    ("bert.encoder.layer.5.attention.output.dense.weight", "layer.5.attention.output.dense.weight"),
    ("model.embeddings.position.weight", "embeddings.position.weight"),
]


@pytest.mark.parametrize(("raw", "squashed"), LATER_RULE_EXAMPLES, ids=[r for r, _ in LATER_RULE_EXAMPLES])
def test_squash_name_follows_the_later_reference_rule(raw, squashed):
    assert squash_name(raw) == squashed


def test_squash_name_keeps_the_last_occurrence_of_the_keyword():
    assert squash_name("model.layers.1.block.layers.0.fc.weight") == "layers.0.fc.weight"


def test_squash_name_first_matching_pattern_decides():
    # "layers." is tried before "final": the layer prefix is kept, not cut at ".final_norm".
    assert squash_name("model.layers.0.final_norm.weight") == "layers.0.final_norm.weight"


@pytest.mark.parametrize("raw", ["fc1.weight", "lm_head.weight", "model.word_embeddings.weight", "layers"])
def test_squash_name_leaves_names_without_a_dotted_keyword_unchanged(raw):
    assert squash_name(raw) == raw


@pytest.mark.parametrize(
    "raw",
    ["layers.0.fc1.weight", "layers.0.norm2.weight", "layers.2.output_proj.bias", "layers.1.final.weight"],
)
def test_name_starting_with_layers_stays_whole(raw):
    # Deliberate deviation (monitor/naming.py): msprobe collapses "layers.0.norm2.weight" to
    # "norm2.weight" (its later patterns need a dot before the keyword), which collides across layers.
    assert squash_name(raw) == raw


def test_names_starting_with_layers_do_not_collide_across_layers():
    names = [f"layers.{i}.norm2.weight" for i in range(12)]
    assert len({squash_name(n) for n in names}) == len(names)


# --------------------------------------------------------------------------------------------- targets


def _selects(keys, raw, vpp_stage=0, squash=True):
    squashed = squash_name(raw) if squash else raw
    return is_selected(keys, name_candidates(vpp_stage, raw, squashed))


def test_key_selects_names_below_it_on_a_dot_boundary():
    assert key_selects("layers.1", "layers.1.fc.weight")
    assert key_selects("layers.1", "layers.1")


def test_key_does_not_select_a_sibling_with_a_longer_number():
    assert not key_selects("layers.1", "layers.10.fc.weight")
    assert not key_selects("layers.1", "layers.11")
    assert not _selects(["layers.1"], "layers.10.fc.weight")


def test_key_does_not_select_a_longer_word():
    assert not key_selects("layers.1.fc", "layers.1.fc2.weight")


def test_empty_key_selects_everything():
    assert key_selects("", "anything.at.all")
    assert _selects([""], "module.decoder.layers.7.mlp.weight", vpp_stage=3)


def test_no_keys_select_everything():
    assert _selects([], "lm_head.weight")


def test_chunk_prefixed_key_selects_only_its_chunk():
    assert _selects(["0:layers.1"], "layers.1.fc.weight", vpp_stage=0)
    assert not _selects(["0:layers.1"], "layers.1.fc.weight", vpp_stage=1)
    assert _selects(["1:layers.1"], "layers.1.fc.weight", vpp_stage=1)
    assert not _selects(["0:layers.1"], "layers.10.fc.weight", vpp_stage=0)


def test_leading_ddp_module_segments_are_stripped():
    # no squash keyword here, so only the "module."-stripped spelling can match
    assert _selects(["encoder.block.1"], "module.encoder.block.1.weight", squash=False)
    assert _selects(["encoder.block.1"], "module.module.encoder.block.1.weight", squash=False)
    assert not _selects(["encoder.block.1"], "module.encoder.block.12.weight", squash=False)


def test_key_in_raw_spelling_still_selects():
    assert _selects(["module.encoder.block"], "module.encoder.block.1.weight")


def test_a_key_written_for_ddp_selects_the_same_name_without_the_wrapper():
    """A config written for a DDP run (``module.fc2``) reused on the bare model (``fc2``); where
    the model has names under ``module`` (DDP, or a submodule really called so) keys stay as written."""
    bare = [(0, "encoder.block.1.weight"), (0, "encoder.block.12.weight"), (0, "fc2")]
    assert [name for _, name in select_names(bare, ["module.encoder.block.1"], squash=False)] == [
        "encoder.block.1.weight"
    ]
    assert unmatched_targets(["module.encoder.block.1", "module.fc2"], bare) == []
    assert without_wrapper(["module.fc2", "fc3"], ["fc2", "fc3"]) == ("fc2", "fc3")
    own = [(0, "module.fc2.weight"), (0, "fc2.weight")]  # a submodule called module beside fc2
    assert [name for _, name in select_names(own, ["module.fc2"], squash=False)] == ["module.fc2.weight"]
    assert without_wrapper(["module.fc2"], [raw for _, raw in own]) == ("module.fc2",)


def test_a_key_written_for_the_model_selects_it_inside_peft_and_the_other_way_round():
    """PEFT's PeftModel names every module ``base_model.model.<the model's name>``: a key written
    with the model's own name selects it there, and one copied from the wrapped names selects
    the bare model's (the LoRA adapters below the module included)."""
    wrapped = [
        (0, "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"),
        (0, "base_model.model.transformer.h.0.attn.c_proj.lora_A.default.weight"),
    ]
    keys = ["transformer.h.0.attn.c_attn.lora_A"]
    assert [name for _, name in select_names(wrapped, keys, squash=False)] == [wrapped[0][1]]
    assert unmatched_targets(keys, wrapped) == []
    bare = [(0, raw.removeprefix("base_model.model.")) for _, raw in wrapped]
    keys = ["base_model.model.transformer.h.0.attn.c_proj"]
    assert [name for _, name in select_names(bare, keys, squash=False)] == [bare[1][1]]


def test_squashed_key_selects_the_long_raw_name():
    assert _selects(["layers.3"], "module.decoder.layers.3.mlp.weight")
    assert not _selects(["layers.3"], "module.decoder.layers.30.mlp.weight")


def test_candidates_include_raw_squashed_bare_and_chunk_prefixed_spellings():
    raw = "module.decoder.layers.3.mlp.weight"
    candidates = set(name_candidates(2, raw, squash_name(raw)))
    assert candidates == {
        raw,
        "layers.3.mlp.weight",
        "decoder.layers.3.mlp.weight",
        f"2:{raw}",
        "2:layers.3.mlp.weight",
        "2:decoder.layers.3.mlp.weight",
    }


# --------------------------------------------------------------------------------------------- tags


def test_activation_tag_has_micro_step_and_rank():
    assert build_tag(0, "layers.0.fc1.input", 0, "actv", 1) == "0:layers.0.fc1.input:1/rank0/actv"


def test_parameter_tag_has_no_micro_step():
    assert build_tag(1, "layers.0.fc1.weight", 3, "post_grad") == "1:layers.0.fc1.weight/rank3/post_grad"


def test_tag_without_rank_omits_the_rank_segment():
    assert build_tag(0, "all_reduce", None, "pre_0") == "0:all_reduce/pre_0"


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        ((0, "layers.0.fc1.input", 0, "actv", 1), (0, "layers.0.fc1.input", 1, "actv")),
        ((2, "layers.0.fc1.output", 7, "actv_grad", 0), (2, "layers.0.fc1.output", 0, "actv_grad")),
        ((0, "layers.0.weight", 5, "exp_avg_sq", None), (0, "layers.0.weight", None, "exp_avg_sq")),
        ((0, "broadcast", None, "post_1", None), (0, "broadcast", None, "post_1")),
        ((3, "embedding.weight", None, "adam_ratio", 2), (3, "embedding.weight", 2, "adam_ratio")),
        ((0, "", 0, "actv", None), (0, "", None, "actv")),
    ],
    ids=["micro_step", "actv_grad", "no_micro_step", "no_rank", "no_rank_with_micro_step", "root_module"],
)
def test_split_tag_inverts_build_tag(args, parts):
    assert split_tag(build_tag(*args)) == parts


def test_split_tag_of_a_tag_without_chunk_prefix():
    assert split_tag("all_reduce/rank0/pre_0") == (0, "all_reduce", None, "pre_0")


_NAMES = st.from_regex(r"[a-z_][a-z0-9_.]{0,30}", fullmatch=True)
_TASKS = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(
    vpp=st.integers(0, 31),
    name=_NAMES,
    rank=st.none() | st.integers(0, 65535),
    task=_TASKS,
    micro=st.none() | st.integers(0, 1023),
)
def test_build_split_round_trip(vpp, name, rank, task, micro):
    assert split_tag(build_tag(vpp, name, rank, task, micro)) == (vpp, name, micro, task)


def test_names_that_squashing_makes_collide_all_keep_their_full_names():
    named = [(0, "blocks.0.norm.weight"), (0, "blocks.0.fc.weight"), (0, "norm.weight"), (1, "norm.weight")]
    assert distinct_names(named, squash=True) == [
        "blocks.0.norm.weight",
        "blocks.0.fc.weight",  # no keyword: never squashed
        "norm.weight",
        "norm.weight",  # another chunk: no collision
    ]
    assert select_names(named, [], squash=True) == list(enumerate(distinct_names(named, squash=True)))


def test_wrapper_prefixes_are_dropped_when_squashing():
    assert squash_name("module.lm_head.weight") == "lm_head.weight"
    assert (
        squash_name("module._orig_mod.layers.0._checkpoint_wrapped_module.mlp.weight")
        == "layers.0.mlp.weight"
    )


@pytest.mark.parametrize(
    ("name", "is_mask"),
    [
        ("mask", True),
        ("attention_mask", True),
        ("src_key_padding_mask", True),
        ("attn_masks", True),
        ("masked_input", False),
        ("unmasked_x", False),
        ("masked_lm_embeddings", False),
        ("hidden_states", False),
    ],
)
def test_an_argument_is_a_mask_by_its_name_ending_not_by_holding_the_word(name, is_mask):
    from monitor.datatypes.modules import is_mask_name

    assert is_mask_name(name) is is_mask
