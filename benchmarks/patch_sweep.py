# SPDX-License-Identifier: Apache-2.0
"""A patching sweep in one call (issue 57): POST /v1/patch_sweep against the
same 64 cells sent as separate HTTP calls.

Model: the benchmark Qwen3 (12 x 1024; ``--tiny``: the tests' tiny Qwen3).
Workload: a clean and a corrupted prompt of 16 random token ids differing at
two positions; 64 cells, ``resid_pre.0..3`` x the 16 positions, metric
``log p(answer)`` at the last position. Variants, on one server
(``--enable-steering --steering-points all``):

* separate calls (the baseline, as ``examples/activation_patching.py``
  does it): one /v1/completions capturing the clean rows (every point, every
  prompt position, float JSON), then the corrupted baseline and the 64 cells
  at once (``asyncio.gather``), each a /v1/completions with its ``patch``
  (the row as a typed base64 array) and the answer's logprob read from the
  prompt logprobs of ``corrupted + [answer]``;
* one call: ``POST /v1/patch_sweep`` with the same grid and metric.

Measured: sweeps per second, each variant once per round in a balanced
order (paired rounds). Target (issue 57): one call >= 5x the separate calls.
Both variants' grids are checked equal (1e-4) before timing.

Run alone: ``python -m benchmarks.patch_sweep [--rounds N] [--tiny]`` (writes
``benchmarks/results/patch_sweep.json`` and ``patch_sweep.png``).
"""

import asyncio
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, Comparison, Server, alternate, bench_model

POINTS = [f"resid_pre.{k}" for k in range(4)]
LENGTH = 16
SEPARATE = "64 separate HTTP calls (concurrent)"
ONE_CALL = "one POST /v1/patch_sweep"


def prompts(seed: int = 57) -> tuple[list[int], list[int], int]:
    rng = np.random.default_rng(seed)
    clean = [int(x) for x in rng.integers(10, 400, LENGTH)]
    corrupted = list(clean)
    for p in (5, LENGTH - 1):
        corrupted[p] = (clean[p] + 7) % 400 + 10
    return clean, corrupted, int(rng.integers(10, 400))


async def separate_calls(base_url: str, clean, corrupted, answer) -> np.ndarray:
    import openai

    from vllm_hidden_states.patch_rows import encode_rows

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", timeout=600.0)
    captured = await client.completions.create(
        model="bench",
        prompt=clean,
        max_tokens=1,
        temperature=0.0,
        extra_body={"return_hidden_states": True, "hidden_states_points": POINTS,
                    "hidden_states_positions": "prompt"},
    )  # fmt: skip
    obj = captured.choices[0].model_extra["hidden_states"]
    rows = np.asarray(obj["data"], dtype=np.float32).reshape(obj["shape"])[-len(POINTS) :]

    async def logprob(steering) -> float:
        out = await client.completions.create(
            model="bench",
            prompt=[*corrupted, answer],
            max_tokens=1,
            temperature=0.0,
            extra_body={"prompt_logprobs": 0, "steering": steering},
        )
        return float(out.choices[0].model_extra["prompt_logprobs"][-1][str(answer)]["logprob"])

    cells = [
        [{"op": "patch", "point": point, "rows": encode_rows(rows[i, p : p + 1]),
          "positions": {"start": p, "end": p + 1}}]
        for i, point in enumerate(POINTS)
        for p in range(LENGTH)
    ]  # fmt: skip
    values = await asyncio.gather(logprob(None), *(logprob(c) for c in cells))
    await client.close()
    return np.asarray(values[1:]).reshape(len(POINTS), LENGTH)


def one_call(http, clean, corrupted, answer) -> np.ndarray:
    r = http.post(
        "/v1/patch_sweep",
        json={"model": "bench", "clean": clean, "corrupted": corrupted, "points": POINTS,
              "metric": {"logprob": answer}},
    )  # fmt: skip
    r.raise_for_status()
    return np.asarray(r.json()["grid"])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1.0 / (time.perf_counter() - start)


def run(
    rounds: int, quick: bool, model: Path | None = None, progress=None, tiny: bool = False
) -> list[Comparison]:
    import httpx

    model = model or bench_model("tiny" if tiny else "default")
    server = Server(
        model,
        "--enable-steering",
        "--steering-points",
        "all",
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        *(["--enforce-eager"] if tiny else []),
        name="patch_sweep",
    ).wait()
    clean, corrupted, answer = prompts()
    try:
        with httpx.Client(base_url=server.base_url, timeout=600.0) as http:
            a = asyncio.run(separate_calls(server.base_url, clean, corrupted, answer))
            b = one_call(http, clean, corrupted, answer)
            if np.abs(a - b).max() > 1e-4:
                raise RuntimeError(f"the grids differ by {np.abs(a - b).max()}")
            comparison = Comparison(
                "patch_sweep: a 64-cell patching sweep",
                "sweeps/s",
                baseline=SEPARATE,
                notes=(
                    f"{'tiny Qwen3' if tiny else '12 x 1024 Qwen3'}, float32, "
                    f"{len(POINTS)} points x {LENGTH} positions, logprob metric; one server"
                ),
                targets={ONE_CALL: 5.0},
            )
            alternate(
                comparison,
                {
                    SEPARATE: lambda: timed(
                        lambda: asyncio.run(
                            separate_calls(server.base_url, clean, corrupted, answer)
                        )
                    ),
                    ONE_CALL: lambda: timed(lambda: one_call(http, clean, corrupted, answer)),
                },
                rounds,
                progress,
            )
    finally:
        server.stop()
    plot(comparison, RESULTS / "patch_sweep.png")
    return [comparison]


def plot(comparison: Comparison, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, samples in comparison.samples.items():
        ax.plot(range(1, len(samples) + 1), [1 / s for s in samples], "o-", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("seconds per 64-cell sweep")
    ax.set_title(f"patch sweep: one call x{comparison.ratio(ONE_CALL):.1f} faster")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "patch_sweep")
