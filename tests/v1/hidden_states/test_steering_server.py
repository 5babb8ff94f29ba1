# SPDX-License-Identifier: Apache-2.0
"""Steering on the OpenAI server: the ``steering`` field on /v1/completions
and /v1/chat/completions (streamed or not, with and without
``return_hidden_states``), on POST /v1/hidden_states, GET
/v1/steering_vectors, and the 400s for what cannot be steered.

One real ``vllm serve`` on loopback: tiny Qwen3 with ``--enable-steering
--steering-points all --steering-vectors DIR`` (DIR holds ``push.safetensors``,
one random vector of the model's hidden_size) and a 1 MB body cap
(``--request-max-body-mb``, which bounds inline vectors). Steered states are
compared with HF transformers with a forward pre-hook adding the same vector
in place at the decoder layer's input, max|diff| / max|ref| < 1e-3.

The "not enabled" answers are checked on the call-outs themselves, with a
stand-in engine client whose config has no steering (no second server).
"""

import asyncio
import contextvars
import json
import math

import httpx
import openai
import orjson
import pytest
import torch

from .conftest import HFReference, assert_close
from .server_utils import ServerProcess, running_server
from .test_server import decode_rows

MODEL = "tiny-qwen3"
PROMPT = "Once upon a time there was a small robot who loved to count"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
VECTOR_NAME = "push"
STRENGTH = 3.0
POINT = "resid_pre.1"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def hidden_size(qwen3_dir) -> int:
    return int(json.loads((qwen3_dir / "config.json").read_text())["hidden_size"])


@pytest.fixture(scope="module")
def vector(hidden_size) -> torch.Tensor:
    """The named vector's values (float32), seeded."""
    return torch.randn(hidden_size, generator=torch.Generator().manual_seed(1234))


@pytest.fixture(scope="module")
def vectors_dir(tmp_path_factory, vector):
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("steering-vectors")
    save_file({"direction": vector.contiguous()}, str(directory / f"{VECTOR_NAME}.safetensors"))
    return directory


@pytest.fixture(scope="module")
def server(qwen3_dir, vectors_dir, tmp_path_factory):
    with running_server(
        qwen3_dir,
        [
            "--enable-steering",
            "--steering-points",
            "all",
            "--steering-vectors",
            str(vectors_dir),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--request-max-body-mb",
            "1",
        ],
        tmp_path_factory.mktemp("steering-server") / "server.log",
        name=MODEL,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=300.0) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: ServerProcess):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=300.0)


def add(vector: torch.Tensor | None = None, **fields) -> dict:
    """One ``add`` intervention at :data:`POINT`: inline ``vector`` or, when
    None, the named vector."""
    item = {"point": POINT, "op": "add", "strength": STRENGTH, "positions": "all"}
    if vector is None:
        item["name"] = VECTOR_NAME
    else:
        item["vector"] = vector.tolist()
    item.update(fields)
    return item


def completion(**fields) -> dict:
    out = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, return_token_ids=True)
    out.update(fields)
    return out


def completion_ids(http, **fields) -> tuple[list[int], list[int], dict]:
    """A non-streamed completion's prompt ids, output ids and choice."""
    r = http.post("/v1/completions", json=completion(**fields))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return choice["prompt_token_ids"], choice["token_ids"], choice


@torch.inference_mode()
def hf_steered_states(
    hf: HFReference, ids: list[int], layer: int, vector: torch.Tensor, strength: float
) -> tuple[torch.Tensor, ...]:
    """HF's ``L + 1`` states of ``ids`` with ``strength * vector`` added in
    place to the input of decoder layer ``layer`` (``resid_pre.layer``) at
    every position, by a forward pre-hook: HF records that input tensor, so
    its state ``layer`` is the steered one too."""

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden[0].add_(strength * vector.to(hidden.dtype))

    handle = hf.model.model.layers[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        return hf.states(ids)
    finally:
        handle.remove()


def assert_steering_error(response: httpx.Response, *needles: str, status: int = 400) -> dict:
    """An OpenAI error body with ``param: "steering"`` naming ``needles``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == "steering", error
    assert error["code"] == status
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


# --------------------------------------------------------------------------
# Steering on /v1/completions and /v1/chat/completions


def test_steering_changes_the_completion_and_its_states_equal_hf_steered(http, hf_qwen3, vector):
    prompt_ids, plain, _ = completion_ids(http)
    _, steered, choice = completion_ids(http, steering=[add(vector)])
    assert "hidden_states" not in choice  # steering alone asks for no states
    assert steered != plain
    # The same request asking for states too: the same tokens, and the
    # states of the steered forward at every position.
    layers = [1, 2, -1]
    _, again, choice = completion_ids(
        http,
        steering=[add(vector)],
        return_hidden_states=True,
        hidden_states_layers=layers,
        hidden_states_positions="all",
    )
    assert again == steered
    ids = prompt_ids + steered
    rows = decode_rows(choice["hidden_states"])
    assert rows.shape == (len(layers), len(ids), hf_qwen3.hidden_size)
    reference = hf_steered_states(hf_qwen3, ids, 1, vector, STRENGTH)
    unsteered = hf_qwen3.states(ids)
    for row, layer in zip(rows, layers):
        assert_close(row, reference[layer], f"layer {layer}")
        assert not torch.allclose(row, unsteered[layer], atol=1e-3), layer


def test_a_named_vector_steers_as_the_same_vector_inline(http, vector):
    _, named, _ = completion_ids(http, steering=[add()])
    _, inline, _ = completion_ids(http, steering=[add(vector)])
    _, plain, _ = completion_ids(http)
    assert named == inline
    assert named != plain


def test_streamed_chat_with_steering_gives_the_non_streamed_tokens(oai, vector):
    common = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0)
    extra = {"steering": [add(vector)], "return_token_ids": True}
    plain = oai.chat.completions.create(**common, extra_body={"return_token_ids": True})
    full = oai.chat.completions.create(**common, extra_body=extra)
    assert full.choices[0].token_ids != plain.choices[0].token_ids  # steering applies here
    streamed: list[int] = []
    for chunk in oai.chat.completions.create(**common, stream=True, extra_body=extra):
        for c in chunk.choices:
            streamed.extend(getattr(c, "token_ids", None) or [])
    assert streamed == full.choices[0].token_ids


# --------------------------------------------------------------------------
# Bad steering: a 400 naming what is allowed, param "steering"


def test_an_unknown_point_is_refused_naming_the_steerable_points(http, vector):
    r = http.post("/v1/completions", json=completion(steering=[add(vector, point="bogus.1")]))
    assert_steering_error(r, "steering[0].point")


def test_a_point_kind_that_cannot_be_steered_is_refused(http, vector):
    r = http.post(
        "/v1/completions", json=completion(steering=[add(vector, point="attn_pattern.1")])
    )
    assert_steering_error(r, "cannot be steered", "resid_pre")


def test_a_vector_of_the_wrong_length_is_refused_naming_hidden_size(http, hidden_size):
    r = http.post("/v1/completions", json=completion(steering=[add(torch.ones(3))]))
    assert_steering_error(r, "steering[0].vector", f"{hidden_size} numbers")


def test_a_nan_in_the_vector_is_refused(http, vector):
    # JSON has no NaN, but Python's json (so vLLM's request parsing) reads
    # the token: send it as raw bytes.
    values = [12345.5, *vector.tolist()[1:]]
    body = orjson.dumps(completion(steering=[{"point": POINT, "vector": values}]))
    content = body.replace(b"12345.5", b"NaN", 1)
    assert b"NaN" in content
    r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_steering_error(r, "finite")


def test_a_value_past_float32_is_refused_as_not_finite(http, vector):
    values = vector.tolist()
    values[0] = 1e39  # finite JSON, infinite in float32
    assert math.isfinite(values[0])
    r = http.post(
        "/v1/completions",
        json=completion(steering=[{"point": POINT, "vector": values}]),
    )
    assert_steering_error(r, "finite")


def test_an_unknown_vector_name_is_refused_naming_the_known_ones(http):
    r = http.post("/v1/completions", json=completion(steering=[add(name="nope")]))
    assert_steering_error(r, "unknown steering vector 'nope'", VECTOR_NAME)


def test_too_many_interventions_are_refused_naming_the_limit(http):
    r = http.post("/v1/completions", json=completion(steering=[add()] * 5))
    assert_steering_error(r, "at most 4", "--max-steering")


def test_resid_post_beside_steering_at_the_next_resid_pre_is_a_400(http):
    """resid_post.0 would come after the intervention at resid_pre.1 (POINT)."""
    r = http.post(
        "/v1/completions",
        json=completion(
            steering=[add()], return_hidden_states=True, hidden_states_points=["resid_post.0"]
        ),
    )
    assert_steering_error(r, "Steer at resid_post.0 instead", "resid_mid.0 and mlp_out.0")


def test_steering_that_is_not_a_list_is_refused_with_an_example(http):
    r = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=MESSAGES, steering={}))
    assert_steering_error(r, "non-empty list of interventions")


def test_a_window_past_the_request_is_refused_by_the_engine_front_end(http):
    # Not checked before tokenization (the prompt's length is unknown then):
    # the engine front-end's VLLMValidationError is vLLM's 400.
    window = {"start": MAX_MODEL_LEN - 2, "end": None}
    r = http.post("/v1/completions", json=completion(steering=[add(positions=window)]))
    assert_steering_error(r, "steering[0].positions", "past the last position")


def test_a_window_past_a_streamed_request_is_a_400_not_a_stream(http):
    window = {"start": 2, "end": MAX_MODEL_LEN}
    body = dict(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, steering=[add(positions=window)]
    )
    r = http.post("/v1/chat/completions", json=body)
    assert_steering_error(r, "steering[0].positions", "window ends at")


def test_a_window_inside_the_request_is_accepted(http):
    r = http.post(
        "/v1/completions", json=completion(steering=[add(positions={"start": 1, "end": 4})])
    )
    assert r.status_code == 200, r.text


def test_an_inline_vector_past_the_body_cap_is_refused_unread(http):
    # Inline vectors are bounded by the request body cap (--request-max-body-mb
    # 1 here), before anything parses the body.
    huge = [0.123456789] * 200_000  # about 2.4 MB of JSON
    r = http.post("/v1/completions", json=completion(steering=[{"point": POINT, "vector": huge}]))
    assert r.status_code == 413, r.text
    assert "--request-max-body-mb" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


def test_steering_with_beam_search_is_refused(http):
    r = http.post("/v1/completions", json=completion(steering=[add()], use_beam_search=True, n=2))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "use_beam_search"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
        (
            "/v1/chat/completions/batch",
            {"model": MODEL, "messages": [MESSAGES], "max_tokens": 2},
        ),
        ("/v1/messages", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
    ],
    ids=["responses", "batch", "messages"],
)
def test_routes_that_cannot_steer_refuse_steering(http, path, body):
    r = http.post(path, json={**body, "steering": [add()]})
    if path == "/v1/messages":
        # Anthropic's error body: {"type": "error", "error": {"type", "message"}}.
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "'steering' is not supported on this route" in message and path in message
    else:
        assert_steering_error(r, "not supported on this route", path)


# --------------------------------------------------------------------------
# GET /v1/steering_vectors


def test_steering_vectors_lists_the_named_vector_and_the_writable_points(http, hf_qwen3):
    r = http.get("/v1/steering_vectors")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert body["data"] == [
        {"object": "steering_vector", "name": VECTOR_NAME, "length": hf_qwen3.hidden_size}
    ]
    # Per layer: the steerable points, then the heads' outputs (patch and
    # ablate_heads only).
    kinds = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "attn_z")
    expected = [f"{k}.{i}" for i in range(hf_qwen3.num_layers) for k in kinds]
    assert body["points"] == expected
    assert body["max_interventions"] == 4
    assert body["max_patch_rows"] == 2048 and body["matrices"] == []


# --------------------------------------------------------------------------
# POST /v1/hidden_states


def test_hidden_states_route_returns_the_states_of_the_steered_forward(
    http, hf_qwen3, vector, qwen3_dir
):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(qwen3_dir).encode(PROMPT)
    r = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": PROMPT, "layer": 2, "steering": [add()]},
    )
    assert r.status_code == 200, r.text
    states = torch.tensor(r.json()["hidden_states"], dtype=torch.float32)
    reference = hf_steered_states(hf_qwen3, ids, 1, vector, STRENGTH)[2]
    assert_close(states, reference, "steered layer 2")
    assert not torch.allclose(states, hf_qwen3.states(ids)[2], atol=1e-3)


def test_hidden_states_route_refuses_bad_steering(http):
    r = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": PROMPT, "steering": [add(name="nope")]},
    )
    assert_steering_error(r, "unknown steering vector")


def test_hidden_states_route_window_past_the_input_is_a_400(http):
    window = {"start": 0, "end": MAX_MODEL_LEN}
    r = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": PROMPT, "steering": [add(positions=window)]},
    )
    assert_steering_error(r, "steering[0].positions")


# --------------------------------------------------------------------------
# An engine without --enable-steering (the call-outs, no server)


class _EngineClient:
    """Stands in for vLLM's engine client: an engine without steering."""

    def __init__(self):
        class ModelConfig:
            def get_hidden_size(self):
                return 8

        class VllmConfig:
            additional_config: dict = {}

        self.model_config = ModelConfig()
        self.vllm_config = VllmConfig()


class _Request:
    def __init__(self, extra: dict):
        self.model_extra = extra
        self.use_beam_search = False
        self.stream = False


def test_steering_on_an_engine_without_it_is_a_400_naming_the_flag():
    from vllm_hidden_states.server import openai_request

    serving = type("Serving", (), {"engine_client": _EngineClient()})()
    request = _Request({"steering": [{"point": POINT, "vector": [0.0] * 8}]})
    # admit sets context variables: run it in a context of its own.
    refusal = contextvars.copy_context().run(
        asyncio.run, openai_request.admit(serving, request, None)
    )
    error = refusal.error
    assert error.code == 400 and error.param == "steering"
    assert "--enable-steering" in error.message


def test_steering_vectors_on_an_engine_without_steering_is_a_404_naming_the_flag():
    from vllm_hidden_states.server.steering_vectors_route import list_steering_vectors

    state = type("State", (), {"engine_client": _EngineClient()})()
    raw_request = type("Raw", (), {"app": type("App", (), {"state": state})()})()
    response = asyncio.run(list_steering_vectors(raw_request))
    assert response.status_code == 404
    error = orjson.loads(response.body)["error"]
    assert error["code"] == 404 and "--enable-steering" in error["message"]
