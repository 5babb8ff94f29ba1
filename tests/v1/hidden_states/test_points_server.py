# SPDX-License-Identifier: Apache-2.0
"""Capture points on the OpenAI server: ``hidden_states_points`` on
/v1/completions and /v1/chat/completions (streamed or not, JSON or base64),
``point`` on POST /v1/hidden_states, and the 400s for bad addresses.

One real ``vllm serve`` on loopback: tiny Gemma 2 (post-attention and
post-feed-forward norms, sliding window, soft-capping) with
``--hidden-states-points attn_out,mlp_out,resid_mid.1 --hidden-states-layers
-1``. Every returned vector is compared with HF transformers' forward hooks
on the token ids the server reports, max|diff| / max|ref| < 1e-3.
"""

import httpx
import openai
import pytest
import torch

from vllm_hidden_states.client import from_bytes, read_binary_header
from vllm_hidden_states.tools.tiny_models import build_tiny_model

from .conftest import MODELS, HFReference, assert_close
from .server_utils import ServerProcess, running_server, sse_events
from .test_patterns import hf_patterns
from .test_server import assert_error, decode_rows

MODEL = "tiny-gemma2"
POINTS_FLAG = "attn_out,mlp_out,resid_mid.1,attn_pattern.1,mlp_post.0,attn_z.1,q.1,k.1,v.1"
PROMPT = "Once upon a time there was a small robot who loved to count"


@pytest.fixture(scope="module")
def gemma2_dir():
    return build_tiny_model(MODELS / "tiny-gemma2", arch="gemma2")


@pytest.fixture(scope="module")
def hf(gemma2_dir) -> HFReference:
    reference = HFReference(gemma2_dir)
    # The textbook attention: SDPA drops Gemma 2's logit soft-capping.
    reference.model.set_attn_implementation("eager")
    return reference


@pytest.fixture(scope="module")
def server(gemma2_dir, tmp_path_factory):
    with running_server(
        gemma2_dir,
        [
            "--enable-hidden-states",
            "--hidden-states-layers",
            "-1",
            "--hidden-states-points",
            POINTS_FLAG,
            "--max-model-len",
            "512",
        ],
        tmp_path_factory.mktemp("points-server") / "server.log",
        name=MODEL,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        yield client


def body(**kwargs) -> dict:
    out = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.0,
        return_token_ids=True,
        return_hidden_states=True,
    )
    out.update(kwargs)
    return out


def assert_rows_match_hf(hf: HFReference, obj: dict, ids: list[int], keys: list, last: bool):
    """``obj``'s rows are HF's, key by key (layers first, then points)."""
    rows = decode_rows(obj)
    reference = hf.points(ids)
    layers = hf.states(ids)
    assert rows.shape[0] == len(keys)
    for row, key in zip(rows, keys):
        expected = layers[key] if isinstance(key, int) else reference[key]
        if last:
            row, expected = row[None], expected[-1:]
        assert_close(row, expected, f"{key}")


def streamed(http, field: str, **fields) -> tuple[list[int], int, list[dict]]:
    """A streamed completion: its token ids (prompt + output), prompt length,
    and every chunk's ``field`` object with the ``finish_reason`` of its chunk
    (``"_finish"``), in order."""
    with http.stream("POST", "/v1/completions", json=body(stream=True, **fields)) as response:
        assert response.status_code == 200
        events = sse_events(response)
    ids: list[int] = []
    prompt_len = 0
    objects = []
    for event in events:
        for c in event["choices"]:
            prompt_len += len(c.get("prompt_token_ids") or [])
            ids += (c.get("prompt_token_ids") or []) + c["token_ids"]
            if c.get(field):
                objects.append({**c[field], "_finish": c["finish_reason"]})
    return ids, prompt_len, objects


def test_completion_returns_the_points_asked_after_the_layers(http, hf):
    points = ["attn_out.0", "blocks.1.hook_resid_mid", "mlp_out.-1"]
    r = http.post(
        "/v1/completions", json=body(hidden_states_layers=[-1], hidden_states_points=points)
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    obj = choice["hidden_states"]
    assert obj["layers"] == [-1] and obj["points"] == points
    assert obj["shape"] == [4, hf.hidden_size]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    keys = [hf.num_layers, "attn_out.0", "resid_mid.1", f"mlp_out.{hf.num_layers - 1}"]
    assert_rows_match_hf(hf, obj, ids, keys, last=True)


def test_points_alone_bring_no_default_layer(http, hf):
    r = http.post("/v1/completions", json=body(hidden_states_points=["attn_out.1"]))
    assert r.status_code == 200, r.text
    obj = r.json()["choices"][0]["hidden_states"]
    assert obj["layers"] == [] and obj["points"] == ["attn_out.1"]
    assert obj["shape"] == [1, hf.hidden_size]


def test_chat_openai_client_every_position_of_points_in_base64(server, hf):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
    points = ["mlp_out.0", "attn_out.1"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0.0,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_points": points,
            "hidden_states_positions": "all",
            "hidden_states_format": "base64",
            "return_token_ids": True,
        },
    )
    choice = r.choices[0]
    ids = r.prompt_token_ids + choice.token_ids
    obj = choice.hidden_states
    assert obj["points"] == points and obj["start"] == 0
    assert obj["shape"] == [2, len(ids), hf.hidden_size]
    assert_rows_match_hf(hf, obj, ids, points, last=False)


def test_streamed_rows_of_points_concatenate_to_every_position(http, hf):
    points = ["resid_mid.1", "attn_out.0"]
    ids, _, chunks = streamed(
        http,
        "hidden_states",
        hidden_states_stream=True,
        hidden_states_positions="all",
        hidden_states_points=points,
        max_tokens=6,
    )
    assert all(c["points"] == points for c in chunks)
    rows = torch.cat([decode_rows(c) for c in chunks], dim=1)
    assert rows.shape == (2, len(ids), hf.hidden_size)
    reference = hf.points(ids)
    for row, key in zip(rows, points):
        assert_close(row, reference[key], key)


def test_hidden_states_route_answers_a_point_and_names_it(http, hf):
    r = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": PROMPT, "point": "blocks.0.hook_mlp_out"},
    )
    assert r.status_code == 200, r.text
    obj = r.json()
    assert obj["point"] == "blocks.0.hook_mlp_out" and "layer" not in obj
    ids = hf_ids(http, PROMPT)
    assert obj["shape"] == [len(ids), hf.hidden_size]
    rows = decode_rows({**obj, "data": obj["hidden_states"], "encoding_format": "float"})
    assert_close(rows, hf.points(ids)["mlp_out.0"], "mlp_out.0")


def test_hidden_states_route_binary_header_names_the_point(http, hf):
    r = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": [PROMPT], "point": "attn_out.1", "encoding_format": "bytes"},
    )
    assert r.status_code == 200, r.text
    header, _ = read_binary_header(r.content)
    assert header["point"] == "attn_out.1"
    (array,) = from_bytes(r.content)
    ids = hf_ids(http, PROMPT)
    assert_close(torch.from_numpy(array.copy()), hf.points(ids)["attn_out.1"], "attn_out.1")


def hf_ids(http, text: str) -> list[int]:
    """The token ids the server encodes ``text`` to (as /v1/hidden_states does)."""
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# -- bad addresses -----------------------------------------------------------


@pytest.mark.parametrize(
    "points, needles",
    [
        (["attn_out"], ["'<kind>.<i>' or 'blocks.<i>.hook_<kind>'", "resid_mid"]),
        (["blocks.1.hook_attn"], ["unknown kind 'attn'", "attn_out"]),
        (["attn_out.99"], ["layer 99 is out of range"]),
        (
            ["resid_mid.0"],
            ["not capturable", "attn_out (every layer), mlp_out (every layer), resid_mid.1"],
        ),
        (["attn_out.0", "blocks.0.hook_attn_out"], ["attn_out.0 twice"]),
        ("attn_out.0", ["non-empty list of point addresses"]),
    ],
)
def test_bad_points_are_a_400_naming_what_is_allowed(http, points, needles):
    r = http.post("/v1/completions", json=body(hidden_states_points=points))
    error = assert_error(r, 400, "invalid_request_error", *needles)
    assert error["param"] == "hidden_states_points"


def test_an_out_of_range_point_names_the_models_decoder_layers(http, hf):
    n = hf.num_layers
    r = http.post("/v1/completions", json=body(hidden_states_points=[f"attn_out.{n}"]))
    assert_error(r, 400, "invalid_request_error", f"a decoder layer in {-n}..{n - 1}")


def test_points_without_return_hidden_states_is_a_400(http):
    r = http.post(
        "/v1/completions",
        json=body(return_hidden_states=None, hidden_states_points=["attn_out.0"]),
    )
    assert_error(r, 400, "invalid_request_error", "return_hidden_states")


def test_hidden_states_route_refuses_layer_and_point_together(http):
    r = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": "Hi", "layer": -1, "point": "attn_out.0"},
    )
    assert_error(r, 400, "invalid_request_error", "not both")


def test_hidden_states_route_refuses_a_point_not_capturable(http):
    r = http.post("/v1/hidden_states", json={"model": MODEL, "input": "Hi", "point": "resid_mid.0"})
    error = assert_error(r, 400, "invalid_request_error", "not capturable")
    assert error["param"] == "point"


# -- "generated" and windows -------------------------------------------------


def test_streamed_generated_rows_of_a_point_start_after_the_prompt(http, hf):
    ids, prompt_len, chunks = streamed(
        http,
        "hidden_states",
        hidden_states_stream=True,
        hidden_states_positions="generated",
        hidden_states_points=["mlp_out.1"],
        max_tokens=5,
        ignore_eos=True,
    )
    assert all(c["positions"] == "generated" for c in chunks)
    assert chunks[0]["start"] == prompt_len
    rows = torch.cat([decode_rows(c) for c in chunks], dim=1)
    assert rows.shape == (1, len(ids) - prompt_len, hf.hidden_size)
    assert_close(rows[0], hf.points(ids)["mlp_out.1"][prompt_len:], "generated mlp_out.1")


def test_a_window_of_layers_and_points_names_itself_and_its_start(http, hf):
    window = {"start": 3, "end": 9}
    r = http.post(
        "/v1/completions",
        json=body(
            hidden_states_layers=[-1],
            hidden_states_points=["attn_out.0"],
            hidden_states_positions=window,
        ),
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    obj = choice["hidden_states"]
    assert obj["positions"] == window and obj["start"] == 3
    assert obj["shape"] == [2, 6, hf.hidden_size]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    rows = decode_rows(obj)
    assert_close(rows[0], hf.states(ids)[hf.num_layers][3:9], "layer -1")
    assert_close(rows[1], hf.points(ids)["attn_out.0"][3:9], "attn_out.0")


def test_a_window_past_what_max_tokens_allows_is_a_400(http):
    r = http.post(
        "/v1/completions",
        json=body(hidden_states_positions={"start": 400}, hidden_states_layers=[-1]),
    )
    error = assert_error(r, 400, "invalid_request_error", "past the last position")
    assert error["param"] == "hidden_states_positions"


# -- attention patterns ------------------------------------------------------


def test_completion_attention_pattern_of_every_position_matches_hf_eager(http, hf):
    r = http.post(
        "/v1/completions",
        json=body(
            hidden_states_points=["attn_out.0", "attn_pattern.1"],
            hidden_states_positions="all",
            hidden_states_format="base64",
        ),
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    states, patterns = choice["hidden_states"], choice["attention_patterns"]
    assert states["points"] == ["attn_out.0"]
    assert patterns["points"] == ["attn_pattern.1"] and patterns["start"] == 0
    assert patterns["shape"] == [1, hf.model.config.num_attention_heads, len(ids), len(ids)]
    got = decode_rows(patterns)[0]
    assert_close(got, hf_patterns(hf, ids)[1], "attn_pattern.1")
    assert_close(decode_rows(states)[0], hf.points(ids)["attn_out.0"], "attn_out.0")


def test_streamed_attention_pattern_of_the_last_token_is_on_the_finish_chunk(http, hf):
    ids, _, found = streamed(
        http, "attention_patterns", hidden_states_points=["blocks.1.attn.hook_pattern"]
    )
    assert all(p["_finish"] is not None for p in found)
    (patterns,) = found
    assert patterns["start"] == len(ids) - 1
    assert_close(decode_rows(patterns)[0], hf_patterns(hf, ids)[1][:, -1:], "last row")


def test_attention_patterns_refuse_per_token_streaming(http):
    r = http.post(
        "/v1/completions",
        json=body(
            stream=True,
            hidden_states_stream=True,
            hidden_states_positions="all",
            hidden_states_points=["attn_pattern.1"],
        ),
    )
    error = assert_error(r, 400, "invalid_request_error", "finish chunk")
    assert error["param"] == "hidden_states_stream"


def test_hidden_states_route_sends_patterns_to_the_completion_routes(http):
    r = http.post(
        "/v1/hidden_states", json={"model": MODEL, "input": "Hi", "point": "attn_pattern.1"}
    )
    assert_error(r, 400, "invalid_request_error", "hidden_states_points")


def test_a_heads_selector_limits_the_patterns_to_those_heads(http, hf):
    r = http.post(
        "/v1/completions",
        json=body(hidden_states_points=["attn_pattern.1"], hidden_states_heads=[1]),
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    patterns = choice["attention_patterns"]
    assert patterns["heads"] == [1] and patterns["shape"] == [1, 1, 1, len(ids)]
    assert_close(decode_rows(patterns)[0], hf_patterns(hf, ids)[1][1:2, -1:], "head 1")


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"hidden_states_heads": [0]}, "ask for one in hidden_states_points"),
        ({"hidden_states_heads": [0, 0], "hidden_states_points": ["attn_pattern.1"]}, "distinct"),
        ({"hidden_states_heads": [9], "hidden_states_points": ["attn_pattern.1"]}, "query heads"),
    ],
)
def test_bad_heads_selectors_are_400s(http, extra, needle):
    r = http.post("/v1/completions", json=body(**extra))
    error = assert_error(r, 400, "invalid_request_error", needle)
    assert error["param"] == "hidden_states_heads"


# -- MLP neurons ---------------------------------------------------------------


def test_mlp_neurons_come_as_their_own_object_exact_against_hf(http, hf):
    r = http.post(
        "/v1/completions",
        json=body(
            hidden_states_layers=[-1],
            hidden_states_points=["blocks.0.hook_mlp_post"],
            hidden_states_positions="all",
        ),
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    neurons = choice["neurons"]
    width = hf.model.config.intermediate_size
    assert neurons["points"] == ["blocks.0.hook_mlp_post"]
    assert neurons["shape"] == [1, len(ids), width]
    assert choice["hidden_states"]["shape"] == [1, len(ids), hf.hidden_size]
    assert_close(decode_rows(neurons)[0], hf.points(ids)["mlp_post.0"], "mlp_post.0")


def test_streamed_mlp_neurons_concatenate_to_every_position(http, hf):
    ids, _, chunks = streamed(
        http,
        "neurons",
        hidden_states_stream=True,
        hidden_states_positions="all",
        hidden_states_points=["mlp_post.0"],
    )
    rows = torch.cat([decode_rows(c) for c in chunks], dim=1)
    assert_close(rows[0], hf.points(ids)["mlp_post.0"], "streamed mlp_post.0")


def test_heads_outputs_come_as_their_own_object_beside_the_neurons(http, hf):
    """attn_z (Gemma 2: heads * head_dim, not hidden_size) and mlp_post in
    one request: a head_outputs object ``[points, positions, heads,
    head_dim]`` beside neurons, exact against the input of HF's o_proj;
    base64 round-trips."""
    r = http.post(
        "/v1/completions",
        json=body(
            hidden_states_layers=[-1],
            hidden_states_points=["blocks.1.attn.hook_z", "mlp_post.0"],
            hidden_states_positions="all",
            hidden_states_format="base64",
        ),
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    config = hf.model.config
    heads = choice["head_outputs"]
    assert heads["points"] == ["blocks.1.attn.hook_z"]
    assert heads["shape"] == [1, len(ids), config.num_attention_heads, config.head_dim]
    assert choice["neurons"]["shape"] == [1, len(ids), config.intermediate_size]
    reference = hf.points(ids)
    assert_close(decode_rows(heads)[0], reference["attn_z.1"], "attn_z.1")
    assert_close(decode_rows(choice["neurons"])[0], reference["mlp_post.0"], "mlp_post.0")


def test_queries_keys_values_come_as_one_object_each_per_head(http, hf):
    """q, k, v (Gemma 2: GQA, QK scale applied in the kernel) in one
    request: queries ``[points, positions, heads, head_dim]``, keys and
    values with the KV heads, exact against what HF hands its attention."""
    r = http.post(
        "/v1/completions",
        json=body(
            hidden_states_points=["blocks.1.attn.hook_rot_q", "k.1", "blocks.1.attn.hook_v"],
            hidden_states_positions="all",
            hidden_states_format="base64",
        ),
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    config = hf.model.config
    reference = hf.points(ids)
    for name, kind, heads in (
        ("queries", "q", config.num_attention_heads),
        ("keys", "k", config.num_key_value_heads),
        ("values", "v", config.num_key_value_heads),
    ):
        obj = choice[name]
        assert obj["shape"] == [1, len(ids), heads, config.head_dim], name
        assert_close(decode_rows(obj)[0], reference[f"{kind}.1"], f"{kind}.1")


def test_hidden_states_route_answers_mlp_neurons_of_every_prompt_position(http, hf):
    r = http.post(
        "/v1/hidden_states", json={"model": MODEL, "input": PROMPT, "point": "mlp_post.0"}
    )
    assert r.status_code == 200, r.text
    obj = r.json()
    ids = hf_ids(http, PROMPT)
    assert obj["point"] == "mlp_post.0"
    assert obj["shape"] == [len(ids), hf.model.config.intermediate_size]
    rows = decode_rows({**obj, "data": obj["hidden_states"], "encoding_format": "float"})
    assert_close(rows, hf.points(ids)["mlp_post.0"], "mlp_post.0")


def test_hidden_states_route_answers_heads_outputs_of_every_prompt_position(http, hf):
    r = http.post("/v1/hidden_states", json={"model": MODEL, "input": PROMPT, "point": "attn_z.1"})
    assert r.status_code == 200, r.text
    obj = r.json()
    ids = hf_ids(http, PROMPT)
    config = hf.model.config
    assert obj["shape"] == [len(ids), config.num_attention_heads, config.head_dim]
    rows = decode_rows({**obj, "data": obj["hidden_states"], "encoding_format": "float"})
    assert_close(rows, hf.points(ids)["attn_z.1"], "attn_z.1")
