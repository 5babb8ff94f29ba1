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

* ``HF transformers (N threads)``: the same harvest without vLLM, the loop a
  user would write by hand: ``AutoModelForCausalLM`` (float32) in this process,
  ``torch.set_num_threads(N)`` with N = the cores this process (and the
  server, started without any pinning) may run on (2 on the development box),
  no affinity pinning; each ``HF_CHUNK`` documents sorted by length and run
  as right-padded forwards of ``HF_BATCH`` (``model(ids, attention_mask,
  output_hidden_states=True)``, token ids from ``tools.collect``'s own
  tokenization), ``hidden_states[-2]`` rows of each document's real tokens,
  handed to the same
  :class:`~vllm_hidden_states.store.parquet_shards.ShardWriter` (float32
  Parquet, zstd, writer thread) as collect (see ``HF_SCHEDULE`` below for why
  padded batches rather than one by one). Note on cores: the
  vLLM CPU server binds its worker's single OMP thread to one core and
  leaves the other to the engine core and the API server, so HF has two
  compute threads where vLLM has one; nothing else is pinned.

Unit: **tokens per second** (prompt positions returned / written per second of
wall time, from the first request to the last shard on disk for collect, from
the first tokenization to the last shard on disk for HF). Each round uses
texts no variant has seen; each HF measurement follows ``SETTLE_S`` of idle
(vLLM's CPU worker spins for ~1 s after its last step). Target: collect >=
0.9x the baseline. A second comparison reports collect / HF per round. Before
timing, one collected shard is checked against the baseline's arrays for the
same documents (equal float32), and one document's HF vectors against the
route's (``max|diff| <= 1e-4 * max|ref|``).

Run alone: ``python -m benchmarks.harvest [--quick | --tiny] [--rounds N] [--model DIR]``.
"""

import os
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
SERVER_ARGS = (
    "--enable-hidden-states",
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--gpu-memory-utilization",
    "0.3",
)
WORDS = (
    "the engine schedules requests runs model samples tokens hidden states residual "
    "stream layer sunset ocean robot counts shards parquet duckdb writer thread queue "
    "manifest resume document prompt feature sparse autoencoder vector"
).split()
BASELINE = "POST /v1/hidden_states (no write)"
COLLECT = "collect -> Parquet"
# The cores the server may use (it is started unpinned): HF gets as many threads.
HF_THREADS = len(os.sched_getaffinity(0))
HF = f"HF transformers ({HF_THREADS} threads) -> Parquet"
HF_TOL = 1e-4  # max|diff| / max|ref| against the route, float32
SETTLE_S = 1.2  # vLLM's CPU worker spins ~1 s after its last step
# "padded" (used): each HF_CHUNK documents sorted by length, right-padded into
# forwards of HF_BATCH with an attention mask, each document's first n rows
# (equal to one-by-one within 2.5e-6 relative);
# "single": one forward per document. On the loaded 2-core box (48 docs,
# 2 threads, 2 alternated rounds) unsorted padded batches of 16 ran 50 and 81
# tok/s, one by one 52 and 23: padded, with length sorting to drop most of
# the padding, is the schedule kept.
HF_SCHEDULE = os.environ.get("HARVEST_HF_SCHEDULE", "padded")
HF_BATCH = BATCH  # documents per forward
HF_CHUNK = 4 * BATCH  # documents sorted together, then written


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"[{seed}-{i}] " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60)))
        for i in range(n)
    ]


def post_batches(base_url: str, docs: list[str]) -> tuple[float, int]:
    """Seconds and positions for ``docs`` through the route, nothing written."""
    from vllm_hidden_states.client import to_numpy

    batches = [docs[i : i + BATCH] for i in range(0, len(docs), BATCH)]
    with httpx.Client(base_url=base_url, timeout=600) as client:

        def one(batch: list[str]) -> int:
            r = client.post(
                "/v1/hidden_states",
                json={
                    "model": "bench",
                    "input": batch,
                    "layer": LAYER,
                    "max_length": 1024,
                    "encoding_format": "base64",
                },
            )
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
    dataset.write_text(
        "".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(docs))
    )
    result = collect(
        CollectConfig(
            dataset=str(dataset),
            out=str(out),
            server_url=base_url,
            layers=[LAYER],
            batch_size=BATCH,
            concurrency=CONCURRENCY,
            progress=False,
        )
    )
    return result.seconds, result.tokens


def check_equal(base_url: str, work: Path) -> None:
    import duckdb

    from vllm_hidden_states.client import to_numpy

    docs = texts(3, seed=10**6)
    out = work / "check"
    collect_run(base_url, docs, out)
    r = httpx.post(
        base_url + "/v1/hidden_states",
        json={"model": "bench", "input": docs, "layer": LAYER, "encoding_format": "base64"},
        timeout=600,
    )
    for i, ref in enumerate(to_numpy(r.json())):
        rows = duckdb.sql(
            f"SELECT vector FROM '{out}/shard-*.parquet' WHERE doc_id = '{i}' ORDER BY position"
        ).fetchall()
        got = np.asarray([v for (v,) in rows], dtype=np.float32)
        if not np.array_equal(got, ref):
            raise AssertionError(f"collected doc {i} differs from the route's arrays")


class HFHarvest:
    """The hand-written transformers harvest: forward, layer -2, ShardWriter."""

    def __init__(self, model: Path, threads: int = HF_THREADS):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model_path = model
        self.threads = threads
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.hidden_size = self.model.config.hidden_size

    def token_ids(self, text: str) -> list[int]:
        from vllm_hidden_states.tools.collect.tokens import tokenize_text

        return tokenize_text(self.tokenizer, text, 1024)

    def states(self, docs: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(token_ids int32 [n], layer -2 float32 [n, hidden])`` per text."""
        torch = self.torch
        ids = [self.token_ids(t) for t in docs]
        out = []
        old = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                if HF_SCHEDULE == "single":
                    for tok in ids:
                        hs = self.model(
                            torch.tensor([tok]), output_hidden_states=True, use_cache=False
                        ).hidden_states
                        out.append((np.asarray(tok, dtype=np.int32), hs[LAYER][0].numpy()))
                else:  # length-sorted, right-padded batches of HF_BATCH
                    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
                    by_index = {}
                    for k in range(0, len(order), HF_BATCH):
                        chunk = order[k : k + HF_BATCH]
                        width = max(len(ids[i]) for i in chunk)
                        x = torch.zeros(len(chunk), width, dtype=torch.long)
                        mask = torch.zeros_like(x)
                        for j, i in enumerate(chunk):
                            x[j, : len(ids[i])] = torch.tensor(ids[i])
                            mask[j, : len(ids[i])] = 1
                        hs = self.model(
                            x, attention_mask=mask, output_hidden_states=True, use_cache=False
                        ).hidden_states[LAYER]
                        for j, i in enumerate(chunk):
                            by_index[i] = hs[j, : len(ids[i])].numpy()
                    out = [
                        (np.asarray(tok, dtype=np.int32), by_index[i]) for i, tok in enumerate(ids)
                    ]
        finally:
            torch.set_num_threads(old)
        return out

    def harvest(self, docs: list[str], out: Path) -> tuple[float, int]:
        """Seconds and tokens: states of ``docs`` written as collect's shards."""
        from vllm_hidden_states.store.parquet_shards import DocStates, HarvestMeta, ShardWriter

        meta = HarvestMeta(
            model=str(self.model_path),
            layers=(LAYER,),
            positions="prompt",
            hidden_size=self.hidden_size,
            dtype="float32",
            fmt="parquet",
            model_dtype="float32 (HF)",
        )
        t0 = time.perf_counter()
        tokens = 0
        with ShardWriter(out, meta) as writer:
            for i in range(0, len(docs), HF_CHUNK):
                chunk = docs[i : i + HF_CHUNK]
                for j, (ids, vectors) in enumerate(self.states(chunk)):
                    writer.submit(DocStates(str(i + j), ids, vectors[None]))
                    tokens += len(ids)
        return time.perf_counter() - t0, tokens


def check_hf(base_url: str, hf: HFHarvest) -> float:
    """One document's HF vectors vs the route's; returns max|diff| / max|ref|."""
    from vllm_hidden_states.client import to_numpy

    doc = texts(1, seed=10**6 + 1)[0]
    r = httpx.post(
        base_url + "/v1/hidden_states",
        json={
            "model": "bench",
            "input": doc,
            "layer": LAYER,
            "max_length": 1024,
            "encoding_format": "base64",
        },
        timeout=600,
    )
    r.raise_for_status()
    ref = to_numpy(r.json())
    ids, got = hf.states([doc])[0]
    if got.shape != ref.shape:
        raise AssertionError(f"HF gives {got.shape} for the document, the route {ref.shape}")
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    if rel > HF_TOL:
        raise AssertionError(
            f"HF layer {LAYER} differs from the route: max|diff|/max|ref| = {rel:.2e} > {HF_TOL}"
        )
    return rel


def run(
    rounds: int = 3, quick: bool = False, model: Path | None = None, tiny: bool = False
) -> list[Comparison]:
    """``tiny``: the tiny model, 4 documents a round, an eager server (a
    smoke test)."""
    model = model or bench_model("tiny" if tiny else "default")
    n_docs = 4 if tiny else 64 if quick else 256
    work = Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    eager = ("--enforce-eager",) if tiny else ()  # no compile in a smoke test
    server = Server(model, *SERVER_ARGS, *eager, name="harvest").wait()
    hf = HFHarvest(model)
    load0 = os.getloadavg()
    name = (
        f"harvest, layer {LAYER}, {n_docs} docs of ~60-120 tokens, batch {BATCH}, "
        f"{CONCURRENCY} in flight"
    )
    comp = Comparison(
        name=name,
        unit="tokens/s",
        baseline=BASELINE,
        targets={COLLECT: 0.9},
        notes="same server and requests; collect adds token ids and the Parquet writer thread; "
        f"HF: transformers float32 in the bench process, torch.set_num_threads("
        f"{HF_THREADS}), unpinned, schedule {HF_SCHEDULE!r} (length-sorted padded "
        f"batches of {HF_BATCH}), same ShardWriter",
    )
    try:
        check_equal(server.base_url, work)
        rel = check_hf(server.base_url, hf)
        comp.notes += f"; HF vs route, one document: max|diff|/max|ref| = {rel:.1e}"
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

        def hf_harvest() -> float:
            seed = next(counter)
            out = work / f"round-{seed}"
            time.sleep(SETTLE_S)
            s, n = hf.harvest(texts(n_docs, seed), out)
            shutil.rmtree(out)
            return n / s

        post_batches(server.base_url, texts(BATCH * CONCURRENCY, 999_999))  # warm-up
        hf.states(texts(4, 999_998))
        alternate(comp, {BASELINE: baseline, COLLECT: harvest, HF: hf_harvest}, rounds)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    load = (
        f"; load average (1, 5, 15 min) at start {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f}, at end " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    comp.notes += load
    vs_hf = Comparison(
        name=f"{name}: collect vs HF transformers",
        unit="tokens/s",
        baseline=HF,
        samples={HF: comp.samples[HF], COLLECT: comp.samples[COLLECT]},
        notes="the same rounds as above; ratio = collect / HF of the same round" + load,
    )
    return [comp, vs_hf]


if __name__ == "__main__":
    section_main(run, "harvest")
