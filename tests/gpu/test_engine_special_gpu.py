# SPDX-License-Identifier: Apache-2.0
"""Engines of their own, with vLLM's CUDA defaults (compiled, its runner and
scheduling): preemption (KV for fewer tokens than the concurrent requests
need) and n-gram speculative decoding, exact against HF on the same GPU."""

import pytest

from .engine_support import NGRAM_PROMPT, PROMPT, check, make_llm, params


@pytest.fixture(scope="module")
def llm_small_kv(qwen3_dir):
    """KV for fewer tokens than its concurrent requests need: preemptions."""
    engine = make_llm(
        qwen3_dir,
        "small-kv",
        max_num_seqs=4,
        max_model_len=256,
        num_gpu_blocks_override=5,
        block_size=64,
        disable_log_stats=False,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_preemption_neither_duplicates_nor_loses_rows(llm_small_kv, hf_gpu):
    prompts = [f"{PROMPT} number {i}" for i in range(4)]
    outs = llm_small_kv.generate(
        prompts,
        params(
            max_tokens=60,
            ignore_eos=True,
            hidden_states_layers=[0, -1],
            hidden_states_positions="all",
        ),
        use_tqdm=False,
    )
    preemptions = sum(
        getattr(m, "value", 0)
        for m in llm_small_kv.get_metrics()
        if m.name == "vllm:num_preemptions"
    )
    assert preemptions > 0  # the case under test happened
    for out in outs:
        check(hf_gpu, out, "all", layers=[0, -1])


@pytest.fixture(scope="module")
def llm_ngram(qwen3_dir):
    engine = make_llm(
        qwen3_dir,
        "ngram",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("positions", ["last", "all", "prompt"])
def test_ngram_speculative_decoding_keeps_states_exact(llm_ngram, hf_gpu, positions):
    (out,) = llm_ngram.generate(
        [NGRAM_PROMPT], params(hidden_states_positions=positions), use_tqdm=False
    )
    check(hf_gpu, out, positions)
