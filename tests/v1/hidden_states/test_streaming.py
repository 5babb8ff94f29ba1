# SPDX-License-Identifier: Apache-2.0
"""Every position over HTTP: "all" on chat/completions, streamed per token,
and the binary answer of POST /v1/hidden_states.

One real ``vllm serve`` process on loopback (tiny Qwen3, float32, eager,
every layer capturable, a 1 MB response cap). Every returned vector is
compared with HF transformers on the token ids the server reports
(``return_token_ids``); streamed rows are also compared bit for bit with the
non-streamed answer of the same greedy request.
"""

import base64

import httpx
import numpy as np
import openai
import orjson
import pytest
import torch

from vllm_hidden_states.client import from_bytes, read_binary_header, to_numpy

from .conftest import ENGINE_MODE, assert_close
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
CAP_MB = 1.0
PROMPT = "Once upon a time there was a small robot who loved to count"
C = "/v1/completions"
CH = "/v1/chat/completions"
H = "/v1/hidden_states"


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory) -> ServerProcess:
    logs = tmp_path_factory.mktemp("streaming-logs")
    process = test_server_process(
        qwen3_dir,
        [
            "--enable-hidden-states",
            "--max-model-len",
            "512",
            "--hidden-states-max-response-mb",
            str(CAP_MB),
            # /load (in-flight HTTP requests) and the gate, for the disconnect test
            # (the gate is a Model Runner V1 logits processor; the V2 modes run
            # only the four-mode tests here, which do not use it)
            "--enable-server-load-tracking",
            *(GATE_ARGS if ENGINE_MODE.startswith("v1") else []),
        ],
        logs / "server.log",
        name=MODEL,
    )
    process.start()
    try:
        yield process.wait_ready(timeout=600)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def layers(hf_qwen3) -> list[int]:
    """Embeddings, a middle layer, the one before last, the final post-norm."""
    return [0, hf_qwen3.num_layers // 2, -2, -1]


def body(**kwargs) -> dict:
    out = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.0,
        return_token_ids=True,
        return_hidden_states=True,
        hidden_states_positions="all",
    )
    out.update(kwargs)
    return out


def chat_body(**kwargs) -> dict:
    out = body(**kwargs)
    out.pop("prompt")
    out["messages"] = [{"role": "user", "content": PROMPT}]
    return out


def rows_of(obj: dict) -> np.ndarray:
    """A hidden_states object decoded independently of client.py:
    ``[len(layers), positions, hidden]`` float32."""
    assert obj["dtype"] == "float32"
    if obj["encoding_format"] == "base64":
        array = np.frombuffer(base64.b64decode(obj["data"]), "<f4").reshape(obj["shape"])
    else:
        array = np.asarray(obj["data"], dtype=np.float32)
    assert list(array.shape) == obj["shape"]
    return array


def assert_rows_match_hf(hf, rows: np.ndarray, token_ids: list[int], layers: list[int]):
    """``rows[i]`` = HF's states at ``layers[i]`` for every position of ``token_ids``."""
    assert rows.shape == (len(layers), len(token_ids), hf.hidden_size)
    ref = hf.states(token_ids)
    for i, layer in enumerate(layers):
        assert_close(torch.from_numpy(rows[i].copy()), ref[layer], f"layer {layer}")


def stream(http, path: str, payload: dict) -> list[dict]:
    with http.stream("POST", path, json=payload) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def streamed_rows(events: list[dict], index: int = 0) -> tuple[list[dict], list[int]]:
    """The hidden_states objects of one choice in event order, and its token ids."""
    objects, tokens = [], []
    for event in events:
        for choice in event.get("choices") or ():
            if choice["index"] != index:
                continue
            tokens += choice.get("token_ids") or []
            if choice.get("hidden_states") is not None:
                objects.append(choice["hidden_states"])
    return objects, tokens


def joined(objects: list[dict]) -> np.ndarray:
    starts = [o["start"] for o in objects]
    sizes = [o["shape"][1] for o in objects]
    # Chunks are contiguous: each starts where the previous one ended.
    assert starts == [sum(sizes[:i]) for i in range(len(sizes))]
    return np.concatenate([rows_of(o) for o in objects], axis=1)


# --------------------------------------------------------------------------
# "all", not streamed


@pytest.mark.four_modes
def test_completion_all_positions_match_hf_at_every_position(http, hf_qwen3, layers):
    r = http.post(C, json=body(hidden_states_layers=layers))
    (choice,) = r.json()["choices"]
    obj = choice["hidden_states"]
    assert (obj["positions"], obj["start"], obj["layers"]) == ("all", 0, layers)
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert_rows_match_hf(hf_qwen3, rows_of(obj), ids, layers)


def test_chat_all_positions_in_base64_match_hf(http, hf_qwen3, layers):
    r = http.post(CH, json=chat_body(hidden_states_layers=layers, hidden_states_format="base64"))
    (choice,) = r.json()["choices"]
    ids = r.json()["prompt_token_ids"] + choice["token_ids"]
    assert_rows_match_hf(hf_qwen3, rows_of(choice["hidden_states"]), ids, layers)


def test_prompt_positions_on_a_completion_are_the_prompts_rows(http, hf_qwen3):
    r = http.post(C, json=body(hidden_states_positions="prompt", hidden_states_layers=[-2]))
    (choice,) = r.json()["choices"]
    ids = choice["prompt_token_ids"]
    assert_rows_match_hf(hf_qwen3, rows_of(choice["hidden_states"]), ids, [-2])


# --------------------------------------------------------------------------
# streamed per token


def test_streamed_rows_concatenate_to_the_non_streamed_result_bit_for_bit(http, layers):
    common = dict(hidden_states_layers=layers, hidden_states_format="base64", max_tokens=8)
    whole = http.post(C, json=body(**common)).json()["choices"][0]["hidden_states"]
    events = stream(http, C, body(stream=True, hidden_states_stream=True, **common))
    objects, _ = streamed_rows(events)
    # Every chunk with tokens carries its rows; how many chunks there are is
    # vLLM's (outputs the client has not read yet are merged), not asserted.
    chunks = [c for e in events for c in e["choices"] if c.get("token_ids")]
    assert len(objects) == len(chunks)
    assert np.array_equal(joined(objects), rows_of(whole))


def test_each_streamed_chunk_completes_the_rows_before_its_newest_token(http):
    """After each chunk the client holds the row of every position before the
    chunk's last token; the finish chunk adds the final token's row. So past
    the first chunk (the prompt's rows), a chunk has one row per token."""
    events = stream(
        http, C, body(stream=True, hidden_states_stream=True, max_tokens=7, ignore_eos=True)
    )
    prompt_len = len(events[0]["choices"][0]["prompt_token_ids"])
    held = 0  # rows received so far
    seen = 0  # tokens received so far
    chunks = [c for e in events for c in e["choices"] if c.get("token_ids")]
    for i, choice in enumerate(chunks):
        new_tokens = len(choice["token_ids"])
        seen += new_tokens
        obj = choice["hidden_states"]
        assert obj["start"] == held
        held += obj["shape"][1]
        last_position = prompt_len + seen - 1
        if choice["finish_reason"] is None:
            assert held == last_position
            if i > 0:
                assert obj["shape"][1] == new_tokens
        else:
            assert i == len(chunks) - 1
            assert held == last_position + 1
    assert seen == 7


def test_chat_streamed_rows_match_hf_and_skip_the_role_chunk(http, hf_qwen3, layers):
    events = stream(
        http, CH, chat_body(stream=True, hidden_states_stream=True, hidden_states_layers=layers)
    )
    role_chunk = events[0]["choices"][0]
    assert role_chunk["delta"].get("role") == "assistant"
    assert "hidden_states" not in role_chunk
    objects, tokens = streamed_rows(events)
    ids = events[0]["prompt_token_ids"] + tokens
    assert_rows_match_hf(hf_qwen3, joined(objects), ids, layers)


def test_each_of_n_streamed_choices_gets_the_rows_of_its_own_sequence(http, hf_qwen3):
    events = stream(
        http,
        C,
        body(
            stream=True,
            hidden_states_stream=True,
            n=2,
            temperature=1.0,
            seed=7,
            hidden_states_layers=[-1],
        ),
    )
    prompt_ids = next(
        e["choices"][0]["prompt_token_ids"]
        for e in events
        if e["choices"] and e["choices"][0].get("prompt_token_ids")
    )
    for index in (0, 1):
        objects, tokens = streamed_rows(events, index)
        assert_rows_match_hf(hf_qwen3, joined(objects), prompt_ids + tokens, [-1])


def test_stream_without_hidden_states_stream_carries_every_row_on_the_finish_chunk(http, hf_qwen3):
    events = stream(http, C, body(stream=True, hidden_states_layers=[0, -1]))
    carrying = [c for e in events for c in e["choices"] if c.get("hidden_states")]
    assert len(carrying) == 1 and carrying[0]["finish_reason"] is not None
    _, tokens = streamed_rows(events)
    ids = events[0]["choices"][0]["prompt_token_ids"] + tokens
    assert_rows_match_hf(hf_qwen3, rows_of(carrying[0]["hidden_states"]), ids, [0, -1])


def test_streamed_last_keeps_one_row_per_layer_on_the_finish_chunk(http, hf_qwen3):
    events = stream(
        http, C, body(stream=True, hidden_states_positions="last", hidden_states_layers=[-1])
    )
    carrying = [c for e in events for c in e["choices"] if c.get("hidden_states")]
    assert len(carrying) == 1 and carrying[0]["finish_reason"] is not None
    obj = carrying[0]["hidden_states"]
    assert obj["positions"] == "last" and obj["shape"] == [1, hf_qwen3.hidden_size]


@pytest.mark.four_modes
def test_openai_client_streams_rows_via_extra_body(server, hf_qwen3):
    oai = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0.0,
            stream=True,
            extra_body={
                "return_hidden_states": True,
                "hidden_states_positions": "all",
                "hidden_states_stream": True,
                "return_token_ids": True,
            },
        )
    )
    parts = [
        to_numpy(c.choices[0].model_extra["hidden_states"])
        for c in chunks
        if c.choices and c.choices[0].model_extra.get("hidden_states")
    ]
    tokens = [
        t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])
    ]
    prompt_ids = chunks[0].choices[0].model_extra["prompt_token_ids"]
    rows = np.concatenate(parts, axis=1)
    assert_rows_match_hf(hf_qwen3, rows, prompt_ids + tokens, [-1])


# --------------------------------------------------------------------------
# refusals, before any work


def assert_error(response: httpx.Response, status: int, param: str, *needles: str):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param
    for needle in needles:
        assert needle in error["message"], error["message"]


def prompt_tokens_total(server) -> float:
    return server.metric("vllm:prompt_tokens_total")


def test_hidden_states_stream_without_stream_true_is_a_400(http):
    r = http.post(C, json=body(hidden_states_stream=True))
    assert_error(r, 400, "hidden_states_stream", "stream: true")


def test_hidden_states_stream_with_last_positions_is_a_400(http):
    r = http.post(
        C, json=body(stream=True, hidden_states_stream=True, hidden_states_positions="last")
    )
    assert_error(r, 400, "hidden_states_stream", "'all'")


@pytest.mark.parametrize("streamed", [False, True])
def test_all_positions_over_the_response_cap_are_refused_before_generation(
    server, http, hf_qwen3, streamed
):
    """Priced at prompt tokens + max_tokens per choice, right after
    tokenization: a 400 naming the cap, even when streaming, and nothing
    reaches the engine."""
    layers = list(range(hf_qwen3.num_layers + 1))
    per_position = len(layers) * hf_qwen3.hidden_size * 16  # float JSON bound
    max_tokens = int(CAP_MB * 2**20 / per_position) + 1  # over the cap alone
    before = prompt_tokens_total(server)
    payload = body(
        max_tokens=max_tokens,
        hidden_states_layers=layers,
        stream=streamed,
        hidden_states_stream=streamed,
    )
    r = http.post(C, json=payload)
    assert_error(r, 400, "max_tokens", "--hidden-states-max-response-mb", "max_tokens")
    assert prompt_tokens_total(server) == before
    # Base64 is 3x smaller: the same request fits then.
    fits = dict(
        payload,
        max_tokens=max_tokens // 4,
        hidden_states_format="base64",
        stream=False,
        hidden_states_stream=False,
    )
    assert http.post(C, json=fits).status_code == 200


# --------------------------------------------------------------------------
# disconnect


def test_client_disconnecting_mid_stream_of_rows_leaves_nothing_held(server, http, tmp_path):
    """The client leaves while rows are streaming, by construction: the request
    is held after its first chunk of rows (a :class:`Gate`), the client
    disconnects, and the engine goes on only once the server closed the stream."""
    generated_before = num_generated(server)
    with Gate(tmp_path / "hold") as gate:
        payload = body(
            stream=True,
            hidden_states_stream=True,
            max_tokens=400,
            ignore_eos=True,
            hidden_states_format="base64",
            vllm_xargs=gate.xargs,
        )
        with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
            with client.stream("POST", C, json=payload) as r:
                first = next(line for line in r.iter_lines() if "hidden_states" in line)
                assert orjson.loads(first[6:])["choices"][0]["hidden_states"]["shape"][1] > 0
        wait_until(lambda: server.load() == 0, "the server to close the stream")
    # Aborted, not run to its end: once the engine holds nothing, far fewer
    # than its 400 tokens were generated (a request left running would have
    # generated them all before the engine emptied).
    wait_until(lambda: server.num_unfinished() == 0, "the engine to hold no request")
    assert num_generated(server) - generated_before < 400
    assert http.post(C, json=body(max_tokens=2)).status_code == 200
    wait_until(lambda: server.num_unfinished() == 0, "the engine to hold no request")


# --------------------------------------------------------------------------
# binary POST /v1/hidden_states


def hs_body(**kwargs) -> dict:
    out = dict(model=MODEL, input=PROMPT, layer=-2)
    out.update(kwargs)
    return out


def test_binary_answer_equals_the_float_answer(http, hf_qwen3):
    floats = np.asarray(http.post(H, json=hs_body()).json()["hidden_states"], np.float32)
    r = http.post(H, json=hs_body(encoding_format="bytes"))
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["x-hidden-states-shape"] == f"{floats.shape[0]},{hf_qwen3.hidden_size}"
    assert r.headers["x-hidden-states-dtype"] == "float32"
    header, arrays = read_binary_header(r.content)
    assert header["data"] == [
        {
            "index": 0,
            "embed_dtype": "float32",
            "endianness": "little",
            "start": 0,
            "end": floats.nbytes,
            "shape": list(floats.shape),
        }
    ]
    assert np.array_equal(np.frombuffer(arrays, "<f4").reshape(floats.shape), floats)
    assert np.array_equal(to_numpy(r), floats)


def test_accept_octet_stream_selects_the_binary_answer(http):
    floats = np.asarray(http.post(H, json=hs_body()).json()["hidden_states"], np.float32)
    r = http.post(H, json=hs_body(), headers={"Accept": "application/octet-stream"})
    assert r.headers["content-type"] == "application/octet-stream"
    assert np.array_equal(to_numpy(r), floats)


def test_binary_batch_locates_each_input_in_the_body_header(http):
    inputs = [PROMPT, "A second, shorter input", "Third"]
    listed = http.post(H, json=hs_body(input=inputs)).json()["data"]
    r = http.post(H, json=hs_body(input=inputs, encoding_format="bytes"))
    arrays = from_bytes(r.content)
    assert "metadata" not in r.headers
    assert len(arrays) == len(inputs)
    for array, obj in zip(arrays, listed):
        assert np.array_equal(array, np.asarray(obj["hidden_states"], np.float32))


@pytest.mark.parametrize("embed_dtype", ["bfloat16", "float16"])
def test_binary_half_precision_is_the_float_answer_rounded(http, embed_dtype):
    floats = torch.tensor(http.post(H, json=hs_body()).json()["hidden_states"])
    r = http.post(H, json=hs_body(encoding_format="bytes", embed_dtype=embed_dtype))
    assert len(read_binary_header(r.content)[1]) == floats.numel() * 2
    expected = floats.to(getattr(torch, embed_dtype)).float().numpy()
    assert np.array_equal(to_numpy(r), expected)


def test_binary_big_endian_decodes_to_the_same_values(http):
    little = to_numpy(http.post(H, json=hs_body(encoding_format="bytes")))
    big = http.post(H, json=hs_body(encoding_format="bytes", endianness="big"))
    assert read_binary_header(big.content)[1] != little.tobytes()
    assert np.array_equal(to_numpy(big), little)


def test_accept_that_allows_neither_json_nor_binary_is_a_406(http):
    r = http.post(H, json=hs_body(), headers={"Accept": "text/html"})
    assert_error(r, 406, "Accept", "application/json")


def test_bytes_format_with_accept_json_only_is_a_406(http):
    r = http.post(H, json=hs_body(encoding_format="bytes"), headers={"Accept": "application/json"})
    assert_error(r, 406, "Accept", "application/octet-stream")


def test_embed_dtype_without_the_bytes_format_is_a_400(http):
    r = http.post(H, json=hs_body(embed_dtype="bfloat16"))
    assert_error(r, 400, None, "embed_dtype", "'bytes'")


def test_binary_answer_over_the_response_cap_is_a_400(http, hf_qwen3):
    # 4 bytes per value; inputs of max_length positions, enough to pass the cap.
    max_length = 400
    inputs = int(CAP_MB * 2**20 / (4 * hf_qwen3.hidden_size * max_length)) + 1
    r = http.post(
        H,
        json=hs_body(
            input=["word " * (2 * max_length)] * inputs,
            max_length=max_length,
            encoding_format="bytes",
        ),
    )
    assert_error(r, 400, "max_length", "--hidden-states-max-response-mb")
