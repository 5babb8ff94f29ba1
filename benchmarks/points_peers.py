# SPDX-License-Identifier: Apache-2.0
"""Capture points against peers (issue 19): the same points on the same
prompts, ours and what a user would pick instead, each checked before it is
timed.

Throughput ratios **ours / peer** (median of per-round ratios; round 0 warms
up and is not recorded) on the small-model section's random 5-layer, 256-wide
Llama (:func:`benchmarks.small_model.small_model`, float32; ``--model`` for
another HF Llama-style checkpoint). Workload, per round: 8 fresh prompts of
random token ids (equal length, 64 tokens with ``--quick``, else 128: no
padding anywhere), every prompt position at three TransformerLens / SAELens
points of layer 2: ``attn_out.2`` (the attention block's output, added to the
residual stream; Llama: ``self_attn``'s output), ``resid_mid.2`` (=
``resid_pre.2 + attn_out.2``: the input of ``post_attention_layernorm``) and
``mlp_out.2`` (the MLP's output). Unit: sequences/s (8 / wall time of one
call that returns the 3 x ``[prompt_len, hidden]`` float32 arrays of all 8
prompts on the host).

Variants (every one handed all 8 prompts at once, as one call):

* ``ours``: the offline ``LLM(enable_hidden_states=True,
  hidden_states_points="attn_out,resid_mid,mlp_out", enforce_eager=False)``
  in this process, ``SamplingParams(max_tokens=1, return_hidden_states=True,
  hidden_states_points=[...], hidden_states_positions="prompt")``, one
  ``generate`` call.
* ``HF 1 core``: transformers ``AutoModelForCausalLM`` with forward hooks on
  ``layers[2].self_attn`` (output), ``post_attention_layernorm`` (input) and
  ``mlp`` (output), one batched forward; one torch thread pinned to the core
  vLLM's CPU worker is bound to (the terms of :mod:`benchmarks.peers`).
* ``nnsight 1 core``: ``nnsight.LanguageModel`` around that same HF model
  object, ``with model.trace(ids):`` saving ``self_attn.output[0]``,
  ``post_attention_layernorm.input`` and ``mlp.output``; same thread, core.
* ``interp-engine eager 1 core``: interp-engine's eager backend (plain
  ``pip install interp-engine``, no vLLM extra),
  ``load_model(DIR, backend="eager", device=..., dtype="float32",
  attn_implementation=<HF's>)`` and ``capture(model, ids, ["attn_out.2",
  "resid_mid.2", "mlp_out.2"])``; its own copy of the weights, loaded from the
  same directory; same thread, core. ``attn_implementation`` is set to the
  HF peer's (``sdpa``) so all in-process peers run the same attention kernel
  (interp-engine's own default is ``eager``, for ``attn_probs``, which this
  workload does not read).

Values are checked before anything is timed, on prompts no timed round uses:
HF's hooked forward is the reference, itself checked for consistency with its
``output_hidden_states`` (``resid_mid.2 == hidden_states[2] + attn_out.2``,
``hidden_states[3] == resid_mid.2 + mlp_out.2``); ours and each peer must agree
with it, ``max|diff| / max|ref|`` < ``AGREE_TOL`` (float32) at every point. A
peer that disagrees, fails to set up or fails on the workload is reported
``n/a`` with the reason (the exact error), not timed; if ours disagrees,
nothing is timed. Each timed call follows ``SETTLE_S`` seconds of idle (vLLM's
worker spins for 1 s after its last step, on the core the peers are pinned
to).

Run alone: ``python -m benchmarks.points_peers [--quick] [--rounds N]
[--model DIR]``.
"""

import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Comparison
from benchmarks.peers import (
    AGREE_TOL,
    ENGINE_ARGS,
    HF,
    NNSIGHT,
    OURS,
    HFPeer,
    Ours,
    machine_terms,
    one_line,
    peer_comparisons,
    peer_versions,
    rel_diff,
    setup_peers,
    time_rounds,
    worker_cpu,
)
from benchmarks.small_model import small_model

INTERP_ENGINE = "interp-engine eager 1 core"
KINDS = ("attn_out", "resid_mid", "mlp_out")
LAYER = 2
POINTS = [f"{kind}.{LAYER}" for kind in KINDS]
N_PROMPTS = 8

# One call's result: per prompt, {point: [prompt_len, hidden]} float32.
PointsOut = list[dict[str, np.ndarray]]


def random_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (no BOS, no special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


# --------------------------------------------------------------------------
# variants


class OursPoints(Ours):
    """Ours with the three point kinds capturable at every layer."""

    def __init__(self, model: Path):
        from vllm import LLM

        self.llm = LLM(
            model=str(model),
            enable_hidden_states=True,
            hidden_states_points=",".join(KINDS),
            **dict(ENGINE_ARGS, enforce_eager=False, max_model_len=512),
        )

    def points(self, prompts: list[list[int]]) -> PointsOut:
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            return_hidden_states=True,
            hidden_states_points=POINTS,
            hidden_states_positions="prompt",
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [{a: o.outputs[0].hidden_states[a].float().numpy() for a in POINTS} for o in outs]


def hooked_forward(model, ids, hidden_states: bool = False) -> tuple[dict[str, Any], Any]:
    """One forward of an HF Llama-style model with forward hooks on layer
    ``LAYER``'s own modules: ``{point: [batch, seq, hidden]}`` and the model
    output (``output_hidden_states`` when asked)."""
    found: dict[str, Any] = {}
    layer = model.model.layers[LAYER]

    def output_of(name: str):
        def hook(module, args, output):
            found[name] = output[0] if isinstance(output, tuple) else output

        return hook

    def input_of(name: str):
        def hook(module, args):
            found[name] = args[0].clone()

        return hook

    handles = [
        layer.self_attn.register_forward_hook(output_of(f"attn_out.{LAYER}")),
        layer.post_attention_layernorm.register_forward_pre_hook(input_of(f"resid_mid.{LAYER}")),
        layer.mlp.register_forward_hook(output_of(f"mlp_out.{LAYER}")),
    ]
    try:
        out = model(ids, output_hidden_states=hidden_states)
    finally:
        for h in handles:
            h.remove()
    return found, out


def per_prompt(batched: dict[str, Any], n: int) -> PointsOut:
    return [{a: batched[a][i].float().cpu().numpy() for a in POINTS} for i in range(n)]


class HFPoints:
    """The HF peer (:class:`benchmarks.peers.HFPeer`: model, device, pinning)
    read through forward hooks."""

    def __init__(self, hf: HFPeer):
        self.hf = hf

    def points(self, prompts: list[list[int]]) -> PointsOut:
        torch = self.hf.torch
        ids = torch.tensor(prompts, device=self.hf.device)
        with self.hf._pin(), torch.inference_mode():
            found, _ = hooked_forward(self.hf.model, ids)
        return per_prompt(found, len(prompts))

    def reference(self, prompts: list[list[int]]) -> tuple[PointsOut, dict[str, float]]:
        """The points, and how well they compose with HF's own
        ``output_hidden_states`` (max|diff|/max|ref|)."""
        torch = self.hf.torch
        ids = torch.tensor(prompts, device=self.hf.device)
        with self.hf._pin(), torch.inference_mode():
            found, out = hooked_forward(self.hf.model, ids, hidden_states=True)
        hs = [h.float().cpu().numpy() for h in out.hidden_states]
        got = {a: found[a].float().cpu().numpy() for a in POINTS}
        attn, mid, mlp = (got[f"{k}.{LAYER}"] for k in KINDS)
        consistency = {
            f"resid_mid.{LAYER} vs hidden_states[{LAYER}] + attn_out.{LAYER}": rel_diff(
                hs[LAYER] + attn, mid
            ),
            f"hidden_states[{LAYER + 1}] vs resid_mid.{LAYER} + mlp_out.{LAYER}": rel_diff(
                mid + mlp, hs[LAYER + 1]
            ),
        }
        return per_prompt(found, len(prompts)), consistency


class NNsightPoints:
    """``nnsight.LanguageModel`` around the HF peer's model object."""

    def __init__(self, hf: HFPeer):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from nnsight import LanguageModel

            self.lm = LanguageModel(hf.model, tokenizer=hf.tokenizer)
        self.hf = hf

    def points(self, prompts: list[list[int]]) -> PointsOut:
        torch = self.hf.torch
        ids = torch.tensor(prompts, device=self.hf.device)
        box: dict[str, Any] = {}  # nnsight runs the block's code in its own frame
        with self.hf._pin(), torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.lm.trace(ids):
                layer = self.lm.model.layers[LAYER]  # saved in execution order
                box[f"attn_out.{LAYER}"] = layer.self_attn.output[0].save()
                box[f"resid_mid.{LAYER}"] = layer.post_attention_layernorm.input.save()
                box[f"mlp_out.{LAYER}"] = layer.mlp.output.save()
        return per_prompt(box, len(prompts))


class InterpEnginePoints:
    """interp-engine's eager backend: its documented ``load_model`` +
    ``capture`` over the same checkpoint, on the HF peer's device and terms."""

    def __init__(self, model: Path, hf: HFPeer):
        import interp_engine
        from interp_engine import capture, load_model

        self.version = interp_engine.__version__
        self.capture = capture
        self.attn_implementation = hf.model.config._attn_implementation
        self.model = load_model(
            str(model),
            backend="eager",
            device=hf.device,
            dtype="float32",
            attn_implementation=self.attn_implementation,
        )
        self.hf = hf

    def points(self, prompts: list[list[int]]) -> PointsOut:
        torch = self.hf.torch
        ids = torch.tensor(prompts, device=self.hf.device)
        with self.hf._pin():
            cache = self.capture(self.model, ids, POINTS)
        return per_prompt({a: cache[a] for a in POINTS}, len(prompts))


# --------------------------------------------------------------------------
# checks and timing


def agreement(got: PointsOut, ref: PointsOut) -> tuple[dict[str, float], str | None]:
    """Per point, the worst max|diff|/max|ref| over the prompts, and why the
    values do not agree (None when they do)."""
    worst = {a: max(rel_diff(g[a], r[a]) for g, r in zip(got, ref)) for a in POINTS}
    bad = {a: w for a, w in worst.items() if not w < AGREE_TOL}
    if len(got) != len(ref):
        return worst, f"{len(got)} prompts came back for {len(ref)}"
    if bad:
        shapes = {a: (got[0][a].shape, ref[0][a].shape) for a in bad}
        return worst, (
            "values differ from HF: "
            + ", ".join(f"{a} max|diff|/max|ref| = {w:.2e}" for a, w in bad.items())
            + f" (shapes peer vs HF: {shapes})"
        )
    return worst, None


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list[Comparison]:
    """Ours and each peer on the same prompts; one :class:`PeerComparison`
    per peer with the peer as baseline, so each ratio is ours / peer."""
    import psutil
    from transformers import AutoConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = Path(model) if model is not None else small_model()
    prompt_len = 64 if quick else 128
    vocab = AutoConfig.from_pretrained(model).vocab_size

    def prompts(r: int) -> list[list[int]]:
        return random_prompts(N_PROMPTS, prompt_len, seed=1900 + r, vocab=vocab)

    others = {c.pid for c in psutil.Process().children(recursive=True)}
    ours = OursPoints(model)
    try:
        binding, worker_cpus, cpu = worker_cpu(ours, others)
        hf = HFPeer(model, cpu)
        ref_peer = HFPoints(hf)
        peers: dict[str, Any] = {HF: ref_peer}
        setup_errors = setup_peers(
            peers,
            [
                (NNSIGHT, lambda: NNsightPoints(hf)),
                (INTERP_ENGINE, lambda: InterpEnginePoints(model, hf)),
            ],
        )

        # values first, on prompts no timed round uses
        check = prompts(-1)
        ref, consistency = ref_peer.reference(check)
        unavailable = dict(setup_errors)
        agree: dict[str, dict[str, float]] = {}
        ours_bad = None
        bad_ref = {k: v for k, v in consistency.items() if not v < AGREE_TOL}
        if bad_ref:
            ours_bad = f"HF's hooked points do not compose with its hidden_states: {bad_ref}"
        else:
            worst, ours_bad = agreement(ours.points(check), ref)
            agree[OURS] = worst
        for name, p in peers.items():
            if ours_bad is not None:
                break
            try:
                got = p.points(check)
            except Exception as e:  # noqa: BLE001 - any failure is the peer's result
                unavailable[name] = f"failed on this workload: {one_line(e)}"
                continue
            worst, bad = agreement(got, ref)
            if bad:
                unavailable[name] = f"not timed: {bad}"
            else:
                agree[name] = worst
        active = {n: p for n, p in peers.items() if n in agree} if ours_bad is None else {}

        variants = {OURS: ours, **active} if ours_bad is None else {}

        def sequences(name: str, inputs: list[list[int]], out: PointsOut) -> float:
            if len(out) != len(inputs):
                raise RuntimeError(f"{name}: {len(out)} results for {len(inputs)} prompts")
            return len(inputs)

        samples = time_rounds(
            variants,
            rounds,
            prompts,
            lambda p, ids: p.points(ids),
            sequences,
            "points_peers",
            progress,
        )
    finally:
        ours.shutdown()

    terms, machine = machine_terms(binding, worker_cpus, cpu, hf)
    workload = (
        f"{', '.join(POINTS)}, every prompt position, {N_PROMPTS} x {prompt_len}-token "
        f"random prompts, one call"
    )
    extra = {
        "workload": workload,
        "points": POINTS,
        "prompts": N_PROMPTS,
        "prompt_len": prompt_len,
        "model": str(model),
        "reference": "HF forward hooks",
        "reference_consistency": consistency,
        "agreement_vs_hf": agree,
        "versions": peer_versions(),
        "machine_terms": machine,
    }

    def notes(peer: str) -> str:
        checked = f"{peer} {max(agree[peer].values()):.1e}" if peer != HF else "HF = reference"
        return (
            f"ratio = ours / {peer}; values checked against HF before timing "
            f"(max|diff|/max|ref|): ours {max(agree[OURS].values()):.1e}, {checked}; {terms}"
        )

    comparisons = peer_comparisons(
        f"points peers: {workload}",
        "seq/s",
        extra,
        (HF, NNSIGHT, INTERP_ENGINE),
        ours_bad,
        active,
        samples,
        unavailable,
        notes,
    )
    print(
        "points_peers: HF reference consistency "
        + ", ".join(f"{k}: {v:.1e}" for k, v in consistency.items()),
        file=sys.stderr,
    )
    return comparisons


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "points_peers")
