# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.server.openai_request and .openai_response: the request
fields and a choice's object.

Importing the module imports ``vllm`` (its logger), not the engine or the
OpenAI server; nothing here builds either.
"""

from http import HTTPStatus

import numpy as np
import pytest
import torch

from vllm_hidden_states.client import to_numpy
from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.openai_request import HiddenStatesAsk, parse_ask
from vllm_hidden_states.server.openai_response import encode_choice_states


def ask(**fields):
    return parse_ask({"return_hidden_states": True, **fields})


def bad_request(extra) -> ApiError:
    """The ApiError ``parse_ask(extra)`` raises (fails the test if none)."""
    with pytest.raises(ApiError) as e:
        parse_ask(extra)
    return e.value


# --------------------------------------------------------------------------
# parse_ask: nothing asked


@pytest.mark.parametrize("extra", [None, {}])
def test_parse_ask_is_none_without_extra_fields(extra):
    assert parse_ask(extra) is None


def test_parse_ask_is_none_when_only_unrelated_extra_fields_are_given():
    assert parse_ask({"top_k": 5, "return_tokens_as_token_ids": True}) is None


def test_parse_ask_is_none_when_return_hidden_states_is_false():
    assert parse_ask({"return_hidden_states": False}) is None


def test_parse_ask_is_none_when_every_field_is_null():
    extra = {
        "return_hidden_states": None,
        "hidden_states_layers": None,
        "hidden_states_format": None,
    }
    assert parse_ask(extra) is None


# --------------------------------------------------------------------------
# parse_ask: what is asked


def test_parse_ask_defaults_to_the_final_layer_as_float():
    assert ask() == HiddenStatesAsk(layers=(-1,), encoding_format="float")


def test_parse_ask_null_layers_and_format_take_the_defaults():
    parsed = ask(hidden_states_layers=None, hidden_states_format=None)
    assert parsed == HiddenStatesAsk((-1,), "float")


def test_parse_ask_keeps_the_requested_layers_in_request_order_as_a_tuple():
    assert ask(hidden_states_layers=[2, -1, 0, 2]).layers == (2, -1, 0, 2)


def test_parse_ask_does_not_check_layers_against_any_model():
    assert ask(hidden_states_layers=[10_000]).layers == (10_000,)


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_parse_ask_accepts_each_encoding_format(fmt):
    assert ask(hidden_states_format=fmt).encoding_format == fmt


# --------------------------------------------------------------------------
# parse_ask: 400s naming the field


@pytest.mark.parametrize("flag", ["yes", "true", 1, 0, [True], {}])
def test_return_hidden_states_must_be_a_bool(flag):
    error = bad_request({"return_hidden_states": flag})
    assert error.param == "return_hidden_states"
    assert error.status == HTTPStatus.BAD_REQUEST
    assert error.type == "invalid_request_error"
    assert "return_hidden_states must be true or false" in error.message
    assert repr(flag) in error.message


@pytest.mark.parametrize("flag", [None, False])
def test_layers_without_return_hidden_states_true_is_rejected(flag):
    error = bad_request({"return_hidden_states": flag, "hidden_states_layers": [-1]})
    assert error.param == "hidden_states_layers"
    assert "return_hidden_states is not true" in error.message


def test_layers_alone_is_rejected():
    assert bad_request({"hidden_states_layers": [-1]}).param == "hidden_states_layers"


@pytest.mark.parametrize("flag", [None, False])
def test_format_without_return_hidden_states_true_is_rejected(flag):
    error = bad_request({"return_hidden_states": flag, "hidden_states_format": "base64"})
    assert error.param == "hidden_states_format"
    assert "return_hidden_states is not true" in error.message


@pytest.mark.parametrize(
    "layers",
    # (JSON has no tuple; the Python API takes a list or a tuple, by the same rule.)
    [-1, "-1", "-1,-2", {"layer": -1}, [-1, True], [-1.0]],
    ids=["int", "str", "csv", "dict", "bool", "float"],
)
def test_layers_must_be_a_list(layers):
    error = bad_request({"return_hidden_states": True, "hidden_states_layers": layers})
    assert error.param == "hidden_states_layers"
    assert "must be a non-empty list of integers" in error.message


def test_layers_must_not_be_empty():
    error = bad_request({"return_hidden_states": True, "hidden_states_layers": []})
    assert error.param == "hidden_states_layers"
    assert "non-empty" in error.message


@pytest.mark.parametrize(
    "layers",
    [[True], [-1, False], [1.0], [-1, 2.5], ["-1"], [-1, "2"], [None], [[-1]]],
    ids=["true", "false", "float", "float2", "str", "str2", "null", "nested"],
)
def test_layers_entries_must_be_integers_not_bools_floats_or_strings(layers):
    error = bad_request({"return_hidden_states": True, "hidden_states_layers": layers})
    assert error.param == "hidden_states_layers"
    assert repr(layers) in error.message


@pytest.mark.parametrize("fmt", ["binary", "FLOAT", "", 1, ["float"]])
def test_unknown_format_is_rejected_listing_the_formats(fmt):
    error = bad_request({"return_hidden_states": True, "hidden_states_format": fmt})
    assert error.param == "hidden_states_format"
    assert "['float', 'base64']" in error.message
    assert repr(fmt) in error.message


# --------------------------------------------------------------------------
# encode_choice_states


def two_layer_states(dtype=torch.float32, positions: int = 3, hidden: int = 8):
    g = torch.Generator().manual_seed(0)
    return {
        -1: torch.randn(positions, hidden, generator=g).to(dtype),
        2: torch.randn(positions, hidden, generator=g).to(dtype),
    }


def test_encode_choice_states_takes_the_last_row_of_each_layer_in_request_order():
    states = two_layer_states()
    out = encode_choice_states(states, HiddenStatesAsk((2, -1), "float"))
    expected = torch.stack([states[2][-1], states[-1][-1]]).numpy()
    np.testing.assert_array_equal(out["data"], expected)


def test_encode_choice_states_reports_layers_shape_dtype_and_encoding():
    out = encode_choice_states(two_layer_states(), HiddenStatesAsk((2, -1), "float"))
    assert out["layers"] == [2, -1]
    assert out["shape"] == [2, 8]
    assert out["dtype"] == "float32"
    assert out["encoding_format"] == "float"


def test_encode_choice_states_reports_the_model_dtype_but_sends_float32():
    states = two_layer_states(torch.bfloat16)
    out = encode_choice_states(states, HiddenStatesAsk((-1,), "float"))
    assert out["dtype"] == "bfloat16"
    assert out["data"].dtype == np.float32
    np.testing.assert_array_equal(out["data"], states[-1][-1:].float().numpy())


def test_encode_choice_states_with_one_position_uses_that_row():
    states = two_layer_states(positions=1)
    out = encode_choice_states(states, HiddenStatesAsk((-1, 2), "float"))
    np.testing.assert_array_equal(out["data"], torch.cat([states[-1], states[2]]).numpy())


def test_encode_choice_states_base64_decodes_with_the_client(wire):
    states = two_layer_states(torch.float16)
    out = encode_choice_states(states, HiddenStatesAsk((2, -1), "base64"))
    assert out["encoding_format"] == "base64"
    assert isinstance(out["data"], str)
    expected = torch.stack([states[2][-1], states[-1][-1]]).float().numpy()
    np.testing.assert_array_equal(to_numpy(wire({"index": 0, "hidden_states": out})), expected)


def test_encode_choice_states_repeats_a_layer_asked_twice():
    states = two_layer_states()
    out = encode_choice_states(states, HiddenStatesAsk((-1, -1), "float"))
    assert out["shape"] == [2, 8]
    np.testing.assert_array_equal(out["data"][0], out["data"][1])


def test_encode_choice_states_is_none_without_states():
    assert encode_choice_states(None, HiddenStatesAsk((-1,), "float")) is None


# --------------------------------------------------------------------------
# positions and per-token streaming


def test_parse_ask_defaults_to_last_positions_not_streamed():
    parsed = ask()
    assert (parsed.positions, parsed.stream) == ("last", False)


@pytest.mark.parametrize("positions", ["last", "all", "prompt"])
def test_parse_ask_accepts_each_choice_position_mode(positions):
    assert ask(hidden_states_positions=positions).positions == positions


@pytest.mark.parametrize("positions", ["first", "ALL", "", 1, ["all"]])
def test_unknown_positions_are_rejected_listing_the_modes(positions):
    error = bad_request({"return_hidden_states": True, "hidden_states_positions": positions})
    assert error.param == "hidden_states_positions"
    assert "['last', 'all', 'prompt', 'generated']" in error.message
    assert '{"start": s, "end": e}' in error.message


@pytest.mark.parametrize(
    "window",
    [{"start": -1}, {"start": 3, "end": 3}, {"end": 4}, {"start": 1.5}, {"start": 0, "stop": 2}],
)
def test_a_malformed_window_is_rejected_naming_the_form(window):
    error = bad_request({"return_hidden_states": True, "hidden_states_positions": window})
    assert error.param == "hidden_states_positions"
    assert "integers 0 <= s < e" in error.message


def test_generated_and_windows_may_stream_every_row():
    from vllm_hidden_states.points import Window

    parsed = ask(hidden_states_positions={"start": 2, "end": 9}, hidden_states_stream=True)
    assert parsed.positions == Window(2, 9) and parsed.stream
    assert parsed.positions_json == {"start": 2, "end": 9}
    assert ask(hidden_states_positions="generated", hidden_states_stream=True).stream


def test_hidden_states_stream_with_all_positions_is_accepted():
    parsed = ask(hidden_states_positions="all", hidden_states_stream=True)
    assert parsed == HiddenStatesAsk((-1,), "float", "all", True)


@pytest.mark.parametrize("positions", [None, "last", "prompt"])
def test_hidden_states_stream_needs_all_positions(positions):
    error = bad_request(
        {
            "return_hidden_states": True,
            "hidden_states_stream": True,
            "hidden_states_positions": positions,
        }
    )
    assert error.param == "hidden_states_stream"
    assert "'all'" in error.message


@pytest.mark.parametrize("flag", ["yes", 1, [True]])
def test_hidden_states_stream_must_be_a_bool(flag):
    error = bad_request(
        {
            "return_hidden_states": True,
            "hidden_states_positions": "all",
            "hidden_states_stream": flag,
        }
    )
    assert error.param == "hidden_states_stream"


@pytest.mark.parametrize("field", ["hidden_states_positions", "hidden_states_stream"])
def test_positions_or_stream_without_return_hidden_states_is_rejected(field):
    value = "all" if field == "hidden_states_positions" else True
    error = bad_request({field: value})
    assert error.param == field
    assert "return_hidden_states is not true" in error.message


def test_encode_choice_states_all_positions_keeps_every_row_per_layer():
    states = two_layer_states(positions=5)
    out = encode_choice_states(states, HiddenStatesAsk((2, -1), "float", "all"), start=7)
    assert (out["positions"], out["start"], out["shape"]) == ("all", 7, [2, 5, 8])
    rows = to_numpy(out)
    assert np.array_equal(rows[0], states[2].numpy())
    assert np.array_equal(rows[1], states[-1].numpy())


def test_choice_rows_take_advances_start_by_the_rows_taken():
    from vllm_hidden_states.server.openai_response import ChoiceRows

    ask_all = HiddenStatesAsk((-1,), "base64", "all", True)
    rows = ChoiceRows()
    rows.pending = [{-1: torch.zeros(4, 8)}, {-1: torch.ones(1, 8)}]
    first, neurons = rows.take(ask_all)
    assert (first["start"], first["shape"]) == (0, [1, 5, 8]) and neurons == {}
    assert rows.take(ask_all) == (None, {})
    rows.pending = [{-1: torch.ones(2, 8)}]
    assert rows.take(ask_all)[0]["start"] == 5


def test_choice_rows_take_gives_neurons_their_own_object():
    from vllm_hidden_states.server.openai_response import ChoiceRows

    ask = HiddenStatesAsk((), "float", "all", True, neurons=("mlp_post.1",))
    rows = ChoiceRows(start=3)
    rows.pending = [{"mlp_post.1": torch.zeros(2, 16)}, {"mlp_post.1": torch.ones(1, 16)}]
    hidden, objects = rows.take(ask)
    assert hidden is None and list(objects) == ["neurons"]
    neurons = objects["neurons"]
    assert neurons["points"] == ["mlp_post.1"] and neurons["start"] == 3
    assert neurons["shape"] == [1, 3, 16] and rows.start == 6


def test_heads_outputs_and_neurons_come_as_two_objects_of_their_own_widths():
    """attn_z rows (``[positions, heads, head_dim]``) are not stacked with
    mlp_post's (intermediate_size wide): a head_outputs object beside
    neurons, with its heads axis."""
    from vllm_hidden_states.server.openai_response import ChoiceRows

    points = ("attn_z.0", "mlp_post.1", "blocks.1.attn.hook_z")
    ask = HiddenStatesAsk((), "float", "last", neurons=points)
    rows = ChoiceRows()
    rows.pending = [
        {
            "attn_z.0": torch.ones(2, 3, 2),
            "mlp_post.1": torch.zeros(2, 16),
            "blocks.1.attn.hook_z": torch.full((2, 3, 2), 2.0),
        }
    ]
    _, objects = rows.take(ask)
    assert list(objects) == ["neurons", "head_outputs"]
    assert objects["neurons"]["points"] == ["mlp_post.1"]
    assert objects["neurons"]["shape"] == [1, 16]
    heads = objects["head_outputs"]
    assert heads["points"] == ["attn_z.0", "blocks.1.attn.hook_z"] and heads["shape"] == [2, 3, 2]


def test_price_positions_counts_prompt_plus_max_tokens_per_choice():
    from vllm_hidden_states.server.limits import Limits
    from vllm_hidden_states.server.openai_request import PositionPricing, price_positions

    # 1 layer x 8 values x 16 bytes (float JSON) = 128 bytes per position.
    limits = Limits(max_response_bytes=128 * 100, max_batch=8, max_input_chars=100)
    pricing = PositionPricing(limits, HiddenStatesAsk((-1,), "float", "all"), n=2, hidden_size=8)
    price_positions(pricing, prompt_len=30, max_tokens=20)  # 2 x 50 = 100: fits
    assert pricing.spent_positions == 100
    with pytest.raises(ApiError) as e:
        price_positions(pricing, prompt_len=1, max_tokens=0)
    assert e.value.param == "max_tokens"
    assert "--hidden-states-max-response-mb" in e.value.message


def test_price_positions_counts_only_the_prompt_for_prompt_positions():
    from vllm_hidden_states.server.limits import Limits
    from vllm_hidden_states.server.openai_request import PositionPricing, price_positions

    limits = Limits(max_response_bytes=128 * 10, max_batch=8, max_input_chars=100)
    pricing = PositionPricing(limits, HiddenStatesAsk((-1,), "float", "prompt"), n=1, hidden_size=8)
    price_positions(pricing, prompt_len=10, max_tokens=500)
    assert pricing.spent_positions == 10


# --------------------------------------------------------------------------
# The response cap prices SAE features too.


def test_sae_features_count_toward_the_response_cap_and_are_named():
    from vllm_hidden_states.server.limits import (
        SAE_FEATURE_BYTES,
        Limits,
        ResponseSize,
        check_response,
    )

    positions, top_k = 1000, 64
    cap = positions * top_k * SAE_FEATURE_BYTES - 1  # one byte short
    limits = Limits(max_response_bytes=cap, max_batch=8, max_input_chars=1000)

    def size(positions: int, sae_top_k: int = 0) -> ResponseSize:
        return ResponseSize(1, positions, 0, 128, sae_top_k=sae_top_k)

    check_response(limits, size(positions), "float", "max_tokens", "advice")  # no features
    with pytest.raises(ApiError) as e:
        check_response(limits, size(positions, top_k), "float", "max_tokens", "advice")
    assert e.value.status == HTTPStatus.BAD_REQUEST
    assert "top-64 SAE features per position" in str(e.value)
    check_response(limits, size(positions - 1, top_k), "float", "max_tokens", "advice")


def test_the_store_keeps_heads_outputs_flat_under_canonical_addresses():
    """The activation store's rows are ``[positions, width]``: attn_z's
    ``[positions, heads, head_dim]`` goes in as ``[positions, heads *
    head_dim]``, head h at columns h * head_dim on."""
    from vllm_hidden_states.store.choice_writer import _canonical

    z = torch.arange(24.0).reshape(2, 3, 4)
    stored = _canonical({-1: torch.ones(2, 8), "blocks.1.attn.hook_z": z}, num_layers=4)
    assert list(stored) == [-1, "attn_z.1"]
    assert stored["attn_z.1"].shape == (2, 12)
    assert torch.equal(stored["attn_z.1"][:, 4:8], z[:, 1])


def test_queries_keys_values_come_as_one_object_each_with_their_heads():
    """q rows (query heads) and k / v rows (KV heads) are not stacked
    together: a queries, a keys and a values object, each [points, heads,
    head_dim] for "last"."""
    from vllm_hidden_states.server.openai_response import ChoiceRows

    points = ("q.0", "blocks.1.attn.hook_rot_k", "v.1", "attn_z.0")
    ask = HiddenStatesAsk((), "float", "last", neurons=points)
    rows = ChoiceRows()
    rows.pending = [
        {
            "q.0": torch.ones(2, 4, 2),
            "blocks.1.attn.hook_rot_k": torch.zeros(2, 1, 2),
            "v.1": torch.full((2, 1, 2), 3.0),
            "attn_z.0": torch.ones(2, 4, 2),
        }
    ]
    _, objects = rows.take(ask)
    assert list(objects) == ["head_outputs", "queries", "keys", "values"]
    assert objects["queries"]["points"] == ["q.0"] and objects["queries"]["shape"] == [1, 4, 2]
    assert objects["keys"]["points"] == ["blocks.1.attn.hook_rot_k"]
    assert objects["keys"]["shape"] == objects["values"]["shape"] == [1, 1, 2]
