# SPDX-License-Identifier: Apache-2.0
"""Activation patching and SAE splicing (issue 50): what an engine pays for
being able to patch, and what a patched or spliced request pays.

Model: the small-model section's random 5-layer, 256-wide Llama (float32,
torch.compile'd). Workload: 24 requests (12 with ``--quick``) x (48 prompt +
64 generated tokens), fresh random prompts per measurement, greedy,
``ignore_eos``. Baseline: plain requests on an engine started without hidden
states or steering. Variants:

* on an engine with ``enable_steering=True`` and ``max_patch_rows=0`` (the
  default steerable points, ``resid_pre`` of every layer; no patch table, no
  rewrite op): nobody steers;
* on the same engine with the default patch table (2048 rows; the patch op
  at every steerable point): nobody patches; every request patches
  ``resid_pre.2`` over 8 prompt positions with its own rows (inline, float32,
  checked by the front-end in the timed call);
* on an engine with a random top-k SAE (``d_sae`` 1024, k 32) at
  ``blocks.2.hook_resid_pre``: every request splices it over all positions
  with one feature edit.

Target (issue 50): patching enabled, nobody patches >= 0.99 of plain. The
patched and spliced requests' costs are reported without a target. All
engines live in this process and the variants alternate round by round.

Run alone: ``python -m benchmarks.patching [--quick] [--rounds N] [--tiny]``
(writes ``benchmarks/results/patching.json``); in ``make bench``: ``python -m
benchmarks.run --only patching``.
"""

import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Comparison, alternate
from benchmarks.offline import _throughput
from benchmarks.small_model import (
    ARGS,
    MAX_TOKENS,
    small_model,
    small_model_engines,
)

POINT = "resid_pre.2"
ROWS = 8
PLAIN = "plain vLLM (no hidden states)"
NO_TABLE = "steering, max_patch_rows=0, nobody steers"
UNUSED = "patching enabled, nobody patches"
PATCHED = f"patch {POINT} x {ROWS} positions, every request"
SPLICED = "sae_splice (top-k SAE) all positions, every request"


def _run(llm, prompts: list, steering: list[list[dict]] | None, max_tokens: int) -> float:
    """Generated tok/s of one ``generate`` call, request ``i`` with
    ``steering[i % len(steering)]`` (None: plain)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            steering=None if steering is None else steering[i % len(steering)],
        )
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


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
    from vllm import LLM
    from vllm_hidden_states.sae import random_sae, save_sae

    model = model or small_model()
    n, prompts, plain, patching = small_model_engines(
        quick, model, tiny, enable_hidden_states=False, enable_steering=True
    )
    max_tokens = 4 if tiny else MAX_TOKENS
    args = dict(ARGS, enforce_eager=True) if tiny else ARGS
    no_table = LLM(model=str(model), enable_steering=True, max_patch_rows=0, **args)
    width = patching.llm_engine.vllm_config.model_config.get_hidden_size()
    sae_dir = Path(tempfile.mkdtemp(prefix="patching-bench-sae-"))
    weights, cfg = random_sae(width, 1024, f"blocks.{POINT.split('.')[1]}.hook_resid_pre",
                              "topk", seed=5, k=32)  # fmt: skip
    save_sae(sae_dir, weights, cfg)
    splicing = LLM(
        model=str(model), enable_steering=True, sae=str(sae_dir), max_patch_rows=0, **args
    )
    own = patches(n, width, seed=50)
    splice = [[{"op": "sae_splice", "edits": [{"feature": 3, "set": 5.0}]}]]
    for llm, steering in ((no_table, None), (patching, own), (splicing, splice)):
        _run(llm, prompts(2), steering, max_tokens=4)  # warm-up
    check = prompts(2)
    if _tokens(patching, check, own[0]) == _tokens(patching, check, None):
        raise RuntimeError("patching check: the patch left the greedy tokens unchanged")

    comparison = Comparison(
        "patching: activation patching and SAE splicing",
        "generated tok/s",
        baseline=PLAIN,
        notes=(
            f"5 x 256 Llama, {n} requests x ({prompts.length} prompt + {max_tokens} "
            f"generated tokens), fresh prompts; patch rows inline (float32, {ROWS} x "
            f"{width}); splice: random top-k SAE, d_sae 1024, k 32, at {POINT}"
        ),
        targets={UNUSED: 0.99},
    )
    alternate(
        comparison,
        {
            PLAIN: lambda: _throughput(plain, prompts(), max_tokens=max_tokens),
            NO_TABLE: lambda: _run(no_table, prompts(), None, max_tokens),
            UNUSED: lambda: _run(patching, prompts(), None, max_tokens),
            PATCHED: lambda: _run(patching, prompts(), own, max_tokens),
            SPLICED: lambda: _run(splicing, prompts(), splice, max_tokens),
        },
        rounds,
        progress,
    )
    for llm in (plain, no_table, patching, splicing):
        llm.llm_engine.engine_core.shutdown()
    return [comparison]


def _tokens(llm, prompts: list, steering: list[dict] | None) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, steering=steering)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "patching")
