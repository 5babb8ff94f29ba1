# SPDX-License-Identifier: Apache-2.0
"""Capture points beyond the residual stream (issue 19): what an engine pays
for making every point capturable, and what a request pays for one point.

Model: the small-model section's random 5-layer, 256-wide Llama (float32,
torch.compile'd), where the model's own compute is short and per-step host
work shows. Workload: 24 requests x (48 prompt + 64 generated tokens), fresh
random prompts per measurement, greedy, ``ignore_eos``. Baseline: plain
requests on an engine started without hidden states. Variants, on an engine
with ``--hidden-states-points all`` (every layer and every point of every
layer capturable: 5 x 6 capture points): nobody asks; "last" at one point of
each kind (layer 2) on every request, and "last" at an attention pattern
(reported, no target: it recomputes every position of the request). A second
plain engine runs as an A/A control: its ratio to the baseline is what the
rounds read for no difference at all, the comparison's resolution on this
machine. All engines live in this process and the variants alternate round
by round in a balanced order.

Targets (issue 19): enabled but unused, every point capturable >= 0.99;
"last" at one point of each kind >= 0.97.
"""

from pathlib import Path

from benchmarks.common import Comparison, alternate
from benchmarks.offline import _throughput
from benchmarks.small_model import ARGS, MAX_TOKENS, PROMPT_LEN, small_model, small_model_engines

KINDS = ("attn_out", "resid_mid", "mlp_out", "resid_post")
LAYER = 2
CONTROL = "A/A control: a second plain engine"


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list[Comparison]:
    from vllm import LLM

    model = model or small_model()
    n, prompts, plain, points = small_model_engines(quick, model, hidden_states_points="all")
    twin = LLM(model=str(model), **ARGS)
    _throughput(twin, prompts(2), max_tokens=4)
    for kind in (*KINDS, "attn_pattern"):
        _throughput(
            points,
            prompts(2),
            max_tokens=4,
            return_hidden_states=True,
            hidden_states_points=[f"{kind}.{LAYER}"],
        )

    comparison = Comparison(
        "capture points: every point capturable",
        "generated tok/s",
        baseline="plain vLLM (no hidden states)",
        notes=(
            f"5 x 256 Llama, --hidden-states-points all, {n} requests x ({PROMPT_LEN} "
            f"prompt + {MAX_TOKENS} generated tokens), fresh prompts"
        ),
        targets={
            "every point capturable, nobody asks": 0.99,
            **{f"last, {kind}.{LAYER}": 0.97 for kind in KINDS},
        },
    )

    def one_point(kind: str):
        return lambda: _throughput(
            points,
            prompts(),
            max_tokens=MAX_TOKENS,
            return_hidden_states=True,
            hidden_states_points=[f"{kind}.{LAYER}"],
        )

    alternate(
        comparison,
        {
            "plain vLLM (no hidden states)": lambda: _throughput(
                plain, prompts(), max_tokens=MAX_TOKENS
            ),
            CONTROL: lambda: _throughput(twin, prompts(), max_tokens=MAX_TOKENS),
            "every point capturable, nobody asks": lambda: _throughput(
                points, prompts(), max_tokens=MAX_TOKENS
            ),
            **{f"last, {kind}.{LAYER}": one_point(kind) for kind in KINDS},
            # The cost of a pattern: one extra prefill of the whole sequence
            # (no KV hand-over) and the weights computed on the device.
            f"last, attn_pattern.{LAYER}": one_point("attn_pattern"),
        },
        rounds,
        progress,
    )
    for llm in (plain, twin, points):
        llm.llm_engine.engine_core.shutdown()
    return [comparison]


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "points")
