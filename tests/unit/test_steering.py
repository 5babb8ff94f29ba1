# SPDX-License-Identifier: Apache-2.0
"""Steering: the request contract (vllm_hidden_states.steering_fields) and the
worker's host-side arithmetic and op (vllm_hidden_states.worker.steering_op),
on CPU tensors, without an engine."""

import msgspec
import numpy as np
import pytest
import torch

from vllm_hidden_states.contract import Intervention
from vllm_hidden_states.engine_args import additional_config_entry
from vllm_hidden_states.points import point_id
from vllm_hidden_states.steering_config import (
    STEERABLE_KINDS,
    SteeringConfig,
    read_vector_names,
    steerable_ids,
    steering_entry,
)
from vllm_hidden_states.steering_fields import (
    check_steering,
    read_after_steering,
    salted,
    steering_digest,
)
from vllm_hidden_states.worker import steering_op as worker_steering
from vllm_hidden_states.worker.slot_pool import SlotPool
from vllm_hidden_states.worker.steering_op import _steer, compose, steer
from vllm_hidden_states.worker.steering_requests import NamedVectors, RequestSteering

from .test_config import fake_vllm_config

L = 4  # decoder layers 0..3
H = 8  # hidden_size
PROMPT = 5  # prompt tokens of the checked request
REACH = 10  # prompt + max_tokens
ARCH = "LlamaForCausalLM"


def config(points=("all",), vectors=None, max_interventions=4) -> SteeringConfig:
    return SteeringConfig(
        num_layers=L,
        ids=steerable_ids(list(points), L, ARCH),
        points_given=tuple(points),
        max_interventions=max_interventions,
        vectors={"honesty": H, "short": 3} if vectors is None else vectors,
        architecture=ARCH,
    )


def check(value, cfg=None):
    return check_steering(value, cfg or config(), H, PROMPT, REACH)


def add(point="resid_pre.1", **extra):
    return {"point": point, "vector": [1.0] * H, **extra}


def ablate(point="resid_pre.1", **extra):
    return {"point": point, "op": "ablate", "vector": [1.0] * H, **extra}


# -- check_steering: the wire form -------------------------------------------


def test_a_valid_add_resolves_to_its_wire_form_with_defaults():
    vector = [0.1 * k for k in range(H)]
    [wire] = check([{"point": "resid_pre.1", "vector": vector}])
    assert wire == Intervention(
        point="resid_pre.1",
        id=point_id("resid_pre", 1, L),
        op="add",
        vector=np.asarray(vector, dtype=np.float32).tolist(),
        strength=1.0,
        start=0,
        end=None,
    )
    assert (wire.name, wire.sae_feature, wire.value, wire.rows, wire.gate) == (None,) * 5


def test_wire_vector_is_float32_values_as_python_floats():
    [wire] = check([{"point": "resid_pre.1", "vector": [0.1] * H}])
    assert all(type(v) is float for v in wire.vector)
    assert wire.vector == [float(np.float32(0.1))] * H
    assert wire.vector[0] != 0.1  # rounded to float32, not kept as given


def test_an_integer_strength_travels_as_a_float():
    [wire] = check([add(strength=4)])
    assert wire.strength == 4.0 and type(wire.strength) is float


@pytest.mark.parametrize(
    "positions, span",
    [
        ("all", (0, None)),
        (None, (0, None)),
        ("prompt", (0, PROMPT)),
        ("generated", (PROMPT, None)),
        ({"start": 2, "end": 7}, (2, 7)),
        ({"start": 3}, (3, None)),
    ],
)
def test_positions_resolve_to_start_and_end_over_prompt_and_output(positions, span):
    [wire] = check([add(positions=positions)])
    assert (wire.start, wire.end) == span


@pytest.mark.parametrize(
    "address, canonical, capture_id",
    [
        ("resid_pre.-1", "resid_pre.3", 3),
        ("blocks.2.hook_resid_pre", "resid_pre.2", 2),
        ("blocks.-4.hook_attn_out", "attn_out.0", point_id("attn_out", 0, L)),
        ("resid_post.-1", "resid_post.3", point_id("resid_post", 3, L)),
    ],
)
def test_negative_layers_and_the_blocks_form_resolve_to_the_canonical_point(
    address, canonical, capture_id
):
    [wire] = check([add(point=address)])
    assert (wire.point, wire.id) == (canonical, capture_id)


def test_a_named_vector_keeps_its_name_and_no_inline_vector():
    [wire] = check([{"point": "resid_pre.1", "name": "honesty", "strength": -2.5}])
    assert (wire.name, wire.vector, wire.strength) == ("honesty", None, -2.5)


def test_an_ablate_gets_strength_one():
    [wire] = check([ablate()])
    assert (wire.op, wire.strength) == ("ablate", 1.0)


def test_interventions_keep_their_list_order():
    wire = check([add("mlp_out.2"), ablate("resid_pre.0"), add("resid_pre.0")])
    assert [(w.point, w.op) for w in wire] == [
        ("mlp_out.2", "add"),
        ("resid_pre.0", "ablate"),
        ("resid_pre.0", "add"),
    ]


# -- check_steering: refusals ------------------------------------------------


@pytest.mark.parametrize("asked", ["resid_post.1", "blocks.1.hook_resid_post", "resid_post.-3"])
def test_resid_post_asked_beside_steering_at_the_next_resid_pre_is_refused(asked):
    """resid_post.1 is read where resid_pre.2 is steered, after the
    intervention; TransformerLens reads it before."""
    problem = read_after_steering(check([add("blocks.2.hook_resid_pre")]), [asked], L)
    assert problem is not None
    assert f"steering[0] writes resid_pre.2 and hidden_states_points asks {asked!r}" in problem
    assert "Steer at resid_post.1 instead" in problem
    assert "ask resid_mid.1 and mlp_out.1" in problem


def test_sae_features_at_resid_post_beside_steering_at_the_next_resid_pre_are_refused():
    hook = "blocks.1.hook_resid_post"
    problem = read_after_steering(check([add("resid_pre.2")]), None, L, hook, sae_features=True)
    assert problem is not None
    assert f"sae_features reads the SAE at {hook!r}" in problem
    assert "Steer at resid_post.1 instead" in problem
    assert "resid_mid" not in problem  # that way is for points only


@pytest.mark.parametrize("hook", ["blocks.2.hook_resid_pre", "blocks.2.hook_resid_post", None])
def test_sae_features_read_where_tl_reads_them_beside_steering_are_allowed(hook):
    assert (
        read_after_steering(check([add("resid_pre.2")]), None, L, hook, sae_features=True) is None
    )


def test_a_clamp_at_an_sae_on_resid_post_comes_before_what_reads_resid_post():
    """The clamp's wire point is resid_pre.2 (its capture id), but it sits at
    the SAE's hook, blocks.1.hook_resid_post: its features and resid_post.1
    are read after it, as in TransformerLens."""
    wire = [
        Intervention(point="resid_pre.2", id=2, op="clamp_sae_feature", sae_feature=0, value=1.0)
    ]
    hook = "blocks.1.hook_resid_post"
    assert read_after_steering(wire, ["resid_post.1"], L, hook, sae_features=True) is None
    # An SAE at blocks.2.hook_resid_pre: the clamp comes after resid_post.1.
    assert read_after_steering(wire, ["resid_post.1"], L, "blocks.2.hook_resid_pre") is not None


@pytest.mark.parametrize(
    "steered, asked",
    [
        ("resid_post.1", ["resid_post.1", "resid_pre.2"]),  # read after it, as in TL
        ("resid_pre.2", ["resid_pre.2", "resid_post.2", "resid_mid.1", "mlp_out.1"]),
        ("resid_pre.1", ["resid_post.1", "resid_post.3"]),
        ("attn_out.2", ["resid_post.1", "attn_out.2"]),
    ],
)
def test_points_read_where_tl_reads_them_beside_steering_are_allowed(steered, asked):
    assert read_after_steering(check([add(steered)]), asked, L) is None


@pytest.mark.parametrize("value", [None, [], (), "resid_pre.1", {"point": "resid_pre.1"}])
def test_steering_must_be_a_non_empty_list(value):
    with pytest.raises(ValueError, match="non-empty list of interventions"):
        check(value)


def test_an_intervention_must_be_an_object_naming_its_keys():
    with pytest.raises(ValueError, match=r"steering\[0\] must be an object with keys.*'point'"):
        check(["resid_pre.1"])


def test_more_interventions_than_max_steering_are_refused():
    with pytest.raises(ValueError, match=r"3 interventions.*at most 2 per request"):
        check([add(), add(), add()], config(max_interventions=2))


def test_an_unknown_key_is_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"steering\[0\]\.weight: unknown key.*'strength'"):
        check([add(weight=2)])


def test_a_patch_naming_its_stored_rows_by_the_old_capture_key_is_told_the_key_stored():
    item = {"point": "resid_pre.1", "op": "patch", "capture": {"request_id": "cmpl-1"}}
    with pytest.raises(ValueError, match=r"steering\[0\]\.capture: unknown key.*'stored'"):
        check([item])


@pytest.mark.parametrize("point", ["resid_pre.9", "resid_pre", "nope.1", None])
def test_an_unknown_point_names_the_address_forms(point):
    with pytest.raises(ValueError, match=r"steering\[0\]\.point: .*'<kind>\.<i>'"):
        check([add(point=point)])


@pytest.mark.parametrize(
    "point",
    [
        "attn_pattern.1",
        "mlp_post.1",
        "blocks.1.attn.hook_pattern",
        "attn_z.1",
        "blocks.1.attn.hook_z",
    ],
)
def test_a_kind_that_is_not_in_the_stream_cannot_be_steered(point):
    """attn_z is written by patch and ablate_heads only: add is refused
    there too, naming the kinds add may steer."""
    with pytest.raises(ValueError, match="cannot be steered.*steerable kinds") as e:
        check([add(point=point)])
    assert all(kind in str(e.value) for kind in STEERABLE_KINDS)


def test_a_point_not_made_steerable_at_start_names_the_engine_points():
    cfg = config(points=("resid_pre", "mlp_out.2"))
    with pytest.raises(ValueError) as e:
        check([add(point="attn_out.1")], cfg)
    message = str(e.value)
    assert "'attn_out.1' is not steerable on this engine" in message
    assert "resid_pre (every layer), mlp_out.2" in message
    assert "--steering-points" in message


def test_an_unknown_op_names_the_ops():
    with pytest.raises(
        ValueError,
        match=r"steering\[0\]\.op: must be one of \['add', 'ablate', 'clamp_sae_feature', "
        r"'patch', 'sae_splice', 'ablate_heads'\]",
    ):
        check([add(op="scale")])


@pytest.mark.parametrize(
    "item",
    [
        {"point": "resid_pre.1", "vector": [1.0] * H, "name": "honesty"},
        {"point": "resid_pre.1"},
        {"point": "resid_pre.1", "vector": None, "name": None},
    ],
)
def test_exactly_one_of_vector_name_and_sae_feature(item):
    with pytest.raises(ValueError, match="exactly one of 'vector'.*'name'.*or 'sae_feature'"):
        check([item])


@pytest.mark.parametrize("vector", [[1.0] * (H - 1), [1.0] * (H + 1), np.ones((1, H))])
def test_an_inline_vector_must_be_hidden_size_numbers(vector):
    with pytest.raises(ValueError, match=rf"steering\[0\]\.vector: must be {H} numbers"):
        check([add(vector=vector)])


@pytest.mark.parametrize("vector", [["a"] * H, ["0.5"] * H, [True] * H, [[1.0] * H], 3.0], ids=str)
def test_an_inline_vector_of_non_numbers_is_refused(vector):
    with pytest.raises(ValueError, match=rf"must be a list of {H} numbers \(not strings"):
        check([add(vector=vector)])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_an_inline_vector_must_be_finite_in_float32(bad):
    with pytest.raises(ValueError, match="must be finite"):
        check([add(vector=[bad] + [0.0] * (H - 1))])


def test_an_unknown_name_lists_the_known_vectors():
    with pytest.raises(ValueError, match=r"unknown steering vector 'x'; known: \['honesty'"):
        check([{"point": "resid_pre.1", "name": "x"}])


def test_a_name_without_steering_vectors_says_how_to_load_some():
    with pytest.raises(ValueError, match=r"known: none \(start with --steering-vectors DIR\)"):
        check([{"point": "resid_pre.1", "name": "honesty"}], config(vectors={}))


def test_a_named_vector_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match=rf"'short' has 3 values; .*hidden_size is {H}"):
        check([{"point": "resid_pre.1", "name": "short"}])


def test_an_ablate_takes_no_strength():
    with pytest.raises(ValueError, match=r"strength: ablate takes no strength"):
        check([ablate(strength=2.0)])


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), "2", True, [1.0]])
def test_strength_must_be_a_finite_number(strength):
    with pytest.raises(ValueError, match=r"steering\[0\]\.strength: must be a finite number"):
        check([add(strength=strength)])


def test_two_ablates_at_one_point_are_refused_whatever_the_address_form():
    with pytest.raises(ValueError, match=r"steering\[1\]\.op: steering\[0\] already ablates"):
        check([ablate("resid_pre.1"), ablate("blocks.1.hook_resid_pre")])


def test_ablates_at_two_points_are_allowed():
    wire = check([ablate("resid_pre.1"), ablate("resid_pre.2")])
    assert [w.id for w in wire] == [1, 2]


def test_an_ablate_needs_a_non_zero_direction():
    with pytest.raises(ValueError, match="ablate needs a non-zero direction"):
        check([ablate(vector=[0.0] * H)])


@pytest.mark.parametrize("positions", ["last", "first"])
def test_positions_other_than_all_prompt_generated_or_a_window_are_refused(positions):
    with pytest.raises(ValueError, match=r"positions: must be 'all', 'prompt', 'generated'"):
        check([add(positions=positions)])


@pytest.mark.parametrize("positions", [{"start": -1}, {"start": 3, "end": 3}, {"begin": 0}])
def test_a_malformed_window_is_refused(positions):
    with pytest.raises(ValueError, match=r"steering\[0\]\.positions: .*0 <= s < e"):
        check([add(positions=positions)])


def test_a_window_starting_past_the_reach_is_refused():
    with pytest.raises(ValueError, match=rf"starts at position {REACH}, past the last"):
        check([add(positions={"start": REACH})])


def test_a_window_ending_past_the_reach_is_refused():
    with pytest.raises(ValueError, match=rf"ends at {REACH + 1}, past the {REACH} positions"):
        check([add(positions={"start": 0, "end": REACH + 1})])


# -- engine configuration ------------------------------------------------------


def test_steering_entry_defaults():
    assert steering_entry(None, None, None) == {
        "points": ["resid_pre"],
        "max_interventions": 4,
        "max_patch_rows": 2048,
        "vectors": {},
        "matrices": {},
    }


def test_steering_entry_splits_a_comma_list_of_points():
    entry = steering_entry(" resid_pre , mlp_out.2,", None, 2)
    assert (entry["points"], entry["max_interventions"]) == (["resid_pre", "mlp_out.2"], 2)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "4"])
def test_max_steering_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="--max-steering must be a positive integer"):
        steering_entry(None, None, value)


@pytest.mark.parametrize("points", ["", " , ", []])
def test_steering_points_may_not_be_empty(points):
    with pytest.raises(ValueError, match="--steering-points must be 'all', kinds"):
        steering_entry(points, None, None)


def save(path, tensors):
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}, str(path))


def test_a_file_of_one_tensor_is_named_by_its_stem(tmp_path):
    save(tmp_path / "honesty.safetensors", {"whatever": np.ones(H)})
    assert read_vector_names(str(tmp_path)) == ({"honesty": H}, {})


def test_a_file_of_several_tensors_names_each_stem_slash_key(tmp_path):
    save(tmp_path / "moods.safetensors", {"happy": np.ones(H), "sad": np.ones(3)})
    (tmp_path / "notes.txt").write_text("not a vector")
    assert read_vector_names(str(tmp_path)) == ({"moods/happy": H, "moods/sad": 3}, {})


def test_a_2d_tensor_is_a_matrix_of_patch_rows(tmp_path):
    save(tmp_path / "grid.safetensors", {"g": np.zeros((2, H))})
    assert read_vector_names(str(tmp_path)) == ({}, {"grid": [2, H]})


def test_a_tensor_that_is_neither_1d_nor_2d_is_refused(tmp_path):
    save(tmp_path / "cube.safetensors", {"c": np.ones((2, 2, H))})
    with pytest.raises(ValueError, match=r"cube.safetensors tensor 'c' has shape \[2, 2, 8\]"):
        read_vector_names(str(tmp_path))


@pytest.mark.parametrize(
    "values, problem", [([0.0] * H, "only zeros"), ([np.nan] + [1.0] * (H - 1), "non-finite")]
)
def test_a_named_vector_of_zeros_or_non_finite_values_is_refused_at_start(
    tmp_path, values, problem
):
    save(tmp_path / "bad.safetensors", {"v": np.asarray(values)})
    with pytest.raises(ValueError, match=f"bad.safetensors tensor 'v' has {problem}"):
        read_vector_names(str(tmp_path))


def test_a_missing_vectors_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        read_vector_names(str(tmp_path / "absent"))


def test_steering_entry_reads_the_vector_lengths_with_an_absolute_directory(tmp_path, monkeypatch):
    save(tmp_path / "honesty.safetensors", {"v": np.ones(H)})
    monkeypatch.chdir(tmp_path.parent)
    entry = steering_entry(None, tmp_path.name, None)
    assert entry["vectors_dir"] == str(tmp_path)
    assert entry["vectors"] == {"honesty": H}


def test_all_makes_every_stream_point_steerable_but_not_the_final_norm():
    """and the heads' outputs (attn_z, for patch and ablate_heads) of every
    attention layer."""
    ids = steerable_ids(["all"], L, ARCH)
    expected = {point_id(k, i, L) for k in (*STEERABLE_KINDS, "attn_z") for i in range(L)}
    assert set(ids) == expected
    assert L not in ids  # HF layer L: the final post-norm state
    assert list(ids) == sorted(ids)


def test_a_kind_alone_is_every_layer_of_it():
    assert steerable_ids(["attn_out"], L, ARCH) == tuple(
        point_id("attn_out", i, L) for i in range(L)
    )


def test_addresses_are_single_points_and_duplicates_collapse():
    ids = steerable_ids(["resid_pre.1", "resid_post.0", "mlp_out.-1"], L, ARCH)
    assert ids == (1, point_id("mlp_out", L - 1, L))  # resid_post.0 is resid_pre.1


def test_a_malformed_steering_point_names_the_steerable_kinds():
    with pytest.raises(ValueError, match=r"--steering-points entry .*steerable kinds .*resid_pre"):
        steerable_ids(["attn_pattern"], L, ARCH)


def test_a_non_stream_kind_cannot_be_made_steerable():
    with pytest.raises(ValueError, match=r"'mlp_post.1': mlp_post cannot be steered; steerable"):
        steerable_ids(["mlp_post.1"], L, ARCH)


@pytest.mark.parametrize("architecture", [None, "SomeUnmappedForCausalLM", "SolarForCausalLM"])
def test_an_unknown_layer_class_steers_only_the_embedding_output(architecture):
    """No reader for its layers: only resid_pre.0, the first layer's input
    as given, is steerable; any other point is refused naming why."""
    assert steerable_ids(["all"], L, architecture) == (0,)
    with pytest.raises(ValueError, match=r"attn_out cannot be steered there: .*not verified"):
        steerable_ids(["attn_out.1"], L, architecture)


def test_steering_config_reads_the_engine_entry():
    entry = additional_config_entry(None, steering=True, steering_points="resid_pre,mlp_out.1")
    cfg = SteeringConfig.from_vllm_config(fake_vllm_config(entry, num_layers=L, architecture=ARCH))
    assert cfg is not None
    assert cfg.ids == tuple(sorted([0, 1, 2, 3, point_id("mlp_out", 1, L)]))
    assert (cfg.max_interventions, cfg.architecture) == (4, ARCH)
    assert cfg.table_slots(max_num_seqs=3) == 1 + 3 * 7


def test_steering_config_is_none_without_steering():
    entry = additional_config_entry(None)
    assert SteeringConfig.from_vllm_config(fake_vllm_config(entry, num_layers=L)) is None


# -- cache salt ------------------------------------------------------------------


def digest_of(**changes):
    item = {"point": "resid_pre.1", "vector": [0.5] * H, "strength": 2.0}
    item.update(changes)
    return steering_digest(check([item]))


def test_equal_steering_has_equal_digests():
    assert digest_of() == digest_of()
    # equal after resolution: the address form and an int strength do not matter
    assert digest_of() == digest_of(point="blocks.1.hook_resid_pre", strength=2)


@pytest.mark.parametrize(
    "change",
    [
        {"vector": [0.5] * (H - 1) + [0.25]},
        {"strength": 2.5},
        {"point": "resid_pre.2"},
        {"positions": {"start": 1}},
        {"positions": "prompt"},
    ],
)
def test_a_change_to_the_steering_changes_the_digest(change):
    assert digest_of(**change) != digest_of()


def test_salted_keeps_the_request_salt_as_prefix():
    wire = check([add()])
    assert salted("mine", wire) == f"mine|steering:{steering_digest(wire)}"
    assert salted(None, wire) == f"|steering:{steering_digest(wire)}"
    assert salted("mine", wire) != salted("other", wire)


# -- compose ---------------------------------------------------------------------


rng = np.random.default_rng(0)


def random_vector() -> np.ndarray:
    return rng.standard_normal(H).astype(np.float32)


def unit(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float64)
    return v / np.linalg.norm(v)


def test_add_then_add_sums_the_scaled_vectors():
    v, w = random_vector(), random_vector()
    a, d = compose([("add", v, 2.0), ("add", w, -0.5)])
    np.testing.assert_allclose(a, 2.0 * v - 0.5 * w, atol=1e-6)
    assert not d.any()
    assert a.dtype == d.dtype == np.float32


def test_add_then_ablate_removes_the_adds_component_along_the_direction():
    v, u = random_vector(), random_vector()
    a, d = compose([("add", v, 3.0), ("ablate", u, 1.0)])
    np.testing.assert_allclose(d, unit(u), atol=1e-6)
    assert abs(float(a.astype(np.float64) @ unit(u))) < 1e-5
    expected = 3.0 * v - (3.0 * v.astype(np.float64) @ unit(u)) * unit(u)
    np.testing.assert_allclose(a, expected, atol=1e-5)


def test_ablate_then_add_keeps_the_add():
    v, u = random_vector(), random_vector()
    a, d = compose([("ablate", u, 1.0), ("add", v, 3.0)])
    np.testing.assert_allclose(a, 3.0 * v, atol=1e-6)
    np.testing.assert_allclose(d, unit(u), atol=1e-6)


@pytest.mark.parametrize(
    "ops",
    [
        ["add"],
        ["ablate"],
        ["add", "add"],
        ["add", "ablate"],
        ["ablate", "add"],
        ["add", "ablate", "add", "add"],
    ],
)
def test_the_composed_pair_matches_applying_the_interventions_in_turn(ops):
    interventions = [(op, random_vector(), float(rng.uniform(-3, 3))) for op in ops]
    a, d = compose(interventions)
    for _ in range(5):
        x = rng.standard_normal(H) * 4
        expected = x.copy()
        for op, v, strength in interventions:
            if op == "add":
                expected += strength * v.astype(np.float64)
            else:
                expected -= (expected @ unit(v)) * unit(v)
        a64, d64 = a.astype(np.float64), d.astype(np.float64)
        np.testing.assert_allclose(x - (x @ d64) * d64 + a64, expected, atol=1e-5)


# -- RequestSteering: stretches ------------------------------------------------


INDEX_OF = {1: 0, 2: 1, point_id("mlp_out", 1, L): 2}


def wire_item(capture_id, vector, start, end, op="add", strength=1.0):
    return Intervention(
        point=f"p.{capture_id}",
        id=capture_id,
        op=op,
        vector=[float(v) for v in vector],
        strength=strength,
        start=start,
        end=end,
    )


def spans(request: RequestSteering) -> list[tuple[int, int, int | None]]:
    return [(s.index, s.start, s.end) for s in request.stretches]


def test_overlapping_windows_at_one_point_split_into_stretches():
    v, w = np.ones(H, dtype=np.float32), np.arange(H, dtype=np.float32)
    request = RequestSteering(
        [wire_item(1, v, 0, 6, strength=2.0), wire_item(1, w, 3, 9)],
        NamedVectors(None),
        INDEX_OF,
        H,
    )
    assert spans(request) == [(0, 0, 3), (0, 3, 6), (0, 6, 9)]
    adds = [a for a, _ in request.pairs]
    np.testing.assert_allclose(adds[0], 2.0 * v)
    np.testing.assert_allclose(adds[1], 2.0 * v + w)
    np.testing.assert_allclose(adds[2], w)
    assert not any(d.any() for _, d in request.pairs)


def test_a_gap_between_windows_is_no_stretch():
    v = np.ones(H, dtype=np.float32)
    request = RequestSteering(
        [wire_item(1, v, 0, 2), wire_item(1, v, 5, 7)], NamedVectors(None), INDEX_OF, H
    )
    assert spans(request) == [(0, 0, 2), (0, 5, 7)]


def test_an_ablate_and_an_add_compose_over_their_common_stretch():
    u, v = np.arange(1, H + 1, dtype=np.float32), np.ones(H, dtype=np.float32)
    request = RequestSteering(
        [wire_item(1, u, 2, None, op="ablate"), wire_item(1, v, 0, 4)],
        NamedVectors(None),
        INDEX_OF,
        H,
    )
    assert spans(request) == [(0, 0, 2), (0, 2, 4), (0, 4, None)]
    expected = [compose([("add", v, 1.0)]), compose([("ablate", u, 1.0), ("add", v, 1.0)])]
    expected.append(compose([("ablate", u, 1.0)]))
    for (a, d), (ea, ed) in zip(request.pairs, expected, strict=True):
        np.testing.assert_array_equal(a, ea)
        np.testing.assert_array_equal(d, ed)


def test_interventions_at_different_points_are_separate_stretches():
    v, w = np.ones(H, dtype=np.float32), np.full(H, 2.0, dtype=np.float32)
    mlp = point_id("mlp_out", 1, L)
    request = RequestSteering(
        [wire_item(mlp, v, 0, None), wire_item(2, w, 0, None)], NamedVectors(None), INDEX_OF, H
    )
    assert spans(request) == [(INDEX_OF[mlp], 0, None), (INDEX_OF[2], 0, None)]
    np.testing.assert_array_equal(request.pairs[0][0], v)
    np.testing.assert_array_equal(request.pairs[1][0], w)


def test_an_open_ended_window_gives_a_last_stretch_without_end():
    request = RequestSteering([wire_item(1, np.ones(H), 4, None)], NamedVectors(None), INDEX_OF, H)
    assert spans(request) == [(0, 4, None)]


def test_request_steering_takes_the_wire_form_of_check_steering():
    wire = check([add("resid_pre.1", positions="prompt"), add("resid_pre.2", strength=3)])
    request = RequestSteering(wire, NamedVectors(None), INDEX_OF, H)
    assert spans(request) == [(0, 0, PROMPT), (1, 0, None)]
    np.testing.assert_array_equal(request.pairs[1][0], np.full(H, 3.0, dtype=np.float32))


def test_named_vectors_are_read_from_the_vectors_directory(tmp_path):
    save(tmp_path / "honesty.safetensors", {"v": np.arange(H)})
    request = RequestSteering(
        [
            msgspec.structs.replace(
                wire_item(1, [], 0, None, strength=2.0), vector=None, name="honesty"
            )
        ],
        NamedVectors(str(tmp_path)),
        INDEX_OF,
        H,
    )
    np.testing.assert_array_equal(request.pairs[0][0], 2.0 * np.arange(H, dtype=np.float32))


# -- SlotPool ------------------------------------------------------------------


def test_lend_gives_distinct_rows_and_give_back_returns_them():
    pool = SlotPool(5, "steering table")
    rows_a = pool.lend("a", 2, {"a"})
    rows_b = pool.lend("b", 2, {"a", "b"})
    assert pool.rows_of("a") == rows_a and pool.rows_of("b") == rows_b
    assert len(set(rows_a) | set(rows_b)) == 4 and not pool.free
    pool.give_back("a")
    assert pool.rows_of("a") is None
    assert sorted(pool.free) == sorted(rows_a)


def test_a_request_that_needs_no_rows_still_holds_a_lease():
    pool = SlotPool(3, "steering table")
    assert pool.lend("a", 0, {"a"}) == [] and pool.rows_of("a") == []


def test_give_back_of_an_unknown_request_is_a_no_op():
    pool = SlotPool(3, "steering table")
    pool.give_back("nobody")
    assert sorted(pool.free) == [1, 2]


def test_row_0_is_never_lent():
    pool = SlotPool(4, "steering table", "raise --max-steering")
    lent = [s for k in range(3) for s in pool.lend(str(k), 1, {str(k)})]
    assert sorted(lent) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="steering table full .*raise --max-steering"):
        pool.lend("x", 1, {"0", "1", "2", "x"})


def test_a_full_pool_evicts_holders_not_in_the_batch_which_then_hold_nothing():
    pool = SlotPool(5, "patch table")
    rows_a = pool.lend("a", 2, {"a"})
    pool.lend("b", 2, {"b"})
    rows_c = pool.lend("c", 2, {"b", "c"})
    # The evicted request holds no rows: its owner uploads it again rather
    # than arm rows that now hold another request's values.
    assert pool.rows_of("a") is None
    assert sorted(rows_c) == sorted(rows_a)
    assert pool.rows_of("b") is not None and set(pool.holders) == {"b", "c"}


def test_a_batch_that_does_not_fit_the_pool_raises_and_keeps_its_holders():
    pool = SlotPool(4, "steering table")
    pool.lend("a", 2, {"a"})
    with pytest.raises(RuntimeError, match=r"steering table full \(2 asked, 1 free\)"):
        pool.lend("b", 2, {"a", "b"})
    assert pool.rows_of("a") is not None


# -- the op, on CPU --------------------------------------------------------------

POINTS, MAX_TOKENS, SLOTS, TOKENS = 2, 6, 4, 5


def buffers():
    """``rows, slots, counts, adds, dirs`` of two points, nothing armed
    (``counts``: the armed entries per point, then whether each projects)."""
    rows = torch.zeros(POINTS, MAX_TOKENS, dtype=torch.int64)
    slots = torch.zeros_like(rows)
    counts = torch.zeros(2 * POINTS, dtype=torch.int64)
    adds = torch.zeros(SLOTS, H, dtype=torch.float32)
    dirs = torch.zeros_like(adds)
    return rows, slots, counts, adds, dirs


def arm(rows, slots, counts, index, entries, projects=True):
    """``entries``: ``(row, slot)`` pairs armed at point ``index``
    (``projects``: the general formula, else the adds-only path)."""
    for j, (r, s) in enumerate(entries):
        rows[index, j], slots[index, j] = r, s
    counts[index] = len(entries)
    counts[POINTS + index] = int(projects)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_adds_only_path_equals_the_general_formula_bitwise(scale):
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = torch.randn(H, generator=torch.Generator().manual_seed(3))
    adds[2] = torch.randn(H, generator=torch.Generator().manual_seed(4))
    entries = [(0, 1), (2, 2), (3, 1)]
    general, fast = stream(), stream()
    arm(rows, slots, counts, 0, entries, projects=True)
    _steer(general, None, [rows, slots, counts], 0, [adds, dirs], scale)
    arm(rows, slots, counts, 0, entries, projects=False)
    _steer(fast, None, [rows, slots, counts], 0, [adds, dirs], scale)
    assert torch.equal(general, fast)
    assert not torch.equal(fast, stream())


def stream() -> torch.Tensor:
    return torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))


def test_an_unarmed_point_changes_nothing():
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = 5.0
    dirs[2] = 1.0 / H**0.5
    arm(rows, slots, counts, 0, [(0, 1), (1, 2)])  # armed at point 0, not at point 1
    target = stream()
    before = target.clone()
    _steer(target, None, [rows, slots, counts], 1, [adds, dirs], 1.0)
    assert torch.equal(target, before)


def test_add_changes_only_the_armed_rows_by_exactly_the_vector():
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = torch.arange(H, dtype=torch.float32)
    adds[2] = -1.5
    arm(rows, slots, counts, 1, [(1, 1), (3, 2), (4, 1)])
    target = stream()
    before = target.clone()
    _steer(target, None, [rows, slots, counts], 1, [adds, dirs], 1.0)
    assert torch.equal(target[1], before[1] + adds[1])
    assert torch.equal(target[3], before[3] + adds[2])
    assert torch.equal(target[4], before[4] + adds[1])
    assert torch.equal(target[[0, 2]], before[[0, 2]])


def test_ablate_leaves_the_armed_rows_orthogonal_to_the_direction():
    rows, slots, counts, adds, dirs = buffers()
    d = torch.randn(H, generator=torch.Generator().manual_seed(2))
    dirs[3] = d / d.norm()
    arm(rows, slots, counts, 0, [(0, 3), (2, 3)])
    target = stream()
    before = target.clone()
    _steer(target, None, [rows, slots, counts], 0, [adds, dirs], 1.0)
    assert torch.allclose(target[[0, 2]] @ dirs[3], torch.zeros(2), atol=1e-5)
    assert not torch.equal(target[0], before[0])
    assert torch.equal(target[[1, 3, 4]], before[[1, 3, 4]])


def test_a_composed_pair_on_a_row_matches_compose():
    rows, slots, counts, adds, dirs = buffers()
    u, v = np.arange(1, H + 1, dtype=np.float32), np.ones(H, dtype=np.float32)
    a, d = compose([("add", v, 2.0), ("ablate", u, 1.0)])
    adds[1], dirs[1] = torch.from_numpy(a), torch.from_numpy(d)
    arm(rows, slots, counts, 0, [(2, 1)])
    target = stream()
    x = target[2].double().numpy()
    _steer(target, None, [rows, slots, counts], 0, [adds, dirs], 1.0)
    expected = x + 2.0 * v
    expected -= (expected @ unit(u)) * unit(u)
    np.testing.assert_allclose(target[2].double().numpy(), expected, atol=1e-5)


def test_with_other_the_stream_is_their_sum_and_only_target_is_written():
    rows, slots, counts, adds, dirs = buffers()
    d = torch.randn(H, generator=torch.Generator().manual_seed(3))
    dirs[1] = d / d.norm()
    adds[2] = 0.75
    arm(rows, slots, counts, 0, [(1, 1), (3, 2)])
    residual, hidden = stream(), stream() * 2 + 1
    hidden_before, residual_before = hidden.clone(), residual.clone()
    _steer(residual, hidden, [rows, slots, counts], 0, [adds, dirs], 1.0)
    assert torch.equal(hidden, hidden_before)
    assert abs(float((residual[1] + hidden[1]) @ dirs[1])) < 1e-5
    assert float(residual_before[1] @ dirs[1]) != pytest.approx(float(residual[1] @ dirs[1]))
    assert torch.equal(residual[3], residual_before[3] + adds[2])
    assert torch.equal(residual[[0, 2, 4]], residual_before[[0, 2, 4]])


@pytest.mark.parametrize("scale", [0.25, 0.22, 4.0])
def test_with_a_scale_the_scaled_stream_gets_exactly_the_delta(scale):
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = torch.linspace(-1, 1, H)
    d = torch.randn(H, generator=torch.Generator().manual_seed(4))
    dirs[2] = d / d.norm()
    arm(rows, slots, counts, 0, [(0, 1), (4, 2)])
    target = stream()
    before = target.clone()
    _steer(target, None, [rows, slots, counts], 0, [adds, dirs], scale)
    assert torch.allclose(target[0] * scale, before[0] * scale + adds[1], atol=1e-6)
    assert abs(float((target[4] * scale) @ dirs[2])) < 1e-5
    assert torch.equal(target[1:4], before[1:4])


@pytest.fixture
def sync_free(monkeypatch):
    """The op as off CPU: every entry up to the token count, no count read."""
    monkeypatch.setattr(worker_steering, "count_readable_on_host", lambda device: False)


@pytest.mark.usefixtures("sync_free")
def test_without_a_count_read_a_disarmed_index_is_a_zero_delta():
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = 5.0
    dirs[2] = 1.0 / H**0.5
    target = stream()
    before = target.clone()
    _steer(target, None, [rows, slots, counts], 0, [adds, dirs], 1.0)
    assert torch.equal(target, before)


@pytest.mark.usefixtures("sync_free")
def test_without_a_count_read_the_armed_entries_still_apply_once():
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = torch.arange(H, dtype=torch.float32)
    arm(rows, slots, counts, 0, [(0, 1), (3, 1)])  # entries past the count: row 0, slot 0
    target = stream()
    before = target.clone()
    _steer(target, None, [rows, slots, counts], 0, [adds, dirs], 1.0)
    assert torch.equal(target[0], before[0] + adds[1])
    assert torch.equal(target[3], before[3] + adds[1])
    assert torch.equal(target[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.usefixtures("sync_free")
def test_without_a_count_read_entries_past_the_count_are_applied_so_disarm_must_zero_them():
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = 1.0
    rows[0, 2], slots[0, 2] = 4, 1  # left armed, count 0
    target = stream()
    before = target.clone()
    _steer(target, None, [rows, slots, counts], 0, [adds, dirs], 1.0)
    assert torch.equal(target[4], before[4] + 1.0)


# --------------------------------------------------------------------------
# the CUDA kernel, run by Triton's interpreter on CPU tensors

_KERNEL_CHECK = r"""
import torch
from vllm_hidden_states.worker import steer_kernel
from vllm_hidden_states.worker.steering_op import _steer


def check(dtype_name, other_kind, scale_text, clamp_kind):
    torch.manual_seed(0)
    H, T, S = 300, 7, 5  # H not a multiple of the kernel's block
    dtype = getattr(torch, dtype_name)
    target = torch.randn(T, H).to(dtype)
    other = torch.randn(T, H).to(dtype) if other_kind == "other" else None
    scale = float(scale_text)
    clamp = clamp_kind == "clamp"
    adds, dirs = torch.zeros(S, H), torch.zeros(S, H)
    adds[1] = torch.randn(H)                                   # add
    dirs[2] = torch.nn.functional.normalize(torch.randn(H), dim=0)  # ablate
    adds[3], dirs[3] = torch.randn(H), dirs[2]                 # composed
    enc = dec = par = None
    if clamp:
        enc, dec, par = torch.zeros(S, H), torch.zeros(S, H), torch.zeros(S, 3)
        enc[4], dec[4] = torch.randn(H) / H**0.5, torch.randn(H)
        par[4] = torch.tensor([0.1, 0.05, 3.0])
    rows = torch.tensor([[2, 0, 5, 6, 1, 0, 0]])
    slots = torch.tensor([[1, 2, 3, 4 if clamp else 1, 0, 0, 0]])
    counts = torch.tensor([4, 1])
    expected = target.clone()
    _steer(expected, other, [rows, slots, counts], 0, [adds, dirs, enc, dec, par], scale)
    got = target.clone()
    steer_kernel.steer(got, other, rows[0], slots[0], T, [adds, dirs, enc, dec, par], scale)
    untouched = [r for r in range(T) if r not in (2, 0, 5, 6)]
    assert torch.equal(got[untouched], target[untouched]), "rows with slot 0 changed"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    assert err < tol, f"kernel vs torch path: relative error {err:.2e}"
    assert not torch.equal(got, target), "nothing was steered"
    return err
"""

KERNEL_CASES = [
    ("float32", "none", "1.0", "none"),
    ("float32", "other", "1.0", "clamp"),
    ("float32", "none", "0.25", "clamp"),
    ("bfloat16", "other", "1.0", "none"),
]


@pytest.fixture(scope="module")
def kernel_results(triton_interpreted) -> dict[tuple[str, ...], str]:
    return triton_interpreted(_KERNEL_CHECK, KERNEL_CASES)


@pytest.mark.parametrize("args", KERNEL_CASES, ids=lambda a: "-".join(a))
def test_the_cuda_kernel_computes_what_the_torch_path_does(args, kernel_results):
    """The Triton kernel (CUDA's path) on CPU tensors through Triton's
    interpreter, against the op's PyTorch path: the same rows steered, the
    same values, slot-0 entries untouched bit for bit."""
    result = kernel_results.get(args, "not run")
    assert result.startswith("ok"), result[-2000:]


def test_compiled_on_cpu_a_steerable_point_is_aten_ops_in_the_graph_and_steers_as_eager():
    """On CPU no CUDA graph replays the step, so an opaque-op call would be a
    Python dispatch per point on every forward, steered or not; the compiled
    graph holds the formula at every token as aten ops, each token's slot
    read from the dense map, and writes what the op writes."""
    rows, slots, counts, adds, dirs = buffers()
    adds[1] = torch.arange(H, dtype=torch.float32)
    d = torch.randn(H, generator=torch.Generator().manual_seed(5))
    dirs[2] = d / d.norm()
    entries = [(0, 1), (3, 2)]
    arm(rows, slots, counts, 0, entries)
    token_slots = torch.zeros(POINTS, MAX_TOKENS, dtype=torch.int64)
    for r, s in entries:
        token_slots[0, r] = s
    graphs = []

    def keep_graph(gm: torch.fx.GraphModule, example_inputs: list):
        graphs.append(gm)
        return gm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = x * 2.0  # steer an intermediate, as in a model
        steer(x, None, [rows, slots, counts], 0, [adds, dirs], 1.0, token_slots=token_slots)
        return x + 1.0

    with torch.inference_mode():
        compiled = torch.compile(forward, backend=keep_graph, fullgraph=True, dynamic=True)
        got = compiled(stream())
        expected = forward(stream())  # eager: the op's body, count read
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert not any("hidden_states_steer" in t for t in targets)
    assert not any("index_add" in t or "scatter" in t for t in targets)  # gathers only
    torch.testing.assert_close(got, expected)
    before = stream() * 2.0 + 1.0
    assert torch.equal(got[[1, 2, 4]], before[[1, 2, 4]])  # slot 0: unchanged


# -- per-head writes at attn_z ------------------------------------------------------

HEADS, HEAD_DIM = 4, 2  # attn_z is HEADS * HEAD_DIM = H wide here


def heads_config(**extra) -> SteeringConfig:
    return SteeringConfig(
        num_layers=L,
        ids=steerable_ids(["all"], L, ARCH),
        points_given=("all",),
        max_interventions=4,
        architecture=ARCH,
        z_shapes=((HEADS, HEAD_DIM),) * L,
        **extra,
    )


def wire_rows(item: dict) -> np.ndarray:
    return np.frombuffer(item.rows, "<f4").reshape(item.n, HEADS * HEAD_DIM)


def test_a_per_head_patch_is_full_width_rows_with_nan_in_the_other_heads_columns():
    rows = np.arange(2 * 2 * HEAD_DIM, dtype=np.float32).reshape(2, 2, HEAD_DIM)
    item = {"point": "attn_z.1", "op": "patch", "heads": [3, 1], "rows": rows,
            "positions": {"start": 1, "end": 3}}  # fmt: skip
    [wire] = check_steering([item], heads_config(), H, PROMPT, REACH)
    full = wire_rows(wire).reshape(2, HEADS, HEAD_DIM)
    assert (wire.op, wire.n, wire.start, wire.end) == ("patch", 2, 1, 3)
    assert np.array_equal(full[:, 3], rows[:, 0]) and np.array_equal(full[:, 1], rows[:, 1])
    assert np.isnan(full[:, [0, 2]]).all()


def test_a_patch_at_attn_z_without_heads_takes_flat_rows_of_every_head():
    rows = np.ones((2, HEADS * HEAD_DIM), np.float32)
    item = {"point": "blocks.1.attn.hook_z", "op": "patch", "rows": rows}
    [wire] = check_steering([item], heads_config(), H, PROMPT, REACH)
    assert np.array_equal(wire_rows(wire), rows) and (wire.start, wire.end) == (0, 2)


def test_ablate_heads_is_one_table_row_over_every_position_by_default():
    item = {"point": "attn_z.2", "op": "ablate_heads", "heads": [0], "mode": "mean",
            "mean": [[5.0, 6.0]]}  # fmt: skip
    [wire] = check_steering([item], heads_config(), H, PROMPT, REACH)
    assert (wire.op, wire.n, wire.start, wire.end) == ("ablate_heads", 1, 0, None)
    row = wire_rows(wire)[0].reshape(HEADS, HEAD_DIM)
    assert row[0].tolist() == [5.0, 6.0] and np.isnan(row[1:]).all()
    zero = check_steering(
        [{**item, "mode": "zero", "mean": None}], heads_config(), H, PROMPT, REACH
    )
    assert wire_rows(zero[0])[0, :HEAD_DIM].tolist() == [0.0, 0.0]


def test_an_ablate_heads_row_counts_against_the_patch_table():
    items = [
        {"point": "attn_z.2", "op": "ablate_heads", "heads": [0]},
        {"point": "resid_pre.1", "op": "patch", "rows": np.ones((2, H))},
    ]
    with pytest.raises(ValueError, match="patches 3 positions; .* holds 2 rows"):
        check_steering(items, heads_config(max_patch_rows=2), H, PROMPT, REACH)


def test_the_cache_salt_covers_the_heads_and_the_mean():
    cfg = heads_config()
    base = {"point": "attn_z.2", "op": "ablate_heads", "heads": [0], "mode": "mean",
            "mean": [[1.0, 2.0]]}  # fmt: skip
    digests = {
        steering_digest(check_steering([item], cfg, H, PROMPT, REACH))
        for item in (base, {**base, "heads": [1]}, {**base, "mean": [[1.0, 2.5]]})
    }
    assert len(digests) == 3


def test_attn_z_at_a_mamba_layer_is_refused_naming_the_attention_layers():
    from .test_layer_classes import hybrid

    model = hybrid()
    cfg = SteeringConfig(
        num_layers=L, ids=steerable_ids(["all"], L, model), points_given=("all",),
        max_interventions=4, model_layers=model, z_shapes=((HEADS, HEAD_DIM),) * L,
    )  # fmt: skip
    assert point_id("attn_z", 1, L) in cfg.ids and point_id("attn_z", 0, L) not in cfg.ids
    item = {"point": "attn_z.0", "op": "ablate_heads", "heads": [0]}
    with pytest.raises(
        ValueError, match=r"attn_z.0: decoder layer 0 .*layers with attn_z: \[1, 3\]"
    ):
        check_steering([item], cfg, H, PROMPT, REACH)


def test_a_tensor_parallel_rank_keeps_only_its_heads_columns_of_patch_rows():
    """Rank 1 of 2 holds heads 2..3 of attn_z.2: its table rows are those
    heads' columns of the full-width rows (NaN: keep), padded to the table."""
    cfg = heads_config()
    z = point_id("attn_z", 2, L)
    index_of = {k: i for i, k in enumerate(cfg.ids)}
    rows = np.arange(2 * H, dtype=np.float32).reshape(2, HEADS, HEAD_DIM)
    items = [
        {"point": "attn_z.2", "op": "patch", "heads": [0, 3], "rows": rows[:, [0, 3]],
         "positions": {"start": 1, "end": 3}},
    ]  # fmt: skip
    wire = check_steering(items, cfg, H, PROMPT, REACH)
    half = slice(H // 2, H)
    request = RequestSteering(wire, NamedVectors(None), index_of, H, {z: H}, H, {z: half})
    table = request.patch_rows
    assert table.shape == (2, H)
    assert np.isnan(table[:, :HEAD_DIM]).all()  # head 2: kept
    assert np.array_equal(table[:, HEAD_DIM : 2 * HEAD_DIM], rows[:, 3])  # head 3: written
    assert (table[:, 2 * HEAD_DIM :] == 0).all()  # padding past this rank's width


def test_the_worker_pads_rows_to_the_table_and_spans_an_ablation_with_one_row():
    cfg = heads_config()
    z = point_id("attn_z", 2, L)
    index_of = {k: i for i, k in enumerate(cfg.ids)}
    items = [
        {"point": "attn_z.2", "op": "ablate_heads", "heads": [1]},
        {"point": "resid_pre.1", "op": "patch", "rows": np.ones((2, H))},
    ]
    wire = check_steering(items, cfg, H, PROMPT, REACH)
    request = RequestSteering(wire, NamedVectors(None), index_of, H, {z: H}, H + 4)
    assert request.patch_rows.shape == (3, H + 4)
    spans = [(s.index, s.start, s.end) for s in request.patch_stretches]
    assert spans == [(index_of[z], 0, None), (index_of[1], 0, 1), (index_of[1], 1, 2)]
