# SPDX-License-Identifier: Apache-2.0
"""Probes served inline (issue 51): what an engine pays for loading probes,
what a request pays for a probe's score on every generated token, and what
crosses the host link per token.

Model: the small-model section's random 5-layer, 256-wide Llama (float32,
torch.compile'd), where per-step host work shows. Workload: 24 requests (12
with ``--quick``) x (48 prompt + 64 generated tokens), fresh random prompts
per measurement, greedy, ``ignore_eos``. Baseline: plain requests on an
engine started without hidden states. Variants, on one engine started with
``probes=DIR`` (one random logistic probe, ``k = 1``, sigmoid, normalised,
reading HF layer 2 = ``resid_pre.2``):

* nobody asks a probe;
* every request asks the probe on every generated token
  (``probes=["probe"]``, ``hidden_states_positions="generated"``);
* every request asks ``return_hidden_states`` at the same point on every
  generated token (``hidden_states_layers=[2]``), for comparison.

The variants alternate round by round (:func:`benchmarks.common.alternate`).
Payload: bytes per generated token of what the worker hands the host and
the front-end hands the caller: ``probe_scores`` (``k`` float32) vs
``hidden_states`` (``hidden_size`` values in the model dtype), read off the
outputs of the same rounds.

Targets (issue 51): nobody asks >= 0.99 of plain; one probe on every
generated token >= 0.98.

Run alone: ``python -m benchmarks.probes [--quick] [--rounds N] [--model
DIR] [--tiny]``; in ``make bench``: ``python -m benchmarks.run --only probes``.
"""

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Comparison, alternate
from benchmarks.small_model import MAX_TOKENS, small_model, small_model_engines

LAYER = 2
PROBE = "probe"
PLAIN = "plain vLLM (no hidden states)"
UNUSED = "probes loaded, nobody asks"
ONE = "one probe, every generated token"
STATES = f"return_hidden_states layer {LAYER}, every generated token"


def write_probe(directory: Path, hidden_size: int) -> Path:
    """One random probe at HF layer :data:`LAYER` (seeded)."""
    from vllm_hidden_states.probes import save_probe

    rng = np.random.default_rng(51)
    save_probe(
        directory / f"{PROBE}.safetensors",
        rng.standard_normal(hidden_size) / np.sqrt(hidden_size),
        [0.1],
        str(LAYER),
        "sigmoid",
        mean=rng.standard_normal(hidden_size) * 0.1,
        scale=rng.uniform(0.5, 2.0, hidden_size),
    )
    return directory


def _generate(llm, prompts, max_tokens: int, sizes: dict | None = None, **fields) -> float:
    """Generated tok/s of one ``generate`` call; ``sizes``: add the bytes per
    generated token of the answer's ``probe_scores`` / ``hidden_states``."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    if fields.get("probes"):
        assert all(o.outputs[0].probe_scores is not None for o in outs)
        assert all(o.outputs[0].hidden_states is None for o in outs)  # no vectors travel
    if sizes is not None:
        for o in outs:
            c = o.outputs[0]
            fields = (("probe_scores", c.probe_scores), ("hidden_states", c.hidden_states))
            for name, field in fields:
                if field:
                    rows = next(iter(field.values()))
                    per = sum(t.nbytes for t in field.values()) / rows.shape[0]
                    sizes.setdefault(name, []).append(per)
    return generated / elapsed


def run(
    rounds: int, quick: bool, model: Path | None = None, progress=None, tiny: bool = False
) -> list[Comparison]:
    model = Path(model or small_model())
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    probes_dir = write_probe(work / "probes", hidden)
    max_tokens = 4 if tiny else MAX_TOKENS
    try:
        n, prompts, plain, probed = small_model_engines(quick, model, tiny, probes=str(probes_dir))
        _generate(probed, prompts(2), 4, probes=[PROBE], hidden_states_positions="generated")
        sizes: dict[str, list[float]] = {}
        comparison = Comparison(
            "probes: a linear probe's score per generated token",
            "generated tok/s",
            baseline=PLAIN,
            notes=(
                f"5 x 256 Llama, {n} requests x ({prompts.length} prompt + {max_tokens} "
                f"generated tokens), fresh prompts; one probe (k = 1, sigmoid, "
                f"normalised) at HF layer {LAYER}; positions 'generated'"
            ),
            targets={UNUSED: 0.99, ONE: 0.98},
        )
        alternate(
            comparison,
            {
                PLAIN: lambda: _generate(plain, prompts(), max_tokens),
                UNUSED: lambda: _generate(probed, prompts(), max_tokens),
                ONE: lambda: _generate(
                    probed,
                    prompts(),
                    max_tokens,
                    sizes,
                    probes=[PROBE],
                    hidden_states_positions="generated",
                ),
                STATES: lambda: _generate(
                    probed,
                    prompts(),
                    max_tokens,
                    sizes,
                    return_hidden_states=True,
                    hidden_states_layers=[LAYER],
                    hidden_states_positions="generated",
                ),
            },
            rounds,
            progress,
        )
        payload = Comparison(
            "probes: bytes per generated token handed back (same rounds)",
            "bytes/position",
            baseline="hidden_states",
            higher_is_better=False,
            notes=(
                f"probe_scores: k = 1 float32; hidden_states: layer {LAYER}, "
                f"{hidden} float32 values (the engine's dtype)"
            ),
        )
        for name in ("hidden_states", "probe_scores"):
            payload.add(name, float(np.mean(sizes[name])))  # the same for every output
        for llm in (plain, probed):
            llm.llm_engine.engine_core.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [comparison, payload]


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "probes")
