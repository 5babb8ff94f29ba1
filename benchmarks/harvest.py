# SPDX-License-Identifier: Apache-2.0
"""Harvest throughput: ``collect --server-url`` writing Parquet vs the same
requests to POST /v1/hidden_states with nothing written.

Both variants talk to one server (``vllm serve MODEL --enable-hidden-states``,
float32) and send the same work: the documents in batches of ``BATCH`` texts
(``input`` = list), layer -2, base64, ``CONCURRENCY`` batches in flight.

* ``POST /v1/hidden_states (no write)``: the baseline; each response decoded
  into numpy arrays (``vllm_hidden_states.client.to_numpy``) and dropped;
* ``collect -> Parquet``: :func:`vllm_hidden_states.tools.collect.collect` with
  ``server_url``: the same requests, plus token ids from the local tokenizer
  and the shard writer thread (float32 Parquet, zstd) into a fresh directory.

Unit: **tokens per second** (prompt positions returned / written per second of
wall time, from the first request to the last shard on disk for collect).
Each round uses texts no variant has seen. Target: collect >= 0.9x the
baseline. Before timing, one collected shard is checked against the
baseline's arrays for the same documents (equal float32).

Run alone: ``python -m benchmarks.harvest [--quick] [--rounds N] [--model DIR]``.
"""

import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import Comparison, Server, alternate, bench_model, section_main

LAYER = -2
BATCH = 16
CONCURRENCY = 2
SERVER_ARGS = ("--enable-hidden-states", "--dtype", "float32", "--max-model-len", "1024",
               "--gpu-memory-utilization", "0.3")
WORDS = ("the engine schedules requests runs model samples tokens hidden states residual "
         "stream layer sunset ocean robot counts shards parquet duckdb writer thread queue "
         "manifest resume document prompt feature sparse autoencoder vector").split()
BASELINE = "POST /v1/hidden_states (no write)"
COLLECT = "collect -> Parquet"


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"[{seed}-{i}] " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60)))
            for i in range(n)]


def post_batches(base_url: str, docs: list[str]) -> tuple[float, int]:
    """Seconds and positions for ``docs`` through the route, nothing written."""
    from vllm_hidden_states.client import to_numpy

    batches = [docs[i:i + BATCH] for i in range(0, len(docs), BATCH)]
    with httpx.Client(base_url=base_url, timeout=600) as client:
        def one(batch: list[str]) -> int:
            r = client.post("/v1/hidden_states", json={
                "model": "bench", "input": batch, "layer": LAYER, "max_length": 1024,
                "encoding_format": "base64"})
            r.raise_for_status()
            return sum(a.shape[0] for a in to_numpy(r.json()))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            tokens = sum(pool.map(one, batches))
        return time.perf_counter() - t0, tokens


def collect_run(base_url: str, docs: list[str], out: Path) -> tuple[float, int]:
    import json

    from vllm_hidden_states.tools.collect import CollectConfig, collect

    dataset = out.with_suffix(".jsonl")
    dataset.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                               for i, t in enumerate(docs)))
    result = collect(CollectConfig(
        dataset=str(dataset), out=str(out), server_url=base_url, layers=[LAYER],
        batch_size=BATCH, concurrency=CONCURRENCY, progress=False))
    return result.seconds, result.tokens


def check_equal(base_url: str, work: Path) -> None:
    import duckdb

    from vllm_hidden_states.client import to_numpy

    docs = texts(3, seed=10**6)
    out = work / "check"
    collect_run(base_url, docs, out)
    r = httpx.post(base_url + "/v1/hidden_states", json={
        "model": "bench", "input": docs, "layer": LAYER, "encoding_format": "base64"},
        timeout=600)
    for i, ref in enumerate(to_numpy(r.json())):
        rows = duckdb.sql(f"SELECT vector FROM '{out}/shard-*.parquet' WHERE doc_id = '{i}' "
                          "ORDER BY position").fetchall()
        got = np.asarray([v for (v,) in rows], dtype=np.float32)
        if not np.array_equal(got, ref):
            raise AssertionError(f"collected doc {i} differs from the route's arrays")


def run(rounds: int = 3, quick: bool = False, model: Path | None = None) -> list[Comparison]:
    model = model or bench_model()
    n_docs = 64 if quick else 256
    work = Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    server = Server(model, *SERVER_ARGS, name="harvest").wait()
    comp = Comparison(
        name=f"harvest, layer {LAYER}, {n_docs} docs of ~60-120 tokens, batch {BATCH}, "
             f"{CONCURRENCY} in flight",
        unit="tokens/s", baseline=BASELINE, targets={COLLECT: 0.9},
        notes="same server and requests; collect adds token ids and the Parquet writer thread",
    )
    try:
        check_equal(server.base_url, work)
        counter = iter(range(10**6))

        def baseline() -> float:
            s, n = post_batches(server.base_url, texts(n_docs, next(counter)))
            return n / s

        def harvest() -> float:
            seed = next(counter)
            out = work / f"round-{seed}"
            s, n = collect_run(server.base_url, texts(n_docs, seed), out)
            shutil.rmtree(out)
            return n / s

        post_batches(server.base_url, texts(BATCH * CONCURRENCY, 999_999))  # warm-up
        alternate(comp, {BASELINE: baseline, COLLECT: harvest}, rounds)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return [comp]


if __name__ == "__main__":
    section_main(run, "harvest")
