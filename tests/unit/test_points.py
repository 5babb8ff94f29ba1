# SPDX-License-Identifier: Apache-2.0
"""Capture-point addresses, their capture ids and the capturable set
(vllm_hidden_states.config): the rules both surfaces apply."""

import pytest

from vllm_hidden_states.engine_args import additional_config_entry
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig, capturable_point_ids
from vllm_hidden_states.layers import point_kinds_for
from vllm_hidden_states.points import (
    POINT_KINDS,
    id_name,
    is_head_address,
    is_neuron_address,
    is_pattern_address,
    is_pattern_id,
    is_qkv_address,
    is_wide_address,
    is_wide_id,
    is_z_address,
    layer_of_id,
    parse_point,
    point_id,
    point_of_id,
)
from vllm_hidden_states.request_fields import check_points

from .test_config import fake_vllm_config

L = 4  # a 4-layer model: HF layers 0..4, points at decoder layers 0..3


def engine(points, layers=None, architecture="LlamaForCausalLM") -> HiddenStatesConfig:
    entry = additional_config_entry(layers, points=points)
    cfg = HiddenStatesConfig.from_vllm_config(
        fake_vllm_config(entry, num_layers=L, architecture=architecture)
    )
    assert cfg is not None
    return cfg


# -- addresses --------------------------------------------------------------


@pytest.mark.parametrize(
    "address, expected",
    [
        ("attn_out.3", ("attn_out", 3)),
        ("blocks.3.hook_attn_out", ("attn_out", 3)),
        ("mlp_out.-1", ("mlp_out", L - 1)),
        ("blocks.-4.hook_resid_mid", ("resid_mid", 0)),
        ("resid_pre.0", ("resid_pre", 0)),
    ],
)
def test_both_address_forms_name_a_kind_and_an_absolute_decoder_layer(address, expected):
    assert parse_point(address, L) == expected


@pytest.mark.parametrize("address", ["attn_out", "attn_out.x", "blocks.1.attn_out", 3, None])
def test_a_malformed_address_names_both_forms_and_every_kind(address):
    with pytest.raises(ValueError) as e:
        parse_point(address, L)
    assert "'<kind>.<i>' or 'blocks.<i>.hook_<kind>'" in str(e.value)
    assert all(kind in str(e.value) for kind in POINT_KINDS)


def test_an_unknown_kind_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown kind 'hook_z'.*attn_out"):
        parse_point("blocks.1.hook_hook_z", L)


@pytest.mark.parametrize("address", [f"attn_out.{L}", f"attn_out.{-L - 1}"])
def test_a_layer_out_of_range_names_the_valid_range(address):
    with pytest.raises(ValueError, match=rf"out of range.*{-L}\.\.{L - 1}"):
        parse_point(address, L)


@pytest.mark.parametrize("value", [[], "attn_out.1", [1], [None]])
def test_hidden_states_points_must_be_a_non_empty_list_of_strings(value):
    with pytest.raises(ValueError, match="non-empty list of point addresses"):
        check_points(value)


# -- capture ids ------------------------------------------------------------


def test_resid_pre_is_the_hf_layer_and_resid_post_the_next_one():
    assert [point_id("resid_pre", i, L) for i in range(L)] == list(range(L))
    assert [point_id("resid_post", i, L) for i in range(L - 1)] == list(range(1, L))


def test_the_last_resid_post_is_its_own_id_not_the_post_norm_layer():
    assert point_id("resid_post", L - 1, L) > L
    assert point_of_id(point_id("resid_post", L - 1, L), L) == ("resid_post", L - 1)


def test_every_point_past_the_residual_stream_has_a_distinct_id_that_round_trips():
    ids = {}
    for kind in ("attn_out", "resid_mid", "mlp_out"):
        for i in range(L):
            capture_id = point_id(kind, i, L)
            assert capture_id > L
            assert point_of_id(capture_id, L) == (kind, i)
            assert layer_of_id(capture_id, L) == i
            assert id_name(capture_id, L) == f"{kind}.{i}"
            ids[capture_id] = (kind, i)
    assert len(ids) == 3 * L


def test_hf_layers_are_their_own_names_and_layers():
    assert point_of_id(L, L) is None
    assert id_name(2, L) == "2"
    assert layer_of_id(2, L) == 2


# -- the capturable set -----------------------------------------------------


def test_no_points_flag_keeps_todays_capturable_set():
    cfg = engine(None)
    assert cfg.layers == tuple(range(L + 1))


def test_all_makes_every_kind_capturable_at_every_layer():
    cfg = engine("all")
    # HF layers, 3 row kinds, the last resid_post, a pattern, mlp_post,
    # attn_z, q, k and v per layer
    assert len(cfg.layers) == (L + 1) + 3 * L + 1 + L + L + L + 3 * L


def test_mlp_post_ids_are_their_own_and_moe_models_lack_them():
    capture_id = point_id("mlp_post", 3, L)
    assert point_of_id(capture_id, L) == ("mlp_post", 3)
    assert capture_id != point_id("attn_pattern", 3, L)
    assert "mlp_post" not in point_kinds_for("MixtralForCausalLM")
    with pytest.raises(ValueError, match="mixture of experts"):
        capturable_point_ids(["mlp_post"], L, "Qwen3MoeForCausalLM")


@pytest.mark.parametrize(
    "address", ["attn_pattern.2", "blocks.2.hook_attn_pattern", "blocks.2.attn.hook_pattern"]
)
def test_attention_pattern_addresses_name_one_pattern_id(address):
    kind, layer = parse_point(address, L)
    assert (kind, layer) == ("attn_pattern", 2)
    capture_id = point_id(kind, layer, L)
    assert is_pattern_id(capture_id, L) and is_pattern_address(address)
    assert point_of_id(capture_id, L) == ("attn_pattern", 2)
    assert not is_pattern_address("attn_out.2")


@pytest.mark.parametrize("address", ["attn_z.2", "blocks.2.hook_attn_z", "blocks.2.attn.hook_z"])
def test_heads_output_addresses_name_one_attn_z_id(address):
    """TransformerLens' blocks.L.attn.hook_z is attn_z.L, a point of its own
    width (heads * head_dim) that travels with the MLP neurons."""
    kind, layer = parse_point(address, L)
    assert (kind, layer) == ("attn_z", 2)
    capture_id = point_id(kind, layer, L)
    assert point_of_id(capture_id, L) == ("attn_z", 2)
    assert id_name(capture_id, L) == "attn_z.2" and layer_of_id(capture_id, L) == 2
    assert is_wide_id(capture_id, L) and not is_pattern_id(capture_id, L)
    assert is_z_address(address) and is_wide_address(address)
    assert not is_pattern_address(address) and not is_neuron_address(address)


def test_every_kind_at_every_layer_has_a_distinct_id_that_round_trips():
    ids = {point_id(kind, i, L) for kind in POINT_KINDS for i in range(L)}
    # resid_pre.i+1 and resid_post.i share HF layer i+1
    assert len(ids) == len(POINT_KINDS) * L - (L - 1)
    for kind in POINT_KINDS:
        for i in range(L):
            if kind != "resid_pre" and not (kind == "resid_post" and i < L - 1):
                assert point_of_id(point_id(kind, i, L), L) == (kind, i)
    assert is_wide_id(point_id("mlp_post", 1, L), L)
    assert not is_wide_id(point_id("attn_out", 1, L), L)
    assert not is_z_address("blocks.1.attn.hook_pattern")
    assert not is_pattern_address("blocks.1.attn.hook_z")


def test_attn_z_is_refused_where_the_layer_has_no_attention():
    """The heads' outputs need vLLM's attention module: refused on OLMo 2
    (Transformers backend) and at Nemotron-H's Mamba2 layers, naming the
    layer class and its points; served at its attention layers."""
    assert "attn_z" in point_kinds_for("LlamaForCausalLM")
    assert "attn_z" in point_kinds_for("GPT2LMHeadModel")
    assert "attn_z" not in point_kinds_for("Olmo2ForCausalLM")
    with pytest.raises(ValueError, match=r"attn_z.*Transformers backend"):
        capturable_point_ids(["attn_z"], L, "Olmo2ForCausalLM")
    with pytest.raises(ValueError, match=r"attn_z.*SolarForCausalLM.*not verified"):
        capturable_point_ids(["attn_z.1"], L, "SolarForCausalLM")


def test_olmo2_on_the_transformers_backend_has_no_attention_patterns():
    assert "attn_pattern" not in point_kinds_for("Olmo2ForCausalLM")
    with pytest.raises(ValueError, match="Transformers backend"):
        capturable_point_ids(["attn_pattern"], L, "Olmo2ForCausalLM")


def test_a_kind_alone_means_every_layer_of_it():
    cfg = engine("attn_out", layers="-1")
    assert set(cfg.layers) == {L} | {point_id("attn_out", i, L) for i in range(L)}


def test_resid_post_below_the_last_layer_makes_the_next_hf_layer_capturable():
    cfg = engine("resid_post.1", layers="-1")
    assert set(cfg.layers) == {L, 2}


def test_an_unknown_layer_class_has_no_point_past_the_embedding_output():
    assert point_kinds_for("SolarForCausalLM") == ()
    # "all": every point exact on it, which is resid_pre.0 (HF layer 0) alone.
    assert engine("all", architecture="SolarForCausalLM").layers == (0, L)


def test_a_kind_on_an_unknown_layer_class_is_refused_at_start_naming_the_class():
    with pytest.raises(ValueError, match=r"attn_out.*SolarForCausalLM.*not verified"):
        capturable_point_ids(["attn_out"], L, "SolarForCausalLM")


def test_a_bad_points_flag_entry_is_refused_at_start_naming_the_forms():
    with pytest.raises(ValueError, match=r"--hidden-states-points entry .*'all'"):
        capturable_point_ids(["attn"], L, "LlamaForCausalLM")


def test_inner_ids_are_ordered_by_the_decoder_layer_that_computes_them():
    cfg = engine("all")
    layers = [layer_of_id(k, L) for k in cfg.inner_layers]
    assert layers == sorted(layers)
    assert L not in cfg.inner_layers


def test_the_capture_buffers_count_the_points():
    cfg = engine("attn_out", layers="-1")
    assert cfg.buffer_bytes(hidden_size=8, dtype_bytes=2) == L * cfg.max_rows * 8 * 2


# -- a request's points -----------------------------------------------------


def test_a_request_gets_the_capture_ids_of_its_points_in_order():
    cfg = engine("all")
    assert cfg.resolve_points(["mlp_out.1", "blocks.0.hook_attn_out"]) == [
        point_id("mlp_out", 1, L),
        point_id("attn_out", 0, L),
    ]


def test_two_names_of_one_capture_id_may_both_be_asked():
    cfg = engine("all")
    assert cfg.resolve_points(["resid_post.0", "resid_pre.1"]) == [1, 1]


def test_the_same_point_twice_is_refused_naming_both_spellings():
    cfg = engine("all")
    with pytest.raises(ValueError, match=r"attn_out.2 twice \('attn_out.2' and 'blocks.2"):
        cfg.resolve_points(["attn_out.2", "blocks.2.hook_attn_out"])


def test_a_point_not_capturable_names_the_capturable_set_and_the_flag():
    cfg = engine("attn_out.1")
    with pytest.raises(ValueError) as e:
        cfg.resolve_points(["mlp_out.1"])
    assert "not capturable" in str(e.value)
    assert "attn_out.1" in str(e.value) and "--hidden-states-points" in str(e.value)


def test_an_engine_without_points_says_how_to_start_one():
    with pytest.raises(ValueError, match="--hidden-states-points all"):
        engine(None).resolve_points(["attn_out.0"])


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("q.2", "q"),
        ("blocks.2.attn.hook_rot_q", "q"),
        ("k.2", "k"),
        ("blocks.2.attn.hook_rot_k", "k"),
        ("v.2", "v"),
        ("blocks.2.attn.hook_v", "v"),
        ("blocks.2.hook_v", "v"),
    ],
)
def test_query_key_value_addresses_name_one_wide_id_each(address, kind):
    """q / k / v (TransformerLens' post-rotary hook_rot_q / hook_rot_k, and
    hook_v) are points of their own width, returned per head."""
    assert parse_point(address, L) == (kind, 2)
    capture_id = point_id(kind, 2, L)
    assert point_of_id(capture_id, L) == (kind, 2) and id_name(capture_id, L) == f"{kind}.2"
    assert is_wide_id(capture_id, L) and not is_pattern_id(capture_id, L)
    assert is_qkv_address(address) and is_head_address(address) and is_wide_address(address)
    assert not is_z_address(address) and not is_neuron_address(address)


@pytest.mark.parametrize("part", ["q", "k"])
def test_pre_rotary_hook_q_and_hook_k_are_refused_naming_the_post_rotary_point(part):
    """TransformerLens' hook_q / hook_k are before rotary, which vLLM applies
    before its attention module reads them: refused, naming q.L / k.L."""
    with pytest.raises(ValueError, match=rf"before rotary.*'{part}\.1'.*hook_rot_{part}"):
        parse_point(f"blocks.1.attn.hook_{part}", L)


def test_query_key_value_are_served_where_attn_z_is_and_refused_with_it():
    """q, k, v are read at vLLM's attention module: served on Llama and
    Qwen3 (QK-norm) and on GPT-J (whose HF class attends inline: compared
    with what HF's attention module attends with; Falcon, Bloom: by their
    configs, test_layer_classes), refused on OLMo 2 (Transformers backend)
    and on an unknown class."""
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "GPTJForCausalLM"):
        assert {"q", "k", "v"} <= set(point_kinds_for(arch)), arch
    assert capturable_point_ids(["blocks.1.attn.hook_rot_k"], L, "GPTJForCausalLM")
    with pytest.raises(ValueError, match=r"q.*Transformers backend"):
        capturable_point_ids(["q"], L, "Olmo2ForCausalLM")
    with pytest.raises(ValueError, match=r"v.1.*SolarForCausalLM.*not verified"):
        capturable_point_ids(["v.1"], L, "SolarForCausalLM")
