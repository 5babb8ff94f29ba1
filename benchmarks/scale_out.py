# SPDX-License-Identifier: Apache-2.0
"""Data-parallel scaling with hidden states: DP=2 vs DP=1 at the same load.

Four ``vllm serve`` processes, two at a time (DP=1 pair, then DP=2 pair), the
same model: one pair member with ``--enable-hidden-states`` serving "last" at
layer -1 on every request, the other plain (no flag, no hidden states). Each
round sends the same requests at the same concurrency to each server in turn;
throughput is generated tokens per second of wall time.

The number that matters is the scaling ratio, DP=2 throughput / DP=1
throughput, ours beside plain vLLM's: extracts go to the engine that served
their request, so hidden states should scale as vLLM does. On a 2-core box,
DP=2 engines share two cores (and other load), so the absolute ratio says
little about a many-core or GPU machine; the comparison of the two ratios is
the point.
"""

import asyncio
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.common import Comparison, Server, bench_model

SERVER_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--gpu-memory-utilization",
    "0.3",
    "--enforce-eager",
)


def _prompts(n: int, length: int, seed: int = 3) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


async def _load(url: str, prompts, max_tokens: int, concurrency: int, extra: dict) -> float:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:

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
                r = await client.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                out = r.json()
                if extra.get("return_hidden_states"):
                    assert all(c["hidden_states"]["shape"][0] == 1 for c in out["choices"])
                return out["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens) / (time.perf_counter() - start)


LAST = {
    "return_hidden_states": True,
    "hidden_states_layers": [-1],
    "hidden_states_format": "base64",
}


def run(
    rounds: int, quick: bool, model: Path | None = None, progress=None, tiny: bool = False
) -> list[Comparison]:
    """``tiny``: the tiny model, 2 requests x (8 + 4) tokens (a smoke test)."""
    model = model or bench_model("tiny" if tiny else "default")
    n, prompt_len, max_tokens, conc = (
        (2, 8, 4, 2) if tiny else (8, 64, 16, 8) if quick else (32, 128, 32, 16)
    )
    prompts = _prompts(n, prompt_len)
    cfg = (
        f"{n} requests, concurrency {conc}, {prompt_len} prompt + {max_tokens} "
        "generated tokens, the same at DP=1 and DP=2"
    )
    tput: dict[str, list[float]] = {}
    for dp in (1, 2):
        dp_args = ("--data-parallel-size", str(dp))
        ours = Server(
            model, *SERVER_ARGS, *dp_args, "--enable-hidden-states", name=f"scale-ours-dp{dp}"
        )
        plain = Server(model, *SERVER_ARGS, *dp_args, name=f"scale-plain-dp{dp}")
        try:
            ours.wait(900)
            plain.wait(900)
            for url, extra in ((ours.base_url, LAST), (plain.base_url, {})):
                asyncio.run(_load(url, prompts[:conc], max_tokens, conc, extra))  # warm-up
            for _ in range(rounds):
                for key, url, extra in (
                    (f"ours DP={dp}", ours.base_url, LAST),
                    (f"plain DP={dp}", plain.base_url, {}),
                ):
                    tput.setdefault(key, []).append(
                        asyncio.run(_load(url, prompts, max_tokens, conc, extra))
                    )
                    if progress is not None:
                        progress.update(1)
        finally:
            ours.stop()
            plain.stop()

    ours_scaling = statistics.median(a / b for a, b in zip(tput["ours DP=2"], tput["ours DP=1"]))
    plain_scaling = statistics.median(a / b for a, b in zip(tput["plain DP=2"], tput["plain DP=1"]))
    comparisons = []
    for dp in (1, 2):
        comp = Comparison(
            f'DP={dp}: "last" at layer -1 on every request vs plain',
            "generated tok/s",
            baseline=f"plain DP={dp}",
            notes=cfg,
        )
        for key in (f"plain DP={dp}", f"ours DP={dp}"):
            comp.samples[key] = tput[key]
        comparisons.append(comp)
    scaling = Comparison(
        "DP=2 / DP=1 scaling (ratio of same-round throughputs)",
        "ratio",
        baseline="plain vLLM",
        notes=f"ours x{ours_scaling:.3f} vs plain x{plain_scaling:.3f}; {cfg}",
    )
    scaling.samples["plain vLLM"] = [b / a for a, b in zip(tput["plain DP=1"], tput["plain DP=2"])]
    scaling.samples["ours (hidden states)"] = [
        b / a for a, b in zip(tput["ours DP=1"], tput["ours DP=2"])
    ]
    comparisons.append(scaling)
    return comparisons


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "scale_out")
