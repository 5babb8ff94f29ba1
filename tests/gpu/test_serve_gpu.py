# SPDX-License-Identifier: Apache-2.0
"""``vllm serve MODEL --enable-hidden-states`` on CUDA (compiled, CUDA graphs,
vLLM's defaults otherwise), through the official openai client, streamed and
not, exact against HF on the same GPU."""

import numpy as np
import pytest
import torch

from vllm_hidden_states.client import to_numpy

from .conftest import REPO, assert_close_gpu

PROMPT = "Once upon a time there was a small robot who loved to count the stars"


@pytest.fixture(scope="module")
def server(qwen3_dir):
    from tests.support.server_process import ServerProcess

    proc = ServerProcess(
        qwen3_dir,
        [
            "--enable-hidden-states",
            "--dtype",
            "float32",
            "--seed",
            "0",
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            "1024",
        ],
        REPO / ".gpu-logs" / "serve.log",
    ).start()
    try:
        yield proc.wait_ready(timeout=900)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url("/v1"), api_key="unused")


def test_server_log_names_the_v1_runner_and_async_scheduling_off(server):
    log = server.log_path.read_text(errors="replace")
    assert "Model Runner V2 does not yet support per-request hidden states" in log
    assert "async scheduling off" in log


def test_completion_last_state_matches_hf(client, hf_gpu):
    out = client.completions.create(
        model="model",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_layers": [-2, -1],
            "return_token_ids": True,
        },
    )
    extra = out.choices[0].model_extra
    ids = list(extra["prompt_token_ids"]) + list(extra["token_ids"])
    ref = hf_gpu.states(ids)
    got = to_numpy(extra["hidden_states"]).reshape(2, -1, hf_gpu.hidden_size)
    for i, layer in enumerate([-2, -1]):
        assert_close_gpu(torch.from_numpy(got[i, -1:]), ref[layer][-1:], f"serve last {layer}")


def test_streamed_all_positions_concatenate_to_hf(client, hf_gpu):
    chunks = list(
        client.completions.create(
            model="model",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0.0,
            stream=True,
            extra_body={
                "return_hidden_states": True,
                "hidden_states_layers": [1],
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
    ids = list(chunks[0].choices[0].model_extra["prompt_token_ids"]) + tokens
    got = torch.from_numpy(np.concatenate(parts, axis=1)[0])
    assert_close_gpu(got, hf_gpu.states(ids)[1], "serve streamed all layer 1")
