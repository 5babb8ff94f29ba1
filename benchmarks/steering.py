# SPDX-License-Identifier: Apache-2.0
"""Steering (issue 20): what an engine pays for being able to steer, and
what a request pays for steering.

Model: the small-model section's random 5-layer, 256-wide Llama (float32,
torch.compile'd), where the model's own compute is short and per-step host
work shows. Workload: 24 requests (12 with ``--quick``) x (48 prompt + 64
generated tokens), fresh random prompts per measurement, greedy,
``ignore_eos``. Baseline: plain requests on an engine started without hidden
states or steering. Variants, on an engine started with
``enable_steering=True`` alone (no hidden states; the default steerable
points: ``resid_pre`` of every layer):

* nobody steers;
* every request adds the same vector at ``resid_pre.2`` over all its
  positions (``{"point": "resid_pre.2", "op": "add", "vector": [256 floats],
  "strength": 4.0, "positions": "all"}``, inline);
* every request ablates the same direction there (``"op": "ablate"``);
* every request adds its own random vector there (the batch holds one vector
  per running request, a row each in the worker's vector table);

and, on a third engine started with ``steering_points="all"`` (every
residual-stream point of every layer steerable: 21 points on this model,
``resid_post.i`` being ``resid_pre.i+1``), nobody steers. Vectors are unit
length (seeded), so ``strength`` is the length added. The vectors travel
inline in every request, as JSON would bring them: the front-end's check of
each request (``check_steering``) is in the timed call. All engines live in
this process and the variants alternate round by round. Before anything is
timed, add and ablate are checked to change the greedy tokens (a steer that
did nothing would price nothing).

Targets (issue 20): steering enabled but unused >= 0.99; steering on every
request >= 0.97. The ablate, per-request-vector and every-point-steerable
variants are reported without a target.

Run alone: ``python -m benchmarks.steering [--quick] [--rounds N]
[--model DIR]`` (writes ``benchmarks/results/steering.json``); in ``make
bench``: ``python -m benchmarks.run --only steering`` (``latest.json`` and
``throughput_ratios.png``).
"""

import time
from pathlib import Path

import numpy as np

from benchmarks.common import Comparison, alternate
from benchmarks.offline import ENGINE_ARGS, _throughput
from benchmarks.small_model import MAX_TOKENS, PROMPT_LEN, small_model, small_model_engines

POINT = "resid_pre.2"
STRENGTH = 4.0
PLAIN = "plain vLLM (no hidden states)"
UNUSED = "steering enabled, nobody steers"
ADD = f"add {POINT}, every request"
ABLATE = f"ablate {POINT}, every request"
PER_REQUEST = f"add {POINT}, own vector each"
ALL_POINTS = "steering_points=all, nobody steers"


def unit_vectors(n: int, width: int, seed: int) -> list[list[float]]:
    """``n`` random unit vectors of ``width`` float32 values, as lists."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, width)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v.tolist()


def intervention(vector: list[float], op: str = "add") -> list[dict]:
    item = {"point": POINT, "op": op, "vector": vector, "positions": "all"}
    if op == "add":
        item["strength"] = STRENGTH
    return [item]


def _steered(llm, prompts: list[dict], steering: list[list[dict]], max_tokens: int) -> float:
    """Generated tok/s of one ``generate`` call, request ``i`` steered by
    ``steering[i % len(steering)]``."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            steering=steering[i % len(steering)],
        )
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _tokens(llm, prompts: list[dict], steering: list[dict] | None) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, steering=steering)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list[Comparison]:
    from vllm import LLM

    model = model or small_model()
    n, prompts, plain, steer = small_model_engines(
        quick, model, enable_hidden_states=False, enable_steering=True
    )
    every_point = LLM(
        model=str(model),
        enable_steering=True,
        steering_points="all",
        **dict(ENGINE_ARGS, max_model_len=512),
    )
    _throughput(every_point, prompts(2), max_tokens=4)  # warm-up

    width = steer.llm_engine.vllm_config.model_config.get_hidden_size()
    (shared,) = unit_vectors(1, width, seed=20)
    own = [intervention(v) for v in unit_vectors(n, width, seed=21)]
    add, ablate = [intervention(shared)], [intervention(shared, "ablate")]

    # Warm-up of the steered paths, and the check that steering steers.
    check = prompts(2)
    unsteered = _tokens(steer, check, None)
    for what, steering in (("add", add[0]), ("ablate", ablate[0])):
        if _tokens(steer, check, steering) == unsteered:
            raise RuntimeError(
                f"steering check: {what} at {POINT} left the greedy tokens of "
                f"{len(check)} prompts unchanged; nothing would be measured"
            )
    _steered(steer, prompts(4), own[:4], max_tokens=4)

    comparison = Comparison(
        "steering: per-request interventions",
        "generated tok/s",
        baseline=PLAIN,
        notes=(
            f"5 x 256 Llama, engine with enable_steering=True only (steerable: resid_pre "
            f"of every layer), {n} requests x ({PROMPT_LEN} prompt + {MAX_TOKENS} "
            f"generated tokens), fresh prompts; inline unit vectors, add strength "
            f"{STRENGTH}, positions all; '{ALL_POINTS}': a third engine, every "
            "residual-stream point of every layer steerable"
        ),
        targets={UNUSED: 0.99, ADD: 0.97},
    )
    alternate(
        comparison,
        {
            PLAIN: lambda: _throughput(plain, prompts(), max_tokens=MAX_TOKENS),
            UNUSED: lambda: _throughput(steer, prompts(), max_tokens=MAX_TOKENS),
            ADD: lambda: _steered(steer, prompts(), add, MAX_TOKENS),
            ABLATE: lambda: _steered(steer, prompts(), ablate, MAX_TOKENS),
            PER_REQUEST: lambda: _steered(steer, prompts(), own, MAX_TOKENS),
            ALL_POINTS: lambda: _throughput(every_point, prompts(), max_tokens=MAX_TOKENS),
        },
        rounds,
        progress,
    )
    for llm in (plain, steer, every_point):
        llm.llm_engine.engine_core.shutdown()
    return [comparison]


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "steering")
