# SPDX-License-Identifier: Apache-2.0
"""HTTP generation throughput with and without hidden states.

Two ``vllm serve`` processes on loopback, the same model: one started with
``--enable-hidden-states``, one without. Requests go to /v1/completions with a
fixed concurrency; throughput is generated tokens per second of wall time.

1. Enabled server: plain vs "last" at layer -1 vs "last" at 4 layers, on 100%
   of requests.
2. Every position at layer -1 (base64), non-streamed vs streamed per token
   (``hidden_states_stream``: rows on every SSE chunk), beside plain
   non-streamed and plain streamed requests.
3. Plain requests: server without the flag vs server with it (enabled, unused).
"""

import asyncio
import random
import time
from pathlib import Path

import httpx
import orjson

from benchmarks.common import Comparison, Server, alternate, bench_model

SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3")


def _prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> int:
    """Generated tokens of one streamed request (rows checked when asked)."""
    tokens, rows = 0, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in orjson.loads(line[6:]).get("choices") or ():
                tokens += len(choice.get("token_ids") or ())
                if choice.get("hidden_states"):
                    rows += choice["hidden_states"]["shape"][1]
    if body.get("return_hidden_states"):
        assert rows == len(body["prompt"]) + tokens, (rows, tokens)
    return tokens


async def _load(url: str, prompts, max_tokens: int, concurrency: int, extra: dict) -> float:
    limits = httpx.Limits(max_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:

        async def one(prompt):
            body = {
                "model": "bench",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                **extra,
            }
            async with sem:
                if extra.get("stream"):
                    return await _streamed(client, url, {**body, "return_token_ids": True})
                r = await client.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                body = r.json()
                if extra.get("return_hidden_states"):
                    assert all("hidden_states" in c for c in body["choices"])
                return body["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens) / (time.perf_counter() - start)


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list[Comparison]:
    model = model or bench_model()
    n, prompt_len, max_tokens, conc = (8, 128, 32, 8) if quick else (16, 256, 64, 16)
    # Fresh prompts per measurement (see benchmarks/offline.py): reused ones
    # would hit the prefix cache for plain requests only.
    seeds = iter(range(1, 1_000_000))

    def prompts(count: int = n) -> list[list[int]]:
        return _prompts(count, prompt_len, seed=next(seeds))

    cfg = f"{n} requests, concurrency {conc}, {prompt_len} prompt + {max_tokens} generated tokens"
    enabled = Server(model, *SERVER_ARGS, "--enable-hidden-states", name="server-enabled")
    disabled = Server(model, *SERVER_ARGS, name="server-disabled")
    try:
        enabled.wait()
        disabled.wait()

        def measure(server, **extra):
            return lambda: asyncio.run(_load(server.base_url, prompts(), max_tokens, conc, extra))

        for server in (enabled, disabled):  # warm-up
            asyncio.run(_load(server.base_url, prompts(2), 4, 2, {}))
        asyncio.run(_load(enabled.base_url, prompts(2), 4, 2, {"return_hidden_states": True}))

        per_request = Comparison(
            "HTTP /v1/completions: hidden states on 100% of requests",
            "generated tok/s",
            baseline="plain",
            notes=cfg,
            targets={"last, layer -1": 0.97},
        )
        alternate(
            per_request,
            {
                "plain": measure(enabled),
                "last, layer -1": measure(enabled, return_hidden_states=True),
                "last, 4 layers": measure(
                    enabled, return_hidden_states=True, hidden_states_layers=[-1, -2, 2, 6]
                ),
            },
            rounds,
            progress,
        )

        all_rows = dict(
            return_hidden_states=True, hidden_states_positions="all", hidden_states_format="base64"
        )
        streaming = Comparison(
            "HTTP /v1/completions: every position (layer -1), streamed per token vs not",
            "generated tok/s",
            baseline="all, non-streamed",
            notes=cfg,
            targets={"all, streamed per token": 0.90},
        )
        alternate(
            streaming,
            {
                "all, non-streamed": measure(enabled, **all_rows),
                "all, streamed per token": measure(
                    enabled, stream=True, hidden_states_stream=True, **all_rows
                ),
                "plain, non-streamed": measure(enabled),
                "plain, streamed": measure(enabled, stream=True),
            },
            rounds,
            progress,
        )

        unused = Comparison(
            "HTTP /v1/completions: server enabled but no request asks",
            "generated tok/s",
            baseline="server without hidden states",
            notes=cfg,
            targets={"server with --enable-hidden-states": 0.99},
        )
        alternate(
            unused,
            {
                "server without hidden states": measure(disabled),
                "server with --enable-hidden-states": measure(enabled),
            },
            rounds,
            progress,
        )
        return [per_request, streaming, unused]
    finally:
        enabled.stop()
        disabled.stop()


STEPS_PER_ROUND = 9


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "server_throughput")
