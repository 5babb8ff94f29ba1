# SPDX-License-Identifier: Apache-2.0
"""Prompt hidden states: POST /v1/hidden_states vs vLLM's pooling runner vs HF.

Throughput in **sequences per second** (wall time of one batch, request sent to
arrays decoded, divided into the batch size; tokens per second in the notes) of
Z-Image-style prompts (the Qwen3 chat template around an image description,
64-128 tokens each with the benchmark model's tokenizer) at batch 1, 8 and 32:

* ``ours layer -1`` / ``ours layer -2``: this project's server (``vllm serve
  MODEL --enable-hidden-states``), POST /v1/hidden_states with the batch as one
  request (``input`` = list of texts), base64 encoding;
* ``pooling runner``: vLLM's own per-token embeddings on the same model (``vllm
  serve MODEL --runner pooling --convert embed --pooler-config
  '{"task": "token_embed"}'``), POST /pooling with ``task="token_embed"``,
  ``use_activation=false`` (no per-token L2 normalisation, so the values are the
  raw final post-norm states) and base64 encoding; final layer only;
* ``HF transformers``: the reference implementation of
  ``../shared/seeds/000_fffe4c3dda31ddaf.txt`` in this process (float32, one
  ``model(input_ids, attention_mask, output_hidden_states=True)`` per input,
  ``hidden_states[layer]`` cut to the attention mask; ``torch`` threads = all
  cores).

Each round runs the variants in that order (A B C D), each after ``SETTLE_S``
seconds of idle (see there), on texts no variant has
seen before (our server's prefix cache could otherwise serve repeats). Before
timing, every variant's values are checked against HF at layer -1 (and ours at
-2), ``max|diff| / max|ref|``.

Targets (minimum ratios, printed by :meth:`Comparison.lines`): ours >= 0.95x the
pooling runner at every batch size (comparison ``... vs pooling``, baseline =
pooling runner); ours >= 2x HF transformers at batch 32 (comparison ``... vs
HF``, baseline = HF transformers).

Run alone: ``python -m benchmarks.prompt_states [--quick] [--rounds N] [--model DIR]``.
"""

import base64
import contextlib
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from benchmarks import common
from benchmarks.common import Comparison, Server, bench_model

SERVED = "bench"  # the served model name of common.Server
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3")
POOLING_ARGS = (
    "--runner",
    "pooling",
    "--convert",
    "embed",
    "--pooler-config",
    '{"task": "token_embed"}',
)
OURS = {"ours layer -1": -1, "ours layer -2": -2}
POOLING = "pooling runner"
HF = "HF transformers"
MIN_TOKENS, MAX_TOKENS = 64, 128
POOLING_TARGET = 0.95
HF_TARGET, HF_TARGET_BATCH = 2.0, 32
AGREE_TOL = 1e-4  # max|diff| / max|ref|, float32 everywhere
# Seconds of idle before each timed call. A vLLM worker keeps spinning on its
# shared-memory queue (sched_yield) for 1 s after its last step
# (shm_broadcast.SpinCondition); on a small CPU that steals the cores from
# whichever variant runs next (HF measured right after a server ran 50x slower).
SETTLE_S = 1.2

# --------------------------------------------------------------------------
# servers


def start_server(model: Path, *args: str, name: str, env: dict[str, str] | None = None) -> Server:
    return Server(model, *args, name=name, env=env)


@contextlib.contextmanager
def servers(model: Path, *specs: tuple[str, tuple[str, ...]]):
    """Start the named servers in parallel, wait for all, stop all at the end."""
    started: list[Server] = []
    try:
        for name, args in specs:
            started.append(
                start_server(model, *args, name=name, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
            )
        for s in started:
            s.wait()
        yield started
    finally:
        for s in started:
            s.stop()


# --------------------------------------------------------------------------
# prompts

_SUBJECTS = [
    "a lighthouse",
    "an old fisherman",
    "a red fox",
    "a glass teapot",
    "a mountain village",
    "a robot gardener",
    "two cats",
    "a violinist",
    "a desert caravan",
    "a paper boat",
    "an abandoned train station",
    "a koi pond",
    "a snow leopard",
    "a street market",
    "a hot air balloon",
    "a medieval library",
    "a sunflower field",
    "a jazz club",
    "a bonsai tree",
    "a lunar base",
    "a carousel",
    "a bakery window",
    "a stormy harbor",
    "a bamboo forest",
    "a vintage motorcycle",
    "a coral reef",
]
_PLACES = [
    "at dawn",
    "under a full moon",
    "in heavy rain",
    "during golden hour",
    "in thick fog",
    "at the edge of a cliff",
    "beside a frozen lake",
    "in a neon-lit alley",
    "on a windy hilltop",
    "inside a greenhouse",
    "after a snowfall",
    "in late autumn",
    "at high noon",
    "at twilight",
]
_STYLES = [
    "oil painting",
    "watercolor",
    "35mm film photograph",
    "isometric render",
    "ukiyo-e woodblock print",
    "charcoal sketch",
    "studio photograph",
    "pixel art",
    "art nouveau poster",
    "cinematic still",
    "gouache illustration",
]
_DETAILS = [
    "soft rim light",
    "long shadows",
    "shallow depth of field",
    "muted earth tones",
    "vivid saturated colors",
    "fine film grain",
    "dramatic clouds",
    "reflections on wet stone",
    "warm lantern glow",
    "symmetrical composition",
    "wide angle lens",
    "intricate textures",
    "drifting mist",
    "scattered petals",
    "high contrast",
    "pastel palette",
    "golden particles in the air",
    "a quiet melancholic mood",
    "a joyful playful mood",
    "ultra detailed",
    "volumetric light rays",
]
_OPENERS = ["Draw", "Paint", "Render", "Show", "Create", "Depict", "Imagine", "Picture"]


def zimage(description: str) -> str:
    """The Z-Image text-encoder input: Qwen3 chat template, empty think block."""
    return f"<|im_start|>user\n{description}<|im_end|>\n<|im_start|>assistant\n<think>\n</think>\n"


class PromptMaker:
    """Distinct Z-Image-style prompts of ``MIN_TOKENS..MAX_TOKENS`` tokens."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.seen: set[str] = set()

    def n_tokens(self, text: str) -> int:
        return len(self.tok.encode(text))

    def description(self) -> str:
        r = self.rng
        while True:
            target = r.randint(MIN_TOKENS, MAX_TOKENS)
            parts = [f"{r.choice(_SUBJECTS)} {r.choice(_PLACES)}, {r.choice(_STYLES)}"]
            desc = parts[0]
            while True:
                extra = r.choice(_DETAILS)
                if r.random() < 0.3:
                    extra += f" and {r.choice(_SUBJECTS)} in the background"
                candidate = f"{desc}, {extra}"
                if self.n_tokens(zimage(f"Xxxxxx {candidate}.")) > target:
                    break
                desc = candidate
            if desc in self.seen:
                continue
            counts = [self.n_tokens(zimage(f"{o} {desc}.")) for o in _OPENERS]
            if MIN_TOKENS <= min(counts) and max(counts) <= MAX_TOKENS:
                self.seen.add(desc)
                return desc

    def batch(self, size: int) -> list[str]:
        return [self.description() for _ in range(size)]


def for_variant(descriptions: list[str], variant_index: int) -> list[str]:
    """The same descriptions, opened with a verb of the variant's own: the first
    tokens differ, so no prefix-cache block of one variant serves another."""
    opener = _OPENERS[variant_index % len(_OPENERS)]
    return [zimage(f"{opener} {d}.") for d in descriptions]


# --------------------------------------------------------------------------
# the variants: each returns one float32 [num_tokens, hidden] array per text


def ours(client: httpx.Client, texts: list[str], layer: int) -> list[np.ndarray]:
    from vllm_hidden_states.client import to_numpy

    r = client.post(
        "/v1/hidden_states",
        json={
            "input": texts,
            "model": SERVED,
            "layer": layer,
            "max_length": 1024,
            "encoding_format": "base64",
        },
    )
    r.raise_for_status()
    return to_numpy(r.json())


def pooling(
    client: httpx.Client, texts: list[str], hidden: int, normalize: bool = False
) -> list[np.ndarray]:
    r = client.post(
        "/pooling",
        json={
            "input": texts,
            "model": SERVED,
            "task": "token_embed",
            "use_activation": normalize,
            "encoding_format": "base64",
        },
    )
    r.raise_for_status()
    items = sorted(r.json()["data"], key=lambda d: d["index"])
    return [
        np.frombuffer(base64.b64decode(d["data"]), dtype=np.float32).reshape(-1, hidden)
        for d in items
    ]


class HFReference:
    """The seed's reference implementation, on CPU in float32."""

    def __init__(self, model: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def __call__(self, texts: list[str], layer: int = -1) -> list[np.ndarray]:
        out = []
        with self.torch.inference_mode():
            for text in texts:
                enc = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=1024)
                res = self.model(
                    enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    output_hidden_states=True,
                )
                states = res.hidden_states[layer]
                seq_len = int(enc["attention_mask"].sum().item())
                out.append(states[0, :seq_len].float().numpy())
        return out


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    """max|a - ref| / max|ref|; inf when the shapes differ."""
    if a.shape != ref.shape:
        return float("inf")
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def check_agreement(
    ours_client, pool_client, hf: HFReference, texts: list[str], hidden: int
) -> dict[str, float]:
    """Worst relative difference of each server's states against HF (float32)."""
    ref1, ref2 = hf(texts, -1), hf(texts, -2)
    got1, got2 = ours(ours_client, texts, -1), ours(ours_client, texts, -2)
    raw = pooling(pool_client, texts, hidden, normalize=False)
    normed = pooling(pool_client, texts, hidden, normalize=True)
    return {
        "ours -1 vs HF": max(rel_diff(g, r) for g, r in zip(got1, ref1)),
        "ours -2 vs HF": max(rel_diff(g, r) for g, r in zip(got2, ref2)),
        "pooling (use_activation=false) vs HF": max(rel_diff(p, r) for p, r in zip(raw, ref1)),
        "pooling vs ours -1": max(rel_diff(p, g) for p, g in zip(raw, got1)),
        "pooling (default, normalized) vs normalized ours -1": max(
            rel_diff(p, l2_normalize(g)) for p, g in zip(normed, got1)
        ),
    }


# --------------------------------------------------------------------------


def run(rounds: int, quick: bool, model: Path | None = None) -> list[Comparison]:
    """Prompt hidden-states throughput, sequences/s (tokens/s in the notes).

    Returns, per batch size, ``prompt states b<B> vs pooling`` (baseline =
    pooling runner, targets ours >= 0.95x) and ``prompt states b<B> vs HF``
    (baseline = HF transformers, target ours >= 2x at batch 32).
    """
    from tqdm import tqdm

    model = Path(model) if model is not None else bench_model()
    batches = [1, 8] if quick else [1, 8, 32]
    hf = HFReference(model)
    hidden = hf.model.config.hidden_size
    maker = PromptMaker(hf.tokenizer, seed=1234)
    print(
        f"prompt_states: targets: {'/'.join(OURS)} >= {POOLING_TARGET}x '{POOLING}' "
        f"(baseline {POOLING}); >= {HF_TARGET}x '{HF}' at batch {HF_TARGET_BATCH} "
        f"(baseline {HF})",
        file=sys.stderr,
    )

    specs = [
        ("prompt-states-ours", ("--enable-hidden-states", *SERVER_ARGS)),
        ("prompt-states-pooling", (*POOLING_ARGS, *SERVER_ARGS)),
    ]
    comparisons: list[Comparison] = []
    with (
        servers(model, *specs) as (ours_srv, pool_srv),
        httpx.Client(base_url=ours_srv.base_url, timeout=600) as oc,
        httpx.Client(base_url=pool_srv.base_url, timeout=600) as pc,
    ):
        agreement = check_agreement(oc, pc, hf, for_variant(maker.batch(4), 7), hidden)
        bad = {k: v for k, v in agreement.items() if not v < AGREE_TOL}
        if bad:
            raise AssertionError(f"states disagree (max|diff|/max|ref| >= {AGREE_TOL}): {bad}")
        agree_note = (
            "values agree with HF float32 before timing, max|diff|/max|ref|: "
            + ", ".join(f"{k} {v:.1e}" for k, v in agreement.items())
            + "; the pooling runner normalizes each token by default, so it is "
            "timed with use_activation=false (raw states, like ours)"
        )

        variants: dict[str, Callable[[list[str]], list[np.ndarray]]] = {
            name: (lambda texts, layer=layer: ours(oc, texts, layer))
            for name, layer in OURS.items()
        }
        variants[POOLING] = lambda texts: pooling(pc, texts, hidden)
        variants[HF] = lambda texts: hf(texts, -1)

        bar = tqdm(
            total=len(batches) * (rounds + 1) * len(variants), desc="prompt states", unit="batch"
        )
        for b in batches:
            vs_pool = Comparison(
                f"prompt states b{b} vs pooling",
                "seq/s",
                POOLING,
                targets={v: POOLING_TARGET for v in OURS},
            )
            vs_hf = Comparison(
                f"prompt states b{b} vs HF",
                "seq/s",
                HF,
                targets={v: HF_TARGET for v in OURS} if b == HF_TARGET_BATCH else {},
            )
            tokens_per_s: dict[str, list[float]] = {v: [] for v in variants}
            lengths: list[int] = []
            for r in range(rounds + 1):  # round 0 warms up and is not recorded
                descriptions = maker.batch(b)
                for i, (name, fn) in enumerate(variants.items()):
                    texts = for_variant(descriptions, i)
                    time.sleep(SETTLE_S)
                    t0 = time.perf_counter()
                    arrays = fn(texts)
                    dt = time.perf_counter() - t0
                    bar.update(1)
                    if len(arrays) != b:
                        raise AssertionError(f"{name}: {len(arrays)} results for {b} inputs")
                    if r == 0:
                        continue
                    n_tok = sum(a.shape[0] for a in arrays)
                    lengths.extend(a.shape[0] for a in arrays)
                    tokens_per_s[name].append(n_tok / dt)
                    for comp in (vs_pool, vs_hf):
                        comp.add(name, b / dt)
            tps = ", ".join(f"{v} {float(np.median(x)):.0f}" for v, x in tokens_per_s.items())
            for comp in (vs_pool, vs_hf):
                comp.notes = (
                    f"tokens/s (median): {tps}; {len(lengths)} timed sequences of "
                    f"{min(lengths)}-{max(lengths)} tokens (mean "
                    f"{np.mean(lengths):.0f}); base64 on both servers; " + agree_note
                )
            comparisons += [vs_pool, vs_hf]
        bar.close()
    return comparisons


def main(argv: list[str] | None = None) -> None:
    common.section_main(run, "prompt_states", argv)


if __name__ == "__main__":
    main()
