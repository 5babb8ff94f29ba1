# SPDX-License-Identifier: Apache-2.0
"""/health latency while the API server receives the bodies of issue 18.

One ``--enable-hidden-states`` server (the tiny Qwen3, default request
bounds). For each reproduction (the issue's own sizes and the scaled-down
ones of ``tests/v1/hidden_states/test_request_bounds.py``), ``rounds`` times:
a thread polls /health one request after another (10 ms apart) while the big
body is posted; the latencies of the polls that overlap the big request are
kept. Reported per reproduction: the big request's status and time, the
number of /health answers during it, their median, p90 and max latency (ms),
and the API server's VmRSS / peak (VmHWM, reset before each request) growth.
Target: median /health latency < 100 ms during every reproduction.

The machine's load average is recorded at the start and end: on a shared
2-core box the numbers move with it; the tests assert only speed-independent
conditions (every /health answered, none slower than 3 s).

Run: ``python -m benchmarks.health_under_load [--rounds 5] [--only NAME] [--out PATH]``;
writes ``benchmarks/results/health_under_load.json`` (and ``--out``).
"""

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx
import orjson

from benchmarks import common
from benchmarks.common import bench_model

TARGET_MEDIAN_MS = 100.0
POLL_INTERVAL_S = 0.01
SERVED = "bench"


def _keys(n: int) -> bytes:
    return orjson.dumps({"model": SERVED, "input": "hi", **{f"k{i}": 1 for i in range(n)}})


def _binary_batch(inputs: int, positions: int) -> bytes:
    text = " ".join(f"w{i}" for i in range(2 * positions))
    return orjson.dumps(
        {
            "model": SERVED,
            "input": [f"{i}: {text}" for i in range(inputs)],
            "max_length": positions,
            "encoding_format": "bytes",
            "embed_dtype": "float16",
            "return_attention_mask": True,
        }
    )


REPRODUCTIONS = {
    # The sizes.
    "hidden_states 1M empty messages": (
        "/v1/hidden_states",
        lambda: orjson.dumps({"model": SERVED, "messages": [{}] * 1_000_000}),
    ),
    "chat 1M empty messages": (
        "/v1/chat/completions",
        lambda: orjson.dumps({"model": SERVED, "messages": [{}] * 1_000_000}),
    ),
    "hidden_states 1M unknown keys": ("/v1/hidden_states", lambda: _keys(1_000_000)),
    # The tests' sizes (under the values cap: parsed off the loop, then walked).
    "hidden_states 500k unknown keys": ("/v1/hidden_states", lambda: _keys(500_000)),
    "hidden_states 100k empty messages": (
        "/v1/hidden_states",
        lambda: orjson.dumps({"model": SERVED, "messages": [{}] * 100_000}),
    ),
    "chat 100k empty messages": (
        "/v1/chat/completions",
        lambda: orjson.dumps({"model": SERVED, "messages": [{}] * 100_000}),
    ),
    "completions 100k negative token ids": (
        "/v1/completions",
        lambda: orjson.dumps({"model": SERVED, "prompt": [-1] * 100_000, "max_tokens": 1}),
    ),
    "responses 2000 empty items": (
        "/v1/responses",
        lambda: orjson.dumps({"model": SERVED, "input": [{}] * 2000}),
    ),
    # Item 2: a binary answer whose metadata (one mask entry per position) was
    # a ~112 KB header; now served whole (200), its header in the body.
    "hidden_states binary 56x1000 masks": ("/v1/hidden_states", lambda: _binary_batch(56, 1000)),
}


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) // 1024
    return out


def _reset_peak(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def one_round(server: common.Server, path: str, body: bytes) -> dict:
    polls: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=server.base_url, timeout=600.0) as client:
            while not stop.is_set():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                polls.append((start, time.monotonic()))
                time.sleep(POLL_INTERVAL_S)

    pid = server.proc.pid
    _reset_peak(pid)
    before = _proc_status(pid)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    while len(polls) < 3:
        time.sleep(0.01)
    with httpx.Client(base_url=server.base_url, timeout=600.0) as client:
        start = time.monotonic()
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        end = time.monotonic()
    time.sleep(0.1)
    stop.set()
    poller.join()
    after = _proc_status(pid)
    during = [(e - s) * 1000 for s, e in polls if s < end and e > start]
    return {
        "status": r.status_code,
        "request_s": end - start,
        "health": during,
        "rss_growth_mb": after["VmRSS"] - before["VmRSS"],
        "peak_growth_mb": after["VmHWM"] - before["VmRSS"],
        "message": (
            r.json().get("error", {}).get("message", "")[:200]
            if r.headers.get("content-type") == "application/json"
            else f"{r.headers.get('content-type')}, {len(r.content)} bytes"
        ),
    }


def run(rounds: int, only: str | None = None) -> dict:
    model = bench_model("tiny")
    load_start = os.getloadavg()
    server = common.Server(
        model,
        "--enable-hidden-states",
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
        "--enforce-eager",
        name="health_under_load",
    )
    try:
        server.wait()
        idle: list[float] = []
        with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
            for _ in range(50):
                start = time.monotonic()
                client.get("/health")
                idle.append((time.monotonic() - start) * 1000)
                time.sleep(POLL_INTERVAL_S)
        results = {}
        for name, (path, make_body) in REPRODUCTIONS.items():
            if only and only not in name:
                continue
            body = make_body()
            runs = [one_round(server, path, body) for _ in range(rounds)]
            latencies = [ms for r in runs for ms in r["health"]]
            results[name] = {
                "path": path,
                "body_bytes": len(body),
                "status": sorted({r["status"] for r in runs}),
                "message": runs[0]["message"],
                "request_s_median": statistics.median(r["request_s"] for r in runs),
                "health_answers_during": [len(r["health"]) for r in runs],
                "health_median_ms": statistics.median(latencies) if latencies else None,
                "health_p90_ms": (
                    statistics.quantiles(latencies, n=10)[-1] if len(latencies) > 1 else None
                ),
                "health_max_ms": max(latencies) if latencies else None,
                "rss_growth_mb_max": max(r["rss_growth_mb"] for r in runs),
                "peak_growth_mb_max": max(r["peak_growth_mb"] for r in runs),
            }
            if latencies:
                results[name]["meets_target"] = results[name]["health_median_ms"] < TARGET_MEDIAN_MS
    finally:
        server.stop()
    return {
        "machine": common.machine(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "rounds": rounds,
        "target": f"median /health latency < {TARGET_MEDIAN_MS:g} ms during each reproduction",
        "idle_health_median_ms": statistics.median(idle),
        "reproductions": results,
    }


def lines(out: dict) -> list[str]:
    rows = [
        f"/health under issue-18 bodies (load {out['load_average_start'][0]:.2f} -> "
        f"{out['load_average_end'][0]:.2f}; idle /health median "
        f"{out['idle_health_median_ms']:.1f} ms)"
    ]
    for name, r in out["reproductions"].items():
        med = "-" if r["health_median_ms"] is None else f"{r['health_median_ms']:.1f}"
        top = "-" if r["health_max_ms"] is None else f"{r['health_max_ms']:.0f}"
        rows.append(
            f"  {name:<38s} {r['status']} {r['request_s_median']:6.2f} s  /health n="
            f"{sum(r['health_answers_during']):<4d} median {med} ms  max {top} ms  "
            f"peak +{r['peak_growth_mb_max']} MB"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--only", default=None, help="run the reproductions whose name holds this")
    args = p.parse_args(argv)
    out = run(args.rounds, args.only)
    print("\n".join(lines(out)))
    path = common.write_results(out, stem="health_under_load")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str))
        path = args.out
    print(f"results: {path}")


if __name__ == "__main__":
    main()
