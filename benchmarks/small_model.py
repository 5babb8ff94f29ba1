# SPDX-License-Identifier: Apache-2.0
"""The CPU proxy for per-step host work: a small model, where the model's
own compute is short and the package's Python per step shows, as it does on
a GPU.

Model: a random 5-layer, 256-wide Llama (float32, torch.compile'd). Workload:
24 requests x (48 prompt + 64 generated tokens), fresh random prompts per
measurement, greedy, ``ignore_eos``. Baseline: plain requests on an engine
started without hidden states. Variants, on an engine with
``--enable-hidden-states`` (every layer capturable): nobody asks, "last" at
layer -1 on every request, "all" at layer -2 on every request. Both engines
live in this process and the variants alternate round by round.

Targets (the CUDA speed issue's CPU proxy): nobody asks >= 0.99, "last" >=
0.98, "all" >= 0.95. :mod:`benchmarks.small_model_modes` runs it in each of
vLLM's engine modes.
"""

import os
from pathlib import Path

from benchmarks.common import MODELS, Comparison, alternate
from benchmarks.offline import ENGINE_ARGS, FreshPrompts, _throughput

NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 24, 48, 64
ARGS = dict(ENGINE_ARGS, max_model_len=512)


def small_model() -> Path:
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    return build_tiny_model(
        MODELS / "small-llama", arch="llama", num_layers=5, hidden_size=256, vocab_size=512
    )


def wide_model() -> Path:
    """Four random Llama layers of a 0.5B model's width (896 hidden, 4864 MLP,
    14 heads of 64): where a layer's compute is that of a small production
    model, against the 256-wide model's per-step overheads."""
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    return build_tiny_model(
        MODELS / "wide-llama",
        arch="llama",
        num_layers=4,
        hidden_size=896,
        intermediate_size=4864,
        vocab_size=512,
    )


def model_shape(model: Path) -> str:
    """``"<layers> x <hidden> Llama"`` (or the architecture) from a model's config."""
    import json

    config = json.loads((model / "config.json").read_text())
    arch = config.get("model_type", "model").capitalize()
    return f"{config['num_hidden_layers']} x {config['hidden_size']} {arch}"


def small_model_engines(quick: bool, model: Path | None = None, tiny: bool = False, **enabled_args):
    """``(n, prompts, plain, enabled)``: the request count, fresh prompts and
    two warmed-up engines on the small model in this process, one plain and
    one with hidden states enabled (``enabled_args`` added; they may set
    ``enable_hidden_states=False``, e.g. for an engine that only steers).
    ``tiny``: 2 requests of 8-token prompts, eager engines (a smoke test)."""
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = model or small_model()
    n = 2 if tiny else NUM_REQUESTS // 2 if quick else NUM_REQUESTS
    prompts = FreshPrompts(n, 8 if tiny else PROMPT_LEN)
    args = dict(ARGS, enforce_eager=True) if tiny else ARGS
    plain = LLM(model=str(model), **args)
    enabled_args = {"enable_hidden_states": True, **enabled_args}
    enabled = LLM(model=str(model), **enabled_args, **args)
    for llm in (plain, enabled):  # warm-up (compilation, caches)
        _throughput(llm, prompts(2), max_tokens=4)
    return n, prompts, plain, enabled


def run(
    rounds: int, quick: bool, model: Path | None = None, progress=None, tiny: bool = False
) -> list[Comparison]:
    """``tiny``: 2 requests x (8 + 4) tokens on eager engines (a smoke test)."""
    n, prompts, plain, enabled = small_model_engines(quick, model, tiny)
    max_tokens = 4 if tiny else MAX_TOKENS
    _throughput(
        enabled, prompts(2), max_tokens=4, return_hidden_states=True, hidden_states_positions="all"
    )

    mode = os.environ.get("VLLM_HS_TEST_MODE")  # benchmarks.small_model_modes
    comparison = Comparison(
        "small model: per-step host work" + (f" ({mode})" if mode else ""),
        "generated tok/s",
        baseline="plain vLLM (no hidden states)",
        notes=(
            f"5 x 256 Llama, {n} requests x ({prompts.length} prompt + {max_tokens} "
            "generated tokens), fresh prompts"
        ),
        targets={"enabled, nobody asks": 0.99, "last, layer -1": 0.98, "all, layer -2": 0.95},
    )
    alternate(
        comparison,
        {
            "plain vLLM (no hidden states)": lambda: _throughput(
                plain, prompts(), max_tokens=max_tokens
            ),
            "enabled, nobody asks": lambda: _throughput(enabled, prompts(), max_tokens=max_tokens),
            "last, layer -1": lambda: _throughput(
                enabled, prompts(), max_tokens=max_tokens, return_hidden_states=True
            ),
            "all, layer -2": lambda: _throughput(
                enabled,
                prompts(),
                max_tokens=max_tokens,
                return_hidden_states=True,
                hidden_states_layers=[-2],
                hidden_states_positions="all",
            ),
        },
        rounds,
        progress,
    )
    for llm in (plain, enabled):
        llm.llm_engine.engine_core.shutdown()
    return [comparison]


STEPS_PER_ROUND = 4


if __name__ == "__main__":
    from benchmarks.common import section_main

    mode = os.environ.get("VLLM_HS_TEST_MODE")
    section_main(run, f"small_model_{mode}" if mode else "small_model")
