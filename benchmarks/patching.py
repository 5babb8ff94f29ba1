# SPDX-License-Identifier: Apache-2.0
"""Activation patching and SAE splicing (issues 50, 55): what an engine pays
for being able to steer and patch, and what a patched or spliced request pays.

Model: the small-model section's random 5-layer, 256-wide Llama (float32,
torch.compile'd). Workload per round and variant: 24 requests (12 with
``--quick``) x (48 prompt + 64 generated tokens), fresh random prompts,
greedy, ``ignore_eos``. Baseline: plain requests on an engine started without
hidden states or steering; a second plain engine runs as an A/A control.
Variants, each on an engine of its own:

* ``enable_steering=True``, ``max_patch_rows=0`` (the default steerable
  points, ``resid_pre`` of every layer; no patch table, no rewrite op):
  nobody steers;
* ``enable_steering=True`` with the default patch table (2048 rows; the
  patch op at every steerable point): nobody patches;
* the same engine flags, every request patching ``resid_pre.2`` over 8 prompt
  positions with its own rows (inline, float32; the front-end checks them
  when the request is added, outside the timed steps);
* a random top-k SAE (``d_sae`` 1024, k 32) at ``blocks.2.hook_resid_pre``:
  every request splices it over all positions with one feature edit.

Method: all engines live in this process and are stepped in turn, one
engine step each (:func:`benchmarks.common.interleave_steps`).

Targets (issue 55): steering or patching enabled with nobody using it >= 0.99
of plain; a patch over 8 positions of every request >= 0.98; a splice on
every token >= 0.90.

Run alone: ``python -m benchmarks.patching [--quick] [--rounds N] [--tiny]``
(writes ``benchmarks/results/patching.json``); in ``make bench``: ``python -m
benchmarks.run --only patching``.
"""

import json
import tempfile
from pathlib import Path

import numpy as np

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

POINT = "resid_pre.2"
ROWS = 8
PLAIN = "plain vLLM (no hidden states)"
CONTROL = "A/A control: a second plain engine"
NO_TABLE = "steering, max_patch_rows=0, nobody steers"
UNUSED = "patching enabled, nobody patches"
PATCHED = f"patch {POINT} x {ROWS} positions, every request"
SPLICED = "sae_splice (top-k SAE) all positions, every request"
KV_CACHE_GIB = "1"


def patches(n: int, width: int, seed: int) -> list[list[dict]]:
    """``n`` patches of ``ROWS`` random rows each at :data:`POINT`, positions
    4 .. 4 + ROWS - 1."""
    rng = np.random.default_rng(seed)
    return [
        [
            {
                "point": POINT,
                "op": "patch",
                "rows": rng.standard_normal((ROWS, width)).astype(np.float32),
                "positions": {"start": 4, "end": 4 + ROWS},
            }
        ]
        for _ in range(n)
    ]


def run(
    rounds: int, quick: bool, model: Path | None = None, progress=None, tiny: bool = False
) -> list[Comparison]:
    from vllm import LLM, SamplingParams
    from vllm_hidden_states.sae import random_sae, save_sae

    model = Path(model or small_model())
    width = json.loads((model / "config.json").read_text())["hidden_size"]
    n = 2 if tiny else NUM_REQUESTS // 2 if quick else NUM_REQUESTS
    prompts = FreshPrompts(n, 8 if tiny else PROMPT_LEN)
    max_tokens = 4 if tiny else MAX_TOKENS
    args = dict(ARGS, enforce_eager=True) if tiny else ARGS
    sae_dir = Path(tempfile.mkdtemp(prefix="patching-bench-sae-"))
    weights, cfg = random_sae(width, 1024, f"blocks.{POINT.split('.')[1]}.hook_resid_pre",
                              "topk", seed=5, k=32)  # fmt: skip
    save_sae(sae_dir, weights, cfg)

    def params(steering: list[dict] | None, max_tokens: int = max_tokens) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, steering=steering
        )

    own = patches(n, width, seed=50)
    splice = [{"op": "sae_splice", "edits": [{"feature": 3, "set": 5.0}]}]
    steerable = {"enable_steering": True}
    plan: dict[str, tuple[dict, list[list[dict] | None]]] = {
        PLAIN: ({}, [None]),
        CONTROL: ({}, [None]),
        NO_TABLE: ({**steerable, "max_patch_rows": 0}, [None]),
        UNUSED: (steerable, [None]),
        PATCHED: (steerable, own),
        SPLICED: ({**steerable, "sae": str(sae_dir), "max_patch_rows": 0}, [splice]),
    }
    variants: dict[str, StepRun] = {}
    with in_process_engines(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB):
        for name, (engine_args, steering) in plan.items():
            llm = LLM(model=str(model), **engine_args, **args)
            llm.generate(prompts(2), params(steering[0], 4), use_tqdm=False)  # compile, caches
            variants[name] = StepRun(llm, [params(s) for s in steering])
    check = prompts(2)
    patched = variants[PATCHED].llm
    if _tokens(patched, check, own[0]) == _tokens(patched, check, None):
        raise RuntimeError("patching check: the patch left the greedy tokens unchanged")

    comparison = Comparison(
        "patching: activation patching and SAE splicing",
        "generated tok/s",
        baseline=PLAIN,
        notes=(
            f"{model_shape(model)}, {n} requests x ({prompts.length} prompt + {max_tokens} "
            f"generated tokens) per engine and round, fresh prompts; patch rows inline "
            f"(float32, {ROWS} x {width}); splice: random top-k SAE, d_sae 1024, k 32, at "
            f"{POINT}; one engine per variant, all in one process, stepped in turn"
        ),
        targets={NO_TABLE: 0.99, UNUSED: 0.99, PATCHED: 0.98, SPLICED: 0.90},
    )
    interleave_steps(comparison, variants, prompts, rounds, progress)
    for variant in variants.values():
        variant.llm.llm_engine.engine_core.shutdown()
    return [comparison]


def _tokens(llm, prompts: list, steering: list[dict] | None) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, steering=steering)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "patching")
