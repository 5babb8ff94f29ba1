# SPDX-License-Identifier: Apache-2.0
"""Steering against peers (issue 20): the same intervention on the same
prompts, ours and what a user would pick instead, each checked before it is
timed.

Throughput ratios **ours / peer** (median of per-round ratios; round 0 warms
up and is not recorded) on the small-model section's random 5-layer, 256-wide
Llama (:func:`benchmarks.small_model.small_model`, float32; ``--model`` for
another HF Llama-style checkpoint). Workload, per round: 8 fresh prompts of
random token ids (equal length, 32 tokens with ``--quick``, else 64: no
padding anywhere), greedy generation of 16 (``--quick``) or 32 tokens each,
EOS ignored, every forward steered: ``add`` of ``STRENGTH`` x one unit vector
(seeded, the same for every peer) to the residual stream entering decoder
layer 2 (``resid_pre.2``), at every position, prompt and generated. Unit:
generated tokens/s (8 x tokens / wall time of one call that returns the
token ids of all 8 prompts).

Variants:

* ``ours``: the offline ``LLM(enable_steering=True, enforce_eager=False)``
  (default steerable points: ``resid_pre`` of every layer; no hidden states)
  in this process, one ``generate`` call of the 8 prompts with
  ``SamplingParams(steering=[{"point": "resid_pre.2", "op": "add", "vector":
  [...], "strength": STRENGTH, "positions": "all"}])``, the vector inline.
* ``HF 1 core``: transformers ``AutoModelForCausalLM.generate`` on the batch,
  with a forward pre-hook on ``model.layers[2]`` returning its input plus
  ``STRENGTH * v``; one torch thread pinned to the core vLLM's CPU worker is
  bound to (the terms of :mod:`benchmarks.peers`).
* ``nnsight 1 core``: ``nnsight.LanguageModel`` around that same HF model
  object, ``with model.generate(ids, ...) as tracer: for _ in
  tracer.iter[:n]: layers[2].input = layers[2].input + STRENGTH * v``; same
  thread, core.
* ``interp-engine eager 1 core``: interp-engine's eager backend (plain ``pip
  install interp-engine``), ``load_model(DIR, backend="eager", device=...,
  dtype="float32", attn_implementation=<HF's>)``, ``with steer(model,
  SteeringSpec(layers={2: LayerSteeringSpec([AddSpec(v, STRENGTH)])},
  point="resid_pre")):`` and its generation loop ``generate_stream(model,
  ids, max_tokens=n, temperature=0.0, presence_penalty=0.0,
  stop_at_eos=False)``, which takes one prompt at a time (its eager loop is
  batch 1), so the 8 prompts run one after another; its own copy of the
  weights, loaded from the same directory; same thread, core.

Checks before anything is timed, on prompts no timed round uses: HF with
the hook is the reference. It must be able to tell: its steered greedy tokens
must differ from its unsteered ones, and from those of the vector added to
the prompt positions only (a peer that did not steer its decode steps would
be caught). Ours and each peer must then produce HF's steered greedy tokens
exactly, for every prompt. A peer that disagrees, fails to set up or fails on
the workload is reported ``n/a`` with the reason (the exact error), not
timed; if ours disagrees, nothing is timed. Each timed call follows
``SETTLE_S`` seconds of idle (vLLM's worker spins for 1 s after its last
step, on the core the peers are pinned to).

Run alone: ``python -m benchmarks.steering_peers [--quick] [--rounds N]
[--model DIR]`` (writes ``benchmarks/results/steering_peers.json``).
"""

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from benchmarks.common import Comparison
from benchmarks.peers import (
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
    setup_peers,
    time_rounds,
    worker_cpu,
)
from benchmarks.points_peers import random_prompts
from benchmarks.small_model import small_model

INTERP_ENGINE = "interp-engine eager 1 core"
LAYER = 2
POINT = f"resid_pre.{LAYER}"
STRENGTH = 4.0
N_PROMPTS = 8
VECTOR_SEED = 2020

Tokens = list[list[int]]  # per prompt, the generated token ids


def unit_vector(width: int, seed: int = VECTOR_SEED):
    """A random unit vector, float32 ``[width]`` (torch)."""
    import torch

    v = torch.randn(width, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return v / v.norm()


# --------------------------------------------------------------------------
# variants


class OursSteering(Ours):
    """Ours with steering enabled (default steerable points), no hidden states."""

    def __init__(self, model: Path, vector):
        from vllm import LLM

        self.llm = LLM(
            model=str(model),
            enable_steering=True,
            **dict(ENGINE_ARGS, enforce_eager=False, max_model_len=512),
        )
        self.steering = [
            {
                "point": POINT,
                "op": "add",
                "vector": vector.tolist(),
                "strength": STRENGTH,
                "positions": "all",
            }
        ]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Tokens:
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, steering=self.steering
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HFSteering:
    """The HF peer (:class:`benchmarks.peers.HFPeer`: model, device, pinning)
    steered by a forward pre-hook on decoder layer ``LAYER``."""

    def __init__(self, hf: HFPeer, vector):
        self.hf = hf
        self.delta = (STRENGTH * vector).to(hf.device)

    def generate(self, prompts: list[list[int]], max_tokens: int, steer: str = "all") -> Tokens:
        """``steer``: "all" (every forward), "prompt" (the prefill only: the
        check's control), "none"."""
        torch = self.hf.torch
        ids = torch.tensor(prompts, device=self.hf.device)
        delta = self.delta

        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if steer == "prompt" and x.shape[1] == 1:
                return None
            if args:
                return (x + delta, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x + delta}

        layer = self.hf.model.model.layers[LAYER]
        handle = None
        if steer != "none":
            handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with self.hf._pin(), torch.inference_mode():
                seq = self.hf.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=self.hf.config_for(max_tokens, as_dict=False),
                )
        finally:
            if handle is not None:
                handle.remove()
        return seq[:, ids.shape[1] :].tolist()


class NNsightSteering:
    """``nnsight.LanguageModel`` around the HF peer's model object, the layer
    input edited at every generation step."""

    def __init__(self, hf: HFPeer, vector):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from nnsight import LanguageModel

            self.lm = LanguageModel(hf.model, tokenizer=hf.tokenizer)
        self.hf = hf
        self.delta = (STRENGTH * vector).to(hf.device)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Tokens:
        torch = self.hf.torch
        ids = torch.tensor(prompts, device=self.hf.device)
        delta = self.delta
        box: dict[str, Any] = {}  # nnsight runs the block's code in its own frame
        with self.hf._pin(), torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.lm.generate(
                ids, generation_config=self.hf.config_for(max_tokens, False)
            ) as tracer:
                layer = self.lm.model.layers[LAYER]
                for _ in tracer.iter[:max_tokens]:  # one forward per generated token
                    layer.input = layer.input + delta
                box["seq"] = tracer.result.save()
        return box["seq"][:, ids.shape[1] :].tolist()


class InterpEngineSteering:
    """interp-engine's eager backend: its documented ``steer`` context around
    its generation loop, over the same checkpoint, on the HF peer's device
    and terms."""

    def __init__(self, model: Path, hf: HFPeer, vector):
        import interp_engine
        from interp_engine import (
            AddSpec,
            LayerSteeringSpec,
            SteeringSpec,
            generate_stream,
            load_model,
            steer,
        )

        self.version = interp_engine.__version__
        self.generate_stream, self.steer = generate_stream, steer
        self.model = load_model(
            str(model),
            backend="eager",
            device=hf.device,
            dtype="float32",
            attn_implementation=hf.model.config._attn_implementation,
        )
        self.spec = SteeringSpec(
            layers={LAYER: LayerSteeringSpec(operations=[AddSpec(vector=vector, scale=STRENGTH)])},
            point="resid_pre",
        )
        self.hf = hf

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Tokens:
        torch = self.hf.torch
        out = []
        with self.hf._pin(), self.steer(self.model, self.spec):
            for p in prompts:  # its eager generation loop is batch 1
                steps = self.generate_stream(
                    self.model,
                    torch.tensor([p], device=self.hf.device),
                    max_tokens=max_tokens,
                    temperature=0.0,
                    presence_penalty=0.0,
                    stop_at_eos=False,
                )
                out.append([s.token_id for s in steps])
        return out


# --------------------------------------------------------------------------
# checks and timing


def mismatch(got: Tokens, ref: Tokens) -> str | None:
    """Why ``got`` is not ``ref`` (None when they are equal)."""
    if len(got) != len(ref):
        return f"{len(got)} prompts came back for {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            if len(g) != len(r):
                return f"prompt {i}: {len(g)} tokens, HF {len(r)}"
            j = next(k for k, (a, b) in enumerate(zip(g, r)) if a != b)
            return f"prompt {i} token {j}: {g[j]} vs HF's {r[j]} (greedy, steered)"
    return None


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list[Comparison]:
    """Ours and each peer on the same prompts; one :class:`PeerComparison`
    per peer with the peer as baseline, so each ratio is ours / peer."""
    import psutil
    from transformers import AutoConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = Path(model) if model is not None else small_model()
    prompt_len, max_tokens = (32, 16) if quick else (64, 32)
    config = AutoConfig.from_pretrained(model)
    vector = unit_vector(config.hidden_size)

    def prompts(r: int) -> list[list[int]]:
        return random_prompts(N_PROMPTS, prompt_len, seed=2000 + r, vocab=config.vocab_size)

    others = {c.pid for c in psutil.Process().children(recursive=True)}
    ours = OursSteering(model, vector)
    try:
        binding, worker_cpus, cpu = worker_cpu(ours, others)
        hf = HFPeer(model, cpu)
        ref_peer = HFSteering(hf, vector)
        peers: dict[str, Any] = {HF: ref_peer}
        setup_errors = setup_peers(
            peers,
            [
                (NNSIGHT, lambda: NNsightSteering(hf, vector)),
                (INTERP_ENGINE, lambda: InterpEngineSteering(model, hf, vector)),
            ],
        )

        # values first, on prompts no timed round uses
        check = prompts(-1)
        ref = ref_peer.generate(check, max_tokens)
        control = {
            "unsteered": ref_peer.generate(check, max_tokens, steer="none"),
            "prompt positions only": ref_peer.generate(check, max_tokens, steer="prompt"),
        }
        power = {k: sum(a != b for a, b in zip(v, ref)) for k, v in control.items()}
        unavailable = dict(setup_errors)
        agreed: list[str] = []
        ours_bad = None
        blind = [k for k, differ in power.items() if not differ]
        if blind:
            ours_bad = (
                f"HF's steered greedy tokens equal its {' and '.join(blind)} ones on all "
                f"{len(check)} check prompts: the check cannot tell steering apart"
            )
        else:
            ours_bad = mismatch(ours.generate(check, max_tokens), ref)
            if ours_bad is None:
                agreed.append(OURS)
        for name, p in peers.items():
            if ours_bad is not None:
                break
            if p is ref_peer:
                agreed.append(name)
                continue
            try:
                got = p.generate(check, max_tokens)
            except Exception as e:  # noqa: BLE001 - any failure is the peer's result
                unavailable[name] = f"failed on this workload: {one_line(e)}"
                continue
            bad = mismatch(got, ref)
            if bad:
                unavailable[name] = f"not timed: tokens differ from HF's: {bad}"
            else:
                agreed.append(name)
        active = {n: p for n, p in peers.items() if n in agreed} if ours_bad is None else {}

        variants = {OURS: ours, **active} if ours_bad is None else {}

        def generated(name: str, inputs: list[list[int]], out: Tokens) -> float:
            if len(out) != len(inputs) or any(len(t) != max_tokens for t in out):
                raise RuntimeError(f"{name}: not {len(inputs)} x {max_tokens} tokens")
            return len(inputs) * max_tokens

        samples = time_rounds(
            variants,
            rounds,
            prompts,
            lambda p, ids: p.generate(ids, max_tokens),
            generated,
            "steering_peers",
            progress,
        )
    finally:
        ours.shutdown()

    terms, machine = machine_terms(binding, worker_cpus, cpu, hf)
    workload = (
        f"add {STRENGTH} x unit vector at {POINT}, all positions, {N_PROMPTS} x "
        f"{prompt_len}-token random prompts, {max_tokens} greedy tokens each, one call"
    )
    extra = {
        "workload": workload,
        "point": POINT,
        "strength": STRENGTH,
        "vector_seed": VECTOR_SEED,
        "prompts": N_PROMPTS,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "model": str(model),
        "reference": "HF generate, forward pre-hook on model.layers[2] adding strength * v",
        "check": (
            "greedy tokens equal to HF's steered ones on every check prompt; prompts where "
            f"HF's steered tokens differ from its controls (of {N_PROMPTS}): {power}"
        ),
        "agreed_with_hf": agreed,
        "versions": peer_versions(),
        "machine_terms": machine,
    }

    def notes(peer: str) -> str:
        how = " (one prompt at a time: its eager generation loop is batch 1)"
        return (
            f"ratio = ours / {peer}{how if peer == INTERP_ENGINE else ''}; greedy tokens "
            f"checked equal to HF's steered ones before timing (ours and {peer}); {terms}"
        )

    comparisons = peer_comparisons(
        f"steering peers: {workload}",
        "generated tok/s",
        extra,
        (HF, NNSIGHT, INTERP_ENGINE),
        ours_bad,
        active,
        samples,
        unavailable,
        notes,
    )
    print(
        f"steering_peers: check prompts whose steered tokens differ from HF's controls: {power}",
        file=sys.stderr,
    )
    return comparisons


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "steering_peers")
