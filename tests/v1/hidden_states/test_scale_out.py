# SPDX-License-Identifier: Apache-2.0
"""Scale-out through vLLM's own parallelism, over real ``vllm serve`` servers:

* data parallel 2 (internal load balancing, mp backend, which also starts two
  API-server processes): concurrent mixed requests spread over both engines,
  every state exact, nothing held afterwards on either engine;
* one engine behind ``--api-server-count 2``: exact over HTTP.

Both servers start together (one module fixture) and are shared by the tests.
"""

import httpx
import openai
import pytest
import torch

from .conftest import HFReference, assert_close
from .server_utils import (
    GATE_ARGS,
    EngineGauges,
    Gate,
    post_concurrently,
    test_server_process,
    wait_until,
)
from .test_server import decode_rows, hf_tokenize

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3"
LAYERS = [0, 1, -2, -1]


@pytest.fixture(scope="module")
def scale_servers(qwen3_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("scale-out-logs")
    common = [
        "--enable-hidden-states",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "64",
        # /load and the gate, for the abort test
        "--enable-server-load-tracking",
        *GATE_ARGS,
    ]
    dp2 = test_server_process(
        qwen3_dir, [*common, "--data-parallel-size", "2"], logs / "dp2.log", name=MODEL
    )
    api2 = test_server_process(
        qwen3_dir, [*common, "--api-server-count", "2"], logs / "api2.log", name=MODEL
    )
    dp2.start()
    api2.start()
    try:
        yield dp2, api2
    finally:
        dp2.stop()
        api2.stop()


@pytest.fixture(scope="module")
def dp2(scale_servers):
    return scale_servers[0].wait_ready(timeout=900)


@pytest.fixture(scope="module")
def api2(scale_servers):
    return scale_servers[1].wait_ready(timeout=900)


def body(prompt: str, **kwargs) -> dict:
    out = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0.0,
        return_token_ids=True,
        return_hidden_states=True,
        hidden_states_layers=LAYERS,
    )
    out.update(kwargs)
    return out


def check_choice(hf: HFReference, choice: dict, positions: str, layers=LAYERS):
    """A choice's rows = HF's at ``layers``, over the positions asked for."""
    obj = choice["hidden_states"]
    assert obj["layers"] == layers
    rows = decode_rows(obj)
    prompt = choice.get("prompt_token_ids")
    ids = list(prompt or []) + list(choice["token_ids"])
    ref = hf.states(ids)
    for i, layer in enumerate(layers):
        got = rows[i] if rows.dim() == 3 else rows[i][None]
        if positions == "last":
            want = ref[layer][-1:]
        elif positions == "all":
            want = ref[layer]
        else:  # prompt
            want = ref[layer][: len(prompt)]
        assert_close(got, want, f"{positions} layer {layer}")


def served_by_engine(server) -> dict[str, float]:
    """Requests each engine ran to their end (stop or length)."""
    return {
        e: sum(
            server.metric("vllm:request_success_total", engine=e, finished_reason=r)
            for r in ("stop", "length")
        )
        for e in ("0", "1")
    }


def generated_by_engine(server) -> dict[str, float]:
    """Tokens each engine generated."""
    return {e: server.metric("vllm:generation_tokens_total", engine=e) for e in ("0", "1")}


def assert_nothing_held(server) -> EngineGauges:
    """Waits until neither engine has a request running or waiting or a KV
    block in use, then checks that no extract missed the engine that parked
    its request's KV blocks (they would stay parked until a step there frees
    them and logs it; the gauges' refresh gives such steps) and none was sent
    without a recorded engine. Returns the gauges, which count the completions
    the refresh sent."""
    gauges = EngineGauges(server, ranks=(0, 1))
    gauges.wait_until_nothing_held()
    log = server.log_path.read_text(errors="replace")
    assert "whose extract did not come within" not in log
    assert "no engine recorded" not in log
    return gauges


PROMPTS = [f"Story {i}: once upon a time there was a robot who" for i in range(8)]


def test_data_parallel_2_mixed_concurrent_requests_are_exact_on_both_engines(dp2, hf_qwen3):
    before = served_by_engine(dp2)
    # "last", "all", "prompt", n=2 (sampled) and streaming, all at once.
    jobs = [("last", body(p)) for p in PROMPTS[:4]]
    jobs += [
        ("all", body(PROMPTS[4], hidden_states_positions="all")),
        ("all", body(PROMPTS[5], hidden_states_positions="all", max_tokens=3)),
        ("prompt", body(PROMPTS[6], hidden_states_positions="prompt")),
        ("last", body(PROMPTS[7], n=2, temperature=1.0, seed=7)),
    ]

    results = post_concurrently(dp2.base_url, "/v1/completions", jobs)
    for positions, r in results:
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            check_choice(hf_qwen3, choice, positions)
    after = served_by_engine(dp2)
    served = {e: after[e] - before[e] for e in after}
    assert sum(served.values()) == 9  # n=2 is two engine requests
    assert served["0"] > 0 and served["1"] > 0, served
    assert_nothing_held(dp2)


def completed(server) -> float:
    """Requests the engines ran to their end (stop or length), both engines."""
    return sum(served_by_engine(server).values())


def test_data_parallel_2_aborts_reach_the_engine_and_nothing_stays_held(dp2, hf_qwen3, tmp_path):
    """Streams closed by the client after their first token, while held there
    by construction (a :class:`Gate`), are aborted on the engine that runs them
    (else they would run to 480 tokens and count as completed); a request after
    them is exact; nothing is held afterwards."""
    before = completed(dp2)
    with httpx.Client(base_url=dp2.base_url, timeout=300.0) as http:
        for i in range(2):
            with Gate(tmp_path / f"hold-{i}") as gate:
                long = body(
                    PROMPTS[0],
                    max_tokens=480,
                    ignore_eos=True,
                    stream=True,
                    hidden_states_positions="all",
                    vllm_xargs=gate.xargs,
                )
                with http.stream("POST", "/v1/completions", json=long) as r:
                    assert next(line for line in r.iter_lines() if line.startswith("data: {"))
                # leaving the block closes the connection: the server aborts
                wait_until(lambda: dp2.load() == 0, "the server to close the stream")
        r = http.post("/v1/completions", json=body(PROMPTS[1]))
        assert r.status_code == 200, r.text
        check_choice(hf_qwen3, r.json()["choices"][0], "last")
    gauges = assert_nothing_held(dp2)
    assert completed(dp2) == before + 1 + gauges.sent


def test_data_parallel_2_stop_string_extract_goes_to_its_engine(dp2, hf_qwen3):
    """A stop string is matched in the front-end, which aborts the engine
    request and sends the extract over the trimmed sequence: still exact, and
    routed to the engine that generated the request's tokens (vLLM counts the
    request as finished on the engine whose output finished it: the
    extract's)."""
    # Both requests compute the whole prompt (their own cache salt: no prefix
    # cache hit on either engine), so the greedy text is the same whichever
    # engine serves each: with a random-weight model near-tied logits can flip
    # between a cached and an uncached prefill, and the stop string is missed.
    with httpx.Client(base_url=dp2.base_url, timeout=300.0) as http:
        probe = body(PROMPTS[2], max_tokens=8, cache_salt="stop-probe")
        free = http.post("/v1/completions", json=probe).json()
        text = free["choices"][0]["text"]
        assert len(text) >= 4, text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        stopped = body(PROMPTS[2], max_tokens=8, stop=[stop], cache_salt="stop-request")
        generated, served = generated_by_engine(dp2), served_by_engine(dp2)
        r = http.post("/v1/completions", json=stopped)
    assert r.status_code == 200, r.text
    generated_on = [e for e, n in generated_by_engine(dp2).items() if n > generated[e]]
    served_on = [e for e, n in served_by_engine(dp2).items() if n > served[e]]
    assert len(generated_on) == 1 and served_on == generated_on, (generated_on, served_on)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert len(choice["token_ids"]) < 8
    check_choice(hf_qwen3, choice, "last")
    assert_nothing_held(dp2)


def test_data_parallel_2_openai_client_and_hidden_states_route(dp2, hf_qwen3, qwen3_dir):
    client = openai.OpenAI(base_url=dp2.url("/v1"), api_key="unused")
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=4,
        temperature=0.0,
        extra_body=dict(
            return_token_ids=True, return_hidden_states=True, hidden_states_layers=LAYERS
        ),
    )
    check_choice(hf_qwen3, completion.model_dump()["choices"][0], "last")
    # POST /v1/hidden_states: "prompt" captures, every position, per engine.
    with httpx.Client(base_url=dp2.base_url, timeout=300.0) as http:
        for prompt, layer in ((PROMPTS[3], 0), (PROMPTS[4], -2), (PROMPTS[5], -1)):
            r = http.post(
                "/v1/hidden_states", json={"model": MODEL, "input": prompt, "layer": layer}
            )
            assert r.status_code == 200, r.text
            states = torch.tensor(r.json()["hidden_states"], dtype=torch.float32)
            ref = hf_qwen3.states(hf_tokenize(qwen3_dir, prompt))[layer]
            assert_close(states, ref, f"/v1/hidden_states layer {layer}")
    assert_nothing_held(dp2)


def test_api_server_count_2_is_exact_over_http(api2, hf_qwen3):
    """Two API-server processes in front of one engine: each holds and
    dispatches its own requests' extracts. Enough concurrent requests that
    both processes serve some (the kernel spreads connections)."""
    jobs = [("last", body(p)) for p in PROMPTS[:6]]
    jobs += [
        ("all", body(PROMPTS[6], hidden_states_positions="all")),
        ("prompt", body(PROMPTS[7], hidden_states_positions="prompt")),
    ]

    results = post_concurrently(api2.base_url, "/v1/completions", jobs)
    for positions, r in results:
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            check_choice(hf_qwen3, choice, positions)
    EngineGauges(api2).wait_until_nothing_held()
