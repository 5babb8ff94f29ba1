# SPDX-License-Identifier: Apache-2.0
"""SAE features vs full hidden states over HTTP: bytes per position and
request throughput, every position of prompt + output.

One server, ``vllm serve MODEL --enable-hidden-states --sae DIR`` (float32),
where ``DIR`` is a random SAE (:func:`vllm_hidden_states.sae.build_random_sae`,
``d_sae`` = ``D_SAE``) reading layer -2 of the benchmark model (absolute index
``num_hidden_layers - 1`` in HF ``output_hidden_states`` numbering, taken from
the model's ``config.json``). Every request: POST /v1/completions, a prompt of
``PROMPT_LEN`` random token ids, ``MAX_TOKENS`` generated (``ignore_eos``,
``temperature`` 0), ``CONCURRENCY`` requests in flight. Variants:

* ``plain``: no hidden states, no features (the baseline);
* ``hidden states L-2 base64``: ``return_hidden_states``,
  ``hidden_states_layers=[-2]``, ``hidden_states_positions="all"``,
  ``hidden_states_format="base64"``;
* ``SAE top-20``: ``sae_features={"top_k": 20}``,
  ``hidden_states_positions="all"``, no ``hidden_states_layers`` (features
  only: 20 int32 ids + 20 float32 values per position leave the worker).

Two comparisons, alternated round by round (:func:`benchmarks.common.alternate`):
requests/s and generated tokens/s (ratio vs plain), and response bytes per
position (``len(body) / positions``, positions = prompt + output, from the
response's own ``shape``; for plain, per prompt + output token). Each
measurement draws fresh prompts (the prefix cache would otherwise serve plain
requests' prompts from earlier rounds, which "all" requests do not read).

Run alone: ``python -m benchmarks.sae_payload [--quick] [--rounds N] [--model DIR]``.
"""

import json
import os
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.common import Comparison, Server, alternate, bench_model, section_main

PROMPT_LEN = 256
MAX_TOKENS = 32
CONCURRENCY = 8
TOP_K = 20
D_SAE = 16384
LAYER = -2
PLAIN = "plain"
HIDDEN = "hidden states L-2 base64"
SAE = f"SAE top-{TOP_K}"
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3")


def request_body(variant: str, prompt: list[int]) -> dict:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if variant == HIDDEN:
        body.update(
            return_hidden_states=True,
            hidden_states_layers=[LAYER],
            hidden_states_positions="all",
            hidden_states_format="base64",
        )
    elif variant == SAE:
        body.update(sae_features={"top_k": TOP_K}, hidden_states_positions="all")
    return body


def positions_of(variant: str, choice: dict) -> int:
    """Positions the answer covers (from its own shape; plain: prompt + output)."""
    if variant == HIDDEN:
        return int(choice["hidden_states"]["shape"][1])
    if variant == SAE:
        feats = choice["sae_features"]
        if "hidden_states" in choice:
            raise AssertionError("features-only request got hidden_states as well")
        return int(feats["shape"][0])
    return PROMPT_LEN + MAX_TOKENS


def one_round(
    base_url: str, variant: str, n_requests: int, seed: int, vocab: int
) -> dict[str, float]:
    rng = random.Random(seed)
    # Token ids above the special ones, so no prompt holds an EOS by chance.
    prompts = [[rng.randrange(16, vocab) for _ in range(PROMPT_LEN)] for _ in range(n_requests)]
    with httpx.Client(
        base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=CONCURRENCY)
    ) as client:

        def one(prompt: list[int]) -> tuple[int, int, int]:
            r = client.post("/v1/completions", json=request_body(variant, prompt))
            if r.status_code != 200:
                raise RuntimeError(f"{variant}: {r.status_code} {r.text[:300]}")
            body = r.content
            data = json.loads(body)
            choice = data["choices"][0]
            generated = data["usage"]["completion_tokens"]
            return len(body), positions_of(variant, choice), generated

        t0 = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(one, prompts))
        seconds = time.perf_counter() - t0
    nbytes = sum(r[0] for r in results)
    positions = sum(r[1] for r in results)
    generated = sum(r[2] for r in results)
    return {
        "req_s": n_requests / seconds,
        "gen_tok_s": generated / seconds,
        "bytes_per_position": nbytes / positions,
    }


def check_once(base_url: str, vocab: int, d_sae: int) -> dict:
    """One request of each kind on the same prompt: shapes and id ranges
    (raises), whether the greedy texts agree and how many slots are active."""
    rng = random.Random(12345)
    prompt = [rng.randrange(16, vocab) for _ in range(PROMPT_LEN)]
    out = {}
    for variant in (HIDDEN, SAE):
        r = httpx.post(
            base_url + "/v1/completions", json=request_body(variant, prompt), timeout=600
        )
        r.raise_for_status()
        out[variant] = r.json()["choices"][0]
    hs, feats = out[HIDDEN]["hidden_states"], out[SAE]["sae_features"]
    n = PROMPT_LEN + MAX_TOKENS
    if hs["shape"][1] != n or feats["shape"] != [n, TOP_K]:
        raise AssertionError(
            f"shapes: hidden {hs['shape']}, features {feats['shape']}; expected {n} positions"
        )
    ids = [i for row in feats["ids"] for i in row]
    if not all(-1 <= i < d_sae for i in ids) or max(ids) < 0:
        raise AssertionError("feature ids out of range")
    return {
        "layer": feats["layer"],
        "same_text": out[HIDDEN]["text"] == out[SAE]["text"],
        "active_per_position": statistics.mean(sum(i >= 0 for i in row) for row in feats["ids"]),
    }


def run(rounds: int = 3, quick: bool = False, model: Path | None = None) -> list[Comparison]:
    from vllm_hidden_states.sae import build_random_sae

    model = Path(model or bench_model())
    config = json.loads((model / "config.json").read_text())
    hidden, num_layers, vocab = (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    sae_layer = num_layers + 1 + LAYER  # HF output_hidden_states has L + 1 entries
    n_requests = 16 if quick else 32
    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="sae-payload-bench-"))
    sae_dir = build_random_sae(work / "sae", d_in=hidden, layer=sae_layer, d_sae=D_SAE)
    server = Server(
        model, "--enable-hidden-states", "--sae", str(sae_dir), *SERVER_ARGS, name="sae_payload"
    ).wait()
    setup = (
        f"/v1/completions, {n_requests} requests of {PROMPT_LEN} random tokens + "
        f"{MAX_TOKENS} generated, {CONCURRENCY} in flight, positions 'all'; random "
        f"SAE d_in {hidden}, d_sae {D_SAE}, layer {sae_layer} (= -2)"
    )
    throughput = Comparison(
        name=f"SAE payload, requests/s: {setup}", unit="requests/s", baseline=PLAIN
    )
    gen = Comparison(
        name="SAE payload, generated tokens/s (same rounds)", unit="tok/s", baseline=PLAIN
    )
    size = Comparison(
        name="SAE payload, response bytes per position (same rounds)",
        unit="bytes/position",
        baseline=HIDDEN,
        higher_is_better=False,
    )
    try:
        checked = check_once(server.base_url, vocab, D_SAE)
        counter = iter(range(1, 10**6))

        def measure(variant: str):
            def fn() -> float:
                res = one_round(server.base_url, variant, n_requests, next(counter), vocab)
                gen.add(variant, res["gen_tok_s"])
                if variant != PLAIN:
                    size.add(variant, res["bytes_per_position"])
                else:
                    size.notes = (
                        f"plain completion: {res['bytes_per_position']:.1f} bytes "
                        "per prompt + output token"
                    )
                return res["req_s"]

            return fn

        one_round(server.base_url, PLAIN, CONCURRENCY, 0, vocab)  # warm-up
        alternate(throughput, {v: measure(v) for v in (PLAIN, HIDDEN, SAE)}, rounds)
        throughput.notes = (
            f"SAE check: features at layer {checked['layer']}, "
            f"{checked['active_per_position']:.1f} of {TOP_K} slots active "
            "per position; greedy text "
            f"{'equal to' if checked['same_text'] else 'DIFFERS from'} the "
            "hidden-states request's"
        )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    load = (
        f"load average (1, 5, 15 min) at start {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f}, at end " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    for comp in (throughput, gen, size):
        comp.notes = f"{comp.notes}; {load}" if comp.notes else load
    for v in (HIDDEN, SAE):
        print(f"sae_payload: {v}: {size.median(v):,.1f} bytes per position")
    return [throughput, gen, size]


if __name__ == "__main__":
    section_main(run, "sae_payload")
