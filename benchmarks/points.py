# SPDX-License-Identifier: Apache-2.0
"""Capture points beyond the residual stream (issue 19): what an engine pays
for making every point capturable, and what a request pays for one point.

Model: the small-model section's random 5-layer, 256-wide Llama (float32,
torch.compile'd), where the model's own compute is short and per-step host
work shows (``points_wide``: the same comparison on four layers of a 0.5B
model's width). Workload per round and variant: 24 requests x (48 prompt + 64
generated tokens), fresh random prompts, greedy, ``ignore_eos``. Baseline:
plain requests on an engine started without hidden states. Variants, each on
an engine of its own with ``--hidden-states-points all`` (every layer and
every point of every layer capturable: 5 x 6 capture points): nobody asks;
"last" at one point of each kind (layer 2) on every request, the heads'
outputs (attn_z) included; "last" at an attention pattern (reported, no
target: it recomputes every position of the request). A second plain
engine runs as an A/A control: its ratio to the baseline is the
comparison's resolution on this machine.

Method: all engines live in this process and are stepped in turn, one engine
step each (:func:`benchmarks.common.interleave_steps`), so that every
variant's steps see the same machine; a round's value is a variant's
generated tokens per second of its own steps.

Targets (issue 19): enabled but unused, every point capturable >= 0.99;
"last" at one point of each kind >= 0.97; attn_z within 0.01 of attn_out
(issue 57).
"""

from pathlib import Path

from benchmarks.common import Comparison, StepRun, in_process_engines, interleave_steps
from benchmarks.offline import FreshPrompts
from benchmarks.small_model import (
    ARGS,
    MAX_TOKENS,
    NUM_REQUESTS,
    PROMPT_LEN,
    model_shape,
    small_model,
)

KINDS = ("attn_out", "resid_mid", "mlp_out", "resid_post")
LAYER = 2
BASELINE = "plain vLLM (no hidden states)"
CONTROL = "A/A control: a second plain engine"
NOBODY = "every point capturable, nobody asks"
# KV cache per engine, GiB.
KV_CACHE_GIB = "1"


def run(
    rounds: int,
    quick: bool,
    model: Path | None = None,
    progress=None,
    kinds: tuple[str, ...] = (*KINDS, "attn_z", "attn_pattern"),
) -> list[Comparison]:
    """``kinds``: the point kinds with a "last" variant (``--kinds
    attn_out,attn_z`` on the command line: issue 57's pair alone)."""
    from vllm import LLM, SamplingParams

    model = model or small_model()
    n = NUM_REQUESTS // 2 if quick else NUM_REQUESTS
    prompts = FreshPrompts(n, PROMPT_LEN)

    def params(point: str | None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
        asks = {}
        if point is not None:
            asks = {"return_hidden_states": True, "hidden_states_points": [point]}
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **asks)

    # variant -> (engine arguments, the point its requests ask for)
    every_point = {"enable_hidden_states": True, "hidden_states_points": "all"}
    plan: dict[str, tuple[dict, str | None]] = {
        BASELINE: ({}, None),
        CONTROL: ({}, None),
        NOBODY: (every_point, None),
    }
    for kind in kinds:
        # attn_z: the heads' outputs (issue 57: within 0.01 of attn_out);
        # attn_pattern: one extra prefill of the whole sequence (no KV
        # hand-over) and the weights computed on the device.
        point = f"{kind}.{LAYER}"
        plan[f"last, {point}"] = (every_point, point)

    variants: dict[str, StepRun] = {}
    # Eight engines share the box: this section's KV cache size holds for its
    # engines only, whatever an earlier section set.
    with in_process_engines(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB):
        for name, (engine_args, point) in plan.items():
            llm = LLM(model=str(model), **engine_args, **ARGS)
            llm.generate(prompts(2), params(point, 4), use_tqdm=False)  # compile, caches
            variants[name] = StepRun(llm, params(point), asks=point is not None)

    comparison = Comparison(
        "capture points: every point capturable",
        "generated tok/s",
        baseline=BASELINE,
        notes=(
            f"{model_shape(model)}, --hidden-states-points all, {n} requests x ({PROMPT_LEN} "
            f"prompt + {MAX_TOKENS} generated tokens) per engine and round, fresh prompts; "
            "one engine per variant, all in one process, stepped in turn"
        ),
        targets={
            NOBODY: 0.99,
            **{f"last, {kind}.{LAYER}": 0.97 for kind in kinds if kind != "attn_pattern"},
        },
    )
    interleave_steps(comparison, variants, prompts, rounds, progress)
    for variant in variants.values():
        variant.llm.llm_engine.engine_core.shutdown()
    return [comparison, *heads_against_sum(comparison)]


def heads_against_sum(comparison: Comparison) -> list[Comparison]:
    """Issue 57's target on the same rounds: "last" at attn_z against "last"
    at attn_out, round by round (within 0.01: a ratio >= 0.99)."""
    z, out = f"last, attn_z.{LAYER}", f"last, attn_out.{LAYER}"
    if z not in comparison.samples or out not in comparison.samples:
        return []
    heads = Comparison(
        "per-head outputs against their sum",
        comparison.unit,
        baseline=out,
        notes="the rounds above, paired: attn_z's steps against attn_out's in the same round",
        targets={z: 0.99},
    )
    heads.samples = {out: comparison.samples[out], z: comparison.samples[z]}
    return [heads]


if __name__ == "__main__":
    import argparse
    import functools

    from benchmarks.common import section_main

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--kinds", default=None, help="comma-separated point kinds")
    known, rest = parser.parse_known_args()
    if known.kinds:
        kinds = tuple(known.kinds.split(","))
        section_main(functools.partial(run, kinds=kinds), "points", rest)
    else:
        section_main(run, "points", rest)
