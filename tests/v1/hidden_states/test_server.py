# SPDX-License-Identifier: Apache-2.0
"""The OpenAI server: hidden states on chat/completions and POST /v1/hidden_states.

Two real ``vllm serve`` processes on loopback, started once for the module and
in parallel:

* ``server``: tiny Qwen3 (no BOS), ``--enable-hidden-states
  --hidden-states-layers 0,2,3,-1`` (layer 1 deliberately not capturable),
  max_model_len 1024, a 0.25 MB response cap;
* ``plain_server``: tiny Llama without ``--enable-hidden-states``, for the
  "how to enable" errors.

Every returned vector is compared with HF transformers on the token ids the
server reports (``return_token_ids``), max|diff| / max|ref| < 1e-3.
"""

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from vllm_hidden_states.client import to_numpy, to_torch

from .conftest import assert_close
from .server_utils import (
    GATE_ARGS,
    Gate,
    ServerProcess,
    num_generated,
    sse_events,
    test_server_process,
    wait_until,
)

MODEL = "tiny-qwen3"
CAPTURABLE = "0,2,3,-1"
CAP_MB = "0.25"
MAX_MODEL_LEN = 1024
PROMPT = "Once upon a time there was a small robot who loved to count"
ZIMAGE_PROMPT = (
    "<|im_start|>user\nA beautiful sunset over the ocean<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n</think>\n"
)
LONG_TEXT = "The engine schedules requests, runs the model and samples tokens. " * 80


@pytest.fixture(scope="module")
def servers(qwen3_dir, llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    main = test_server_process(
        qwen3_dir,
        [
            "--enable-hidden-states",
            "--hidden-states-layers",
            CAPTURABLE,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            # /load (in-flight HTTP requests) and the gate, for the disconnect test
            "--enable-server-load-tracking",
            *GATE_ARGS,
        ],
        logs / "main.log",
        env={"VLLM_HIDDEN_STATES_MAX_RESPONSE_MB": CAP_MB},
        name=MODEL,
    )
    plain = test_server_process(
        llama_dir, ["--max-model-len", "256"], logs / "plain.log", name="tiny-llama"
    )
    main.start()
    plain.start()
    try:
        yield main, plain
    finally:
        main.stop()
        plain.stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers[0].wait_ready(timeout=600)


@pytest.fixture(scope="module")
def plain_server(servers) -> ServerProcess:
    return servers[1].wait_ready(timeout=600)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused")


def decode_rows(obj: dict) -> torch.Tensor:
    """A choice's hidden_states object, checked and decoded independently of client.py."""
    assert obj["dtype"] == "float32"
    if obj["encoding_format"] == "base64":
        raw = base64.b64decode(obj["data"])
        array = np.frombuffer(raw, "<f4").reshape(obj["shape"])
    else:
        assert obj["encoding_format"] == "float"
        array = np.asarray(obj["data"], dtype=np.float32)
        assert list(array.shape) == obj["shape"]
    return torch.from_numpy(array.copy())


def assert_choice_matches_hf(hf, obj: dict, token_ids: list[int], layers: list[int]):
    """Rows of ``obj`` = HF's last-token states at ``layers``, in that order."""
    assert obj["layers"] == layers
    assert obj["shape"] == [len(layers), hf.hidden_size]
    rows = decode_rows(obj)
    ref = hf.states(token_ids)
    for row, layer in zip(rows, layers):
        assert_close(row[None], ref[layer][-1:], f"layer {layer}")


def completion_body(**kwargs) -> dict:
    body = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.0,
        return_token_ids=True,
        return_hidden_states=True,
    )
    body.update(kwargs)
    return body


def assert_error(response: httpx.Response, status: int, type_: str, *needles: str):
    """An OpenAI-shaped error body with this status and type, naming ``needles``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == type_
    assert error["code"] == status
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def assert_still_serving(http):
    ok = http.post("/v1/hidden_states", json={"model": MODEL, "input": "Hello"})
    assert ok.status_code == 200, ok.text


# --------------------------------------------------------------------------
# /v1/completions


def test_completion_returns_last_token_states_for_layers_in_request_order(http, hf_qwen3):
    layers = [-1, 2, 0]
    r = http.post("/v1/completions", json=completion_body(hidden_states_layers=layers))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["hidden_states"]["encoding_format"] == "float"
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert_choice_matches_hf(hf_qwen3, choice["hidden_states"], ids, layers)


def test_completion_default_layer_is_final_post_norm_state(http, hf_qwen3):
    r = http.post("/v1/completions", json=completion_body())
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert choice["hidden_states"]["layers"] == [-1]
    assert_close(
        decode_rows(choice["hidden_states"]), hf_qwen3.states(ids)[hf_qwen3.num_layers][-1:]
    )


def test_completion_base64_is_float32_le_bytes_of_the_rows(http, hf_qwen3):
    layers = [3, -1]
    body = completion_body(hidden_states_layers=layers, hidden_states_format="base64")
    (choice,) = http.post("/v1/completions", json=body).json()["choices"]
    obj = choice["hidden_states"]
    assert obj["encoding_format"] == "base64" and isinstance(obj["data"], str)
    assert len(base64.b64decode(obj["data"])) == 4 * len(layers) * hf_qwen3.hidden_size
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert_choice_matches_hf(hf_qwen3, obj, ids, layers)


def test_completion_n2_gives_each_choice_the_states_of_its_own_tokens(http, hf_qwen3):
    body = completion_body(n=2, temperature=1.0, seed=7, max_tokens=8, hidden_states_layers=[2, -1])
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["token_ids"] != choices[1]["token_ids"]
    for c in choices:
        ids = c["prompt_token_ids"] + c["token_ids"]
        assert_choice_matches_hf(hf_qwen3, c["hidden_states"], ids, [2, -1])


def test_completion_with_echo_and_logprobs_keeps_last_token_states(http, hf_qwen3):
    body = completion_body(echo=True, logprobs=2, hidden_states_layers=[0, -1])
    (choice,) = http.post("/v1/completions", json=body).json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    # echo: the logprobs cover the prompt's tokens too
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert_choice_matches_hf(hf_qwen3, choice["hidden_states"], ids, [0, -1])


def test_completion_two_prompts_n2_map_states_to_the_right_choices(http, hf_qwen3):
    prompts = [PROMPT, "Hello world! How are you today?"]
    body = completion_body(prompt=prompts, n=2, temperature=1.0, seed=3, hidden_states_layers=[-2])
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        ids = c["prompt_token_ids"] + c["token_ids"]
        assert_choice_matches_hf(hf_qwen3, c["hidden_states"], ids, [-2])


def test_completion_stream_puts_states_once_on_each_finish_chunk(http, hf_qwen3):
    prompts = [PROMPT, "What is the capital of France?"]
    body = completion_body(
        prompt=prompts,
        n=2,
        temperature=1.0,
        seed=5,
        stream=True,
        hidden_states_layers=[-1, 2],
    )
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    ids: dict[int, list[int]] = {}
    states: dict[int, dict] = {}
    for event in events:
        for c in event["choices"]:
            i = c["index"]
            ids.setdefault(i, []).extend((c.get("prompt_token_ids") or []) + c["token_ids"])
            if "hidden_states" in c:
                assert c["finish_reason"] is not None
                assert i not in states, "hidden_states sent twice"
                states[i] = c["hidden_states"]
            else:
                assert c["finish_reason"] is None
    assert sorted(states) == [0, 1, 2, 3]
    for i, obj in states.items():
        assert_choice_matches_hf(hf_qwen3, obj, ids[i], [-1, 2])


def test_completion_without_the_fields_has_no_hidden_states_key(http):
    body = completion_body()
    del body["return_hidden_states"]
    (choice,) = http.post("/v1/completions", json=body).json()["choices"]
    assert "hidden_states" not in choice


# --------------------------------------------------------------------------
# /v1/chat/completions, through the official openai client


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_openai_client_extra_body_returns_float_states(oai, hf_qwen3):
    layers = [-2, -1, 0]
    r = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0.0,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_layers": layers,
            "return_token_ids": True,
        },
    )
    choice = r.choices[0]
    ids = r.prompt_token_ids + choice.token_ids
    assert_choice_matches_hf(hf_qwen3, choice.hidden_states, ids, layers)


def test_chat_openai_client_n2_with_logprobs(oai, hf_qwen3):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=2,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_layers": [3],
            "return_token_ids": True,
        },
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.logprobs.content
        ids = r.prompt_token_ids + choice.token_ids
        assert_choice_matches_hf(hf_qwen3, choice.hidden_states, ids, [3])


def test_chat_openai_client_stream_base64_once_per_choice(oai, hf_qwen3):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=7,
        n=2,
        temperature=1.0,
        seed=2,
        stream=True,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_layers": [-1, 0],
            "hidden_states_format": "base64",
            "return_token_ids": True,
        },
    )
    prompt_ids: list[int] = []
    ids: dict[int, list[int]] = {0: [], 1: []}
    states: dict[int, dict] = {}
    for chunk in stream:
        prompt_ids = getattr(chunk, "prompt_token_ids", None) or prompt_ids
        for c in chunk.choices:
            ids[c.index].extend(getattr(c, "token_ids", None) or [])
            obj = getattr(c, "hidden_states", None)
            if obj is not None:
                assert c.finish_reason is not None and c.index not in states
                states[c.index] = obj
    assert sorted(states) == [0, 1]
    for i, obj in states.items():
        assert obj["encoding_format"] == "base64"
        assert_choice_matches_hf(hf_qwen3, obj, prompt_ids + ids[i], [-1, 0])


def test_chat_stream_non_finish_chunks_carry_no_states(http):
    body = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.0,
        stream=True,
        return_hidden_states=True,
        stream_options={"include_usage": True},
    )
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    carrying = [c for e in events for c in e["choices"] if "hidden_states" in c]
    assert len(carrying) == 1 and carrying[0]["finish_reason"] is not None
    assert events[-1]["choices"] == [] and "usage" in events[-1]


# --------------------------------------------------------------------------
# client.py


def test_client_decodes_both_encodings_of_both_endpoints(http, oai, hf_qwen3):
    body = completion_body(hidden_states_layers=[0, -1])
    f = http.post("/v1/completions", json=body).json()["choices"][0]
    b = http.post("/v1/completions", json={**body, "hidden_states_format": "base64"}).json()[
        "choices"
    ][0]
    np.testing.assert_array_equal(to_numpy(f), to_numpy(b))
    assert to_numpy(f["hidden_states"]).shape == (2, hf_qwen3.hidden_size)
    hf_f = http.post("/v1/hidden_states", json={"model": MODEL, "input": PROMPT}).json()
    hf_b = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": PROMPT, "encoding_format": "base64"},
    ).json()
    t = to_torch(hf_b)
    assert t.dtype == torch.float32 and list(t.shape) == hf_f["shape"]
    np.testing.assert_array_equal(to_numpy(hf_f), t.numpy())
    batch = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": [PROMPT, "Hi"], "encoding_format": "base64"},
    ).json()
    assert [a.shape[0] for a in to_numpy(batch)] == [d["shape"][0] for d in batch["data"]]
    r = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        extra_body={"return_hidden_states": True, "hidden_states_format": "base64"},
    )
    assert to_numpy(r.choices[0]).shape == (1, hf_qwen3.hidden_size)


# --------------------------------------------------------------------------
# POST /v1/hidden_states


def hf_tokenize(qwen3_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)(text)["input_ids"]


def test_hidden_states_default_is_layer_minus_2_every_position_float(http, hf_qwen3, qwen3_dir):
    r = http.post("/v1/hidden_states", json={"model": MODEL, "input": ZIMAGE_PROMPT})
    assert r.status_code == 200, r.text
    data = r.json()
    ids = hf_tokenize(qwen3_dir, ZIMAGE_PROMPT)
    assert data["shape"] == [len(ids), hf_qwen3.hidden_size]
    assert data["model"] == MODEL and data["layer"] == -2 and data["dtype"] == "float32"
    assert "encoding_format" not in data and "attention_mask" not in data
    states = torch.tensor(data["hidden_states"], dtype=torch.float32)
    assert_close(states, hf_qwen3.states(ids)[-2], "layer -2")


def test_hidden_states_base64_matches_hf(http, hf_qwen3, qwen3_dir):
    body = {"model": MODEL, "input": PROMPT, "layer": 0, "encoding_format": "base64"}
    data = http.post("/v1/hidden_states", json=body).json()
    assert data["encoding_format"] == "base64" and data["layer"] == 0
    states = np.frombuffer(base64.b64decode(data["hidden_states"]), "<f4")
    ids = hf_tokenize(qwen3_dir, PROMPT)
    assert_close(
        torch.from_numpy(states.reshape(data["shape"]).copy()),
        hf_qwen3.states(ids)[0],
        "layer 0",
    )


def test_hidden_states_attention_mask_is_all_ones_per_position(http):
    body = {"model": MODEL, "input": PROMPT, "return_attention_mask": True}
    data = http.post("/v1/hidden_states", json=body).json()
    assert data["attention_mask"] == [1] * data["shape"][0]


def test_hidden_states_max_length_keeps_the_first_tokens(http, hf_qwen3, qwen3_dir):
    body = {"model": MODEL, "input": PROMPT, "max_length": 5, "layer": 2}
    data = http.post("/v1/hidden_states", json=body).json()
    ids = hf_tokenize(qwen3_dir, PROMPT)[:5]
    assert data["shape"] == [5, hf_qwen3.hidden_size]
    assert_close(torch.tensor(data["hidden_states"]), hf_qwen3.states(ids)[2])


def test_hidden_states_batch_returns_one_object_per_input_in_order(http, hf_qwen3, qwen3_dir):
    texts = [ZIMAGE_PROMPT, "Hi", PROMPT]
    body = {"model": MODEL, "input": texts, "layer": -1, "return_attention_mask": True}
    data = http.post("/v1/hidden_states", json=body).json()
    assert data["object"] == "list" and data["model"] == MODEL
    assert len(data["data"]) == len(texts)
    for text, item in zip(texts, data["data"]):
        ids = hf_tokenize(qwen3_dir, text)
        assert item["shape"] == [len(ids), hf_qwen3.hidden_size]
        assert item["attention_mask"] == [1] * len(ids)
        assert_close(torch.tensor(item["hidden_states"]), hf_qwen3.states(ids)[-1], text)


def test_hidden_states_messages_apply_the_chat_template(http, hf_qwen3, qwen3_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "A beautiful sunset over the ocean"}]
    data = http.post("/v1/hidden_states", json={"model": MODEL, "messages": messages}).json()
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert data["shape"] == [len(ids), hf_qwen3.hidden_size]
    assert_close(torch.tensor(data["hidden_states"]), hf_qwen3.states(ids)[-2])


def test_hidden_states_repeat_request_loses_no_position_to_prefix_cache(http, hf_qwen3, qwen3_dir):
    text = LONG_TEXT[:1200]  # a few hundred tokens: many full KV blocks
    ids = hf_tokenize(qwen3_dir, text)
    ref = hf_qwen3.states(ids)[3]
    body = {"model": MODEL, "input": text, "layer": 3, "encoding_format": "base64"}
    for attempt in range(2):
        data = http.post("/v1/hidden_states", json=body).json()
        assert data["shape"] == [len(ids), hf_qwen3.hidden_size], attempt
        assert_close(to_torch(data), ref, f"attempt {attempt}")


# --------------------------------------------------------------------------
# Errors: OpenAI shape, right status, and the server keeps serving.


@pytest.mark.parametrize(
    "body, needle, param",
    [
        ({"model": MODEL}, "exactly one of 'input'", None),
        ({"input": "x"}, "missing required field 'model'", "model"),
        ({"model": MODEL, "input": 3}, "invalid 'input'", "input"),
        ({"model": MODEL, "input": []}, "empty list", None),
        ({"model": MODEL, "input": "x", "layer": "2"}, "invalid 'layer'", "layer"),
        ({"model": MODEL, "input": "x", "layers": [2]}, "unknown field 'layers'", "layers"),
    ],
)
def test_hidden_states_missing_or_invalid_field_is_400(http, body, needle, param):
    error = assert_error(
        http.post("/v1/hidden_states", json=body), 400, "invalid_request_error", needle
    )
    assert error["param"] == param
    assert_still_serving(http)


def test_hidden_states_body_that_is_not_json_is_400(http):
    r = http.post(
        "/v1/hidden_states", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_request_error", "not valid JSON")
    assert_still_serving(http)


def test_hidden_states_unknown_model_is_404_model_not_found(http):
    r = http.post("/v1/hidden_states", json={"model": "gpt-5", "input": "x"})
    assert_error(r, 404, "model_not_found", "gpt-5", MODEL)
    assert_still_serving(http)


def test_hidden_states_layer_out_of_range_is_400(http, hf_qwen3):
    n = hf_qwen3.num_layers
    r = http.post("/v1/hidden_states", json={"model": MODEL, "input": "x", "layer": n + 1})
    assert_error(r, 400, "invalid_request_error", "out of range", f"{-(n + 1)}..{n}")
    assert_still_serving(http)


def test_hidden_states_layer_not_capturable_is_400(http):
    r = http.post("/v1/hidden_states", json={"model": MODEL, "input": "x", "layer": 1})
    assert_error(r, 400, "invalid_request_error", "not capturable", "0, 2, 3, -1")
    assert_still_serving(http)


def test_hidden_states_max_length_below_1_is_400(http):
    body = {"model": MODEL, "input": "x", "max_length": 0}
    r = http.post("/v1/hidden_states", json=body)
    assert_error(r, 400, "invalid_request_error", "max_length", ">= 1")
    assert_still_serving(http)


def test_hidden_states_unknown_encoding_format_is_400(http):
    body = {"model": MODEL, "input": "x", "encoding_format": "bf16"}
    r = http.post("/v1/hidden_states", json=body)
    assert_error(r, 400, "invalid_request_error", "'float', 'base64' or 'bytes'")
    assert_still_serving(http)


def test_hidden_states_response_over_the_size_cap_is_400_with_its_size(http):
    body = {"model": MODEL, "input": LONG_TEXT, "max_length": 900}
    r = http.post("/v1/hidden_states", json=body)
    assert_error(
        r,
        400,
        "invalid_request_error",
        "would be about",
        "MB",
        "VLLM_HIDDEN_STATES_MAX_RESPONSE_MB",
    )
    assert_still_serving(http)


def test_hidden_states_input_longer_than_the_model_takes_is_422(http):
    body = {"model": MODEL, "input": LONG_TEXT * 2, "max_length": 4096}
    r = http.post("/v1/hidden_states", json=body)
    assert_error(r, 422, "model_error", f"max_model_len={MAX_MODEL_LEN}")
    assert_still_serving(http)


def test_completion_layer_out_of_range_is_400_even_when_streaming(http):
    for stream in (False, True):
        body = completion_body(hidden_states_layers=[-1, 40], stream=stream)
        r = http.post("/v1/completions", json=body)
        assert_error(r, 400, "invalid_request_error", "layer 40 is out of range")
    assert_still_serving(http)


def test_chat_layer_not_capturable_is_400(http):
    body = dict(
        model=MODEL,
        messages=MESSAGES,
        return_hidden_states=True,
        hidden_states_layers=[1],
    )
    r = http.post("/v1/chat/completions", json=body)
    assert_error(r, 400, "invalid_request_error", "not capturable")
    assert_still_serving(http)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"hidden_states_format": "hex"}, "hidden_states_format"),
        ({"hidden_states_layers": "-1"}, "list of integers"),
        ({"hidden_states_layers": []}, "non-empty list"),
        ({"return_hidden_states": "yes"}, "true or false"),
    ],
)
def test_chat_invalid_hidden_state_field_is_400(http, fields, needle):
    body = {"model": MODEL, "messages": MESSAGES, "return_hidden_states": True, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert_error(r, 400, "invalid_request_error", needle)


def test_chat_layers_without_return_hidden_states_is_400(http):
    body = dict(model=MODEL, messages=MESSAGES, hidden_states_layers=[-1])
    r = http.post("/v1/chat/completions", json=body)
    assert_error(r, 400, "invalid_request_error", "return_hidden_states")


def test_openai_client_raises_bad_request_for_invalid_layer(oai):
    with pytest.raises(openai.BadRequestError, match="out of range"):
        oai.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=1,
            extra_body={"return_hidden_states": True, "hidden_states_layers": [9]},
        )


def test_server_without_the_flag_says_how_to_enable(plain_server):
    with httpx.Client(base_url=plain_server.base_url, timeout=60.0) as client:
        for path, body in [
            ("/v1/hidden_states", {"model": "tiny-llama", "input": "Hello"}),
            (
                "/v1/chat/completions",
                {
                    "model": "tiny-llama",
                    "messages": MESSAGES,
                    "max_tokens": 2,
                    "return_hidden_states": True,
                },
            ),
            (
                "/v1/completions",
                {
                    "model": "tiny-llama",
                    "prompt": "Hi",
                    "max_tokens": 2,
                    "stream": True,
                    "return_hidden_states": True,
                },
            ),
        ]:
            r = client.post(path, json=body)
            assert_error(r, 400, "invalid_request_error", "--enable-hidden-states")
        ok = client.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2}
        )
        assert ok.status_code == 200 and "hidden_states" not in ok.json()["choices"][0]


# --------------------------------------------------------------------------
# Disconnects


def test_client_disconnecting_mid_stream_leaves_nothing_held(server, http, hf_qwen3, tmp_path):
    """The client leaves while its request is still generating, by construction:
    both children are held after their first token (a :class:`Gate`), the client
    disconnects, and the engine goes on only once the server has closed the
    stream. The request must then be aborted, not run to its end, and nothing
    may stay held."""
    generated_before = num_generated(server)
    with Gate(tmp_path / "hold") as gate:
        body = completion_body(
            max_tokens=900,
            ignore_eos=True,
            stream=True,
            n=2,
            temperature=1.0,
            vllm_xargs=gate.xargs,
        )
        with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert next(line for line in r.iter_lines() if line.startswith("data: {"))
            # leaving both blocks closes the connection while the engine is held
        wait_until(lambda: server.load() == 0, "the server to close the stream")
    r = http.post("/v1/completions", json=completion_body(hidden_states_layers=[2]))
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert_choice_matches_hf(hf_qwen3, choice["hidden_states"], ids, [2])
    # Both disconnected children were aborted mid-generation, not run to their
    # end: once the engine holds nothing, far fewer than their 2 x 900 tokens
    # were generated (children left running would have generated them all).
    wait_until(lambda: server.num_unfinished() == 0, "the engine to hold no request")
    assert num_generated(server) - generated_before < 900
