# SPDX-License-Identifier: Apache-2.0
"""``vllm serve MODEL --enable-hidden-states`` on CUDA (compiled, CUDA graphs,
vLLM's defaults otherwise), through the official openai client, streamed and
not, exact against HF on the same GPU."""

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_hidden_states.client import to_numpy

from .conftest import REPO, assert_close_gpu, record_engine

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
        Path(os.environ.get("HS_GPU_OUT", REPO / ".gpu-logs")) / "serve-server.log",
    )
    start = time.perf_counter()
    proc.start()
    try:
        proc.wait_ready(timeout=900)
        record_engine("serve", time.perf_counter() - start)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url("/v1"), api_key="unused")


def test_server_keeps_vllm_cuda_runner_and_scheduling(server):
    """No fallback from vLLM's defaults is logged: neither the V1 runner
    instead of V2 nor async scheduling switched off."""
    log = server.log_path.read_text(errors="replace")
    assert "using the V1 model runner instead" not in log
    assert "async scheduling off" not in log


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
