# SPDX-License-Identifier: Apache-2.0
"""A hybrid (Granite 4.0-H's layout: Mamba2 and attention layers) under
preemption: vLLM keeps each request's Mamba state in a cache block of its own,
frees it when the request is preempted, and prefills the request again from
its tokens when it resumes. The rows captured over that recompute, and the
"last" extract's (a prefill of the finished request's tokens), must come from
Mamba state rebuilt from those tokens, never from a freed or another
request's block: every layer, every position, against HF.

The engine's KV cache holds 8 blocks of 128 tokens (vLLM sizes a hybrid's
attention blocks to the Mamba state's page), too few for 4 requests that
cross their 128th token together: vLLM preempts some of them. (Seen: 2
preemptions, and the resumed requests prefilled from scratch, with no prefix
cache hit.) One engine, in this process.

Then data parallel 2 (``vllm serve --data-parallel-size 2``): concurrent
requests spread over both engines, each keeping its requests' Mamba state;
every state exact, and nothing held afterwards on either engine.
"""

import pytest

from vllm import SamplingParams
from vllm_hidden_states.tools.tiny_models import build_tiny_model

from .conftest import (
    COMMON_ENGINE_ARGS,
    MODELS,
    HFReference,
    assert_close,
    llm_in_process,
    num_preemptions,
    shut_down_in_process,
    token_ids_of,
)
from .server_utils import post_concurrently, test_server_process
from .test_scale_out import assert_nothing_held, check_choice, served_by_engine

ARCH = "granitemoehybrid"
# ~121 tokens each (different last words: no shared cache block), so that
# 16 more cross the 128-token block.
PROMPTS = [" ".join(f"word{i}" for i in range(25)) + f" number {j}" for j in range(4)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf_hybrid() -> HFReference:
    return HFReference(build_tiny_model(MODELS / f"tiny-{ARCH}", arch=ARCH))


@pytest.fixture(scope="module")
def llm_hybrid_small_kv(hf_hybrid):
    model_dir = build_tiny_model(MODELS / f"tiny-{ARCH}", arch=ARCH)
    engine = llm_in_process(
        model=str(model_dir),
        enable_hidden_states=True,
        enforce_eager=True,
        max_model_len=256,
        num_gpu_blocks_override=8,
        disable_log_stats=False,
        **dict(COMMON_ENGINE_ARGS, max_num_seqs=4),
    )
    yield engine
    shut_down_in_process(engine)


@pytest.mark.parametrize("positions", ["all", "last"])
def test_preempted_hybrid_requests_match_hf_at_every_layer(
    llm_hybrid_small_kv, hf_hybrid, positions
):
    hf = hf_hybrid
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions=positions,
    )
    before = num_preemptions(llm_hybrid_small_kv)
    outs = llm_hybrid_small_kv.generate(PROMPTS, params, use_tqdm=False)
    assert num_preemptions(llm_hybrid_small_kv) > before  # the case under test happened
    for j, out in enumerate(outs):
        ids = token_ids_of(out)
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
        reference = hf.states(ids)
        states = out.outputs[0].hidden_states
        assert list(states) == list(range(hf.num_layers + 1))
        for layer, tensor in states.items():
            expected = reference[layer] if positions == "all" else reference[layer][-1:]
            assert_close(tensor, expected, f"preempted hybrid {j} {positions} layer {layer}")


# --------------------------------------------------------------------------
# data parallel 2

DP_MODEL = f"tiny-{ARCH}"


@pytest.fixture(scope="module")
def dp2_hybrid(tmp_path_factory):
    model_dir = build_tiny_model(MODELS / DP_MODEL, arch=ARCH)
    args = [
        "--enable-hidden-states",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "64",
        "--enable-server-load-tracking",
        "--data-parallel-size",
        "2",
    ]
    log = tmp_path_factory.mktemp("hybrid-dp2-logs") / "dp2.log"
    server = test_server_process(model_dir, args, log, name=DP_MODEL)
    server.start()
    try:
        yield server.wait_ready(timeout=900)
    finally:
        server.stop()


@pytest.mark.slow
def test_data_parallel_2_hybrid_requests_are_exact_on_both_engines(dp2_hybrid, hf_hybrid):
    """ "last" (an extract after the request finished), "all" and "prompt",
    over a prompt prefilled in chunks too, all at once: every layer exact."""
    layers = list(range(hf_hybrid.num_layers + 1))

    def body(prompt: str, **kwargs) -> dict:
        return {
            "model": DP_MODEL,
            "prompt": prompt,
            "max_tokens": 5,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_hidden_states": True,
            "hidden_states_layers": layers,
            **kwargs,
        }

    stories = [f"Story {i}: once upon a time there was a robot who" for i in range(6)]
    jobs = [("last", body(p)) for p in stories[:3]]
    jobs += [
        ("all", body(stories[3], hidden_states_positions="all")),
        ("all", body(PROMPTS[0], hidden_states_positions="all")),  # > 64 tokens: chunked
        ("prompt", body(stories[4], hidden_states_positions="prompt")),
        ("last", body(stories[5], max_tokens=9)),
    ]
    before = served_by_engine(dp2_hybrid)
    results = post_concurrently(dp2_hybrid.base_url, "/v1/completions", jobs)
    for positions, r in results:
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        check_choice(hf_hybrid, choice, positions, layers)
    after = served_by_engine(dp2_hybrid)
    served = {e: after[e] - before[e] for e in after}
    assert sum(served.values()) == len(jobs)
    assert served["0"] > 0 and served["1"] > 0, served
    assert_nothing_held(dp2_hybrid)
