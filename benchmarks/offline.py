# SPDX-License-Identifier: Apache-2.0
"""Offline ``LLM`` generation throughput with and without hidden states.

Two comparisons, each alternating its variants round by round:

1. One engine with hidden states enabled (every layer capturable): plain
   requests vs ``return_hidden_states`` "last" at layer -1, "last" at 4 layers,
   and "all" at layer -1, on 100% of the requests.
2. Plain requests on an engine started without hidden states vs the same on an
   engine started with them (enabled but unused, every layer capturable): the
   cost of the capture points (one custom-op call per layer per forward, with
   nothing to copy) and of the capture buffers' memory.

Throughput is generated tokens per second over a fixed batch (random token
prompts, greedy, ``ignore_eos`` so every variant generates the same count).
Every measurement draws **fresh prompts**: with the same prompts each round,
plain requests would read the previous rounds' KV blocks from the prefix cache
while "all"/"prompt" requests (which must compute every position) cannot, and
the comparison would price the cache, not the capture.
"""

import os
import random
import time
from pathlib import Path

from benchmarks.common import Comparison, alternate, bench_model

ENGINE_ARGS = dict(dtype="float32", gpu_memory_utilization=0.3, max_model_len=2048, seed=0)


def _prompts(n: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(length)]} for _ in range(n)]


class FreshPrompts:
    """``n`` random-token prompts of ``length``, new ones on every call."""

    def __init__(self, n: int, length: int) -> None:
        self.n, self.length, self.seed = n, length, 0

    def __call__(self, n: int | None = None) -> list[dict]:
        self.seed += 1
        return _prompts(n or self.n, self.length, seed=self.seed)


def _throughput(llm, prompts, **hs) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=hs.pop("max_tokens"), temperature=0.0, ignore_eos=True, **hs)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if hs.get("return_hidden_states"):
        assert all(o.outputs[0].hidden_states for o in outs)
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _buffer_mib(llm) -> float:
    """Capture-buffer memory of an engine with hidden states enabled, in MiB."""
    from vllm_hidden_states.hidden_states_config import HiddenStatesConfig

    vllm_config = llm.llm_engine.vllm_config
    cfg = HiddenStatesConfig.from_vllm_config(vllm_config)
    model_config = vllm_config.model_config
    dtype_bytes = model_config.dtype.itemsize
    return cfg.buffer_bytes(model_config.get_hidden_size(), dtype_bytes) / 2**20


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list[Comparison]:
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = model or bench_model()
    n, prompt_len, max_tokens = (8, 128, 32) if quick else (16, 256, 64)
    prompts = FreshPrompts(n, prompt_len)
    cfg = f"{n} requests x ({prompt_len} prompt + {max_tokens} generated tokens)"

    enabled = LLM(model=str(model), enable_hidden_states=True, **ENGINE_ARGS)
    disabled = LLM(model=str(model), **ENGINE_ARGS)
    for llm in (enabled, disabled):  # warm-up (compilation, caches)
        _throughput(llm, prompts(2), max_tokens=4)
    _throughput(enabled, prompts(2), max_tokens=4, return_hidden_states=True)

    per_request = Comparison(
        "offline LLM: hidden states on 100% of requests",
        "generated tok/s",
        baseline="plain",
        notes=cfg,
        targets={"last, layer -1": 0.97},
    )
    alternate(
        per_request,
        {
            "plain": lambda: _throughput(enabled, prompts(), max_tokens=max_tokens),
            "last, layer -1": lambda: _throughput(
                enabled, prompts(), max_tokens=max_tokens, return_hidden_states=True
            ),
            "last, 4 layers": lambda: _throughput(
                enabled,
                prompts(),
                max_tokens=max_tokens,
                return_hidden_states=True,
                hidden_states_layers=[-1, -2, 2, 6],
            ),
            "all positions, layer -1": lambda: _throughput(
                enabled,
                prompts(),
                max_tokens=max_tokens,
                return_hidden_states=True,
                hidden_states_positions="all",
            ),
        },
        rounds,
        progress,
    )

    unused = Comparison(
        "offline LLM: engine enabled but no request asks",
        "generated tok/s",
        baseline="engine without hidden states",
        notes=f"{cfg}; capture buffers at the default setting: {_buffer_mib(enabled):.1f} MiB",
        targets={"engine with --enable-hidden-states": 0.99},
    )
    alternate(
        unused,
        {
            "engine without hidden states": lambda: _throughput(
                disabled, prompts(), max_tokens=max_tokens
            ),
            "engine with --enable-hidden-states": lambda: _throughput(
                enabled, prompts(), max_tokens=max_tokens
            ),
        },
        rounds,
        progress,
    )

    for llm in (enabled, disabled):
        llm.llm_engine.engine_core.shutdown()
    return [per_request, unused]


STEPS_PER_ROUND = 6  # progress-bar units per round


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "offline")
