# SPDX-License-Identifier: Apache-2.0
"""The CUDA engine, exact against HF on the same GPU.

Every case runs on four engines: compiled (vLLM's default: torch.compile with
FULL_AND_PIECEWISE CUDA graphs) and eager, each with async scheduling on
(``VLLM_HIDDEN_STATES_ASYNC_SCHEDULING=1``, experimental) and off (the default
with hidden states). Chunked prefill is always in play (64-token budget,
24-row capture buffers); preemption and n-gram speculative decoding have
engines of their own.
"""

import os
from contextlib import contextmanager

import pytest

from vllm import SamplingParams
from vllm_hidden_states.config import ASYNC_SCHEDULING_ENV

from .conftest import assert_close_gpu

PROMPT = "Once upon a time there was a small robot who loved to count the stars"
LONG_PROMPT = " ".join(["The engine schedules requests, runs the model and samples tokens."] * 10)
NGRAM_PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"
LAYERS = [0, 1, -2, -1]

ENGINE_ARGS = dict(
    dtype="float32",
    gpu_memory_utilization=0.3,
    max_num_batched_tokens=64,
    max_num_seqs=16,
    max_model_len=1024,
    enable_prefix_caching=True,
    seed=0,
)


@contextmanager
def async_scheduling(on: bool):
    saved = os.environ.pop(ASYNC_SCHEDULING_ENV, None)
    if on:
        os.environ[ASYNC_SCHEDULING_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(ASYNC_SCHEDULING_ENV, None)
        if saved is not None:
            os.environ[ASYNC_SCHEDULING_ENV] = saved


def make_llm(model_dir, *, eager: bool, async_on: bool, **kwargs):
    from vllm import LLM

    with async_scheduling(async_on):
        return LLM(
            model=str(model_dir),
            enable_hidden_states=True,
            enforce_eager=eager,
            hidden_states_max_rows=24,
            # Every point's hook is in the compiled graph and the CUDA graphs.
            hidden_states_points="all",
            # Every steerable point's hook too (steered or not).
            enable_steering=True,
            steering_points="all",
            async_scheduling=True if async_on else None,
            **{**ENGINE_ARGS, **kwargs},
        )


ENGINES = [
    pytest.param((False, False), id="compiled-sync"),
    pytest.param((False, True), id="compiled-async"),
    pytest.param((True, False), id="eager-sync"),
    pytest.param((True, True), id="eager-async"),
]


@pytest.fixture(scope="module", params=ENGINES)
def llm(request, qwen3_dir):
    eager, async_on = request.param
    engine = make_llm(qwen3_dir, eager=eager, async_on=async_on)
    engine.async_on = async_on
    yield engine
    engine.llm_engine.engine_core.shutdown()


def params(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("hidden_states_layers", LAYERS)
    return SamplingParams(return_hidden_states=True, **kwargs)


def sequence_of(out, index: int = 0) -> list[int]:
    return list(out.prompt_token_ids) + list(out.outputs[index].token_ids)


def check(hf, out, positions: str, layers=LAYERS, index: int = 0):
    """Every layer of choice ``index`` equals HF at the positions asked."""
    completion = out.outputs[index]
    assert completion.finish_reason in ("stop", "length"), completion.finish_reason
    ids = sequence_of(out, index)
    ref = hf.states(ids)
    want = {
        "last": slice(len(ids) - 1, None),
        "all": slice(None),
        "prompt": slice(None, len(out.prompt_token_ids)),
    }[positions]
    assert list(completion.hidden_states) == list(layers)
    for layer in layers:
        assert_close_gpu(
            completion.hidden_states[layer], ref[layer][want], f"{positions} layer {layer}"
        )


@pytest.mark.parametrize("positions", ["last", "all"])
def test_every_capture_point_matches_hf_hooks(llm, hf_gpu, positions):
    from vllm_hidden_states.config import POINT_KINDS

    points = [
        f"{kind}.{i}"
        for kind in POINT_KINDS
        if kind != "attn_pattern"
        for i in range(hf_gpu.num_layers)
    ]
    (out,) = llm.generate(
        [PROMPT],
        params(
            hidden_states_layers=None,
            hidden_states_points=points,
            hidden_states_positions=positions,
        ),
        use_tqdm=False,
    )
    ids = sequence_of(out)
    reference = hf_gpu.points(ids)
    rows = slice(None) if positions == "all" else slice(-1, None)
    for address in points:
        assert_close_gpu(
            out.outputs[0].hidden_states[address],
            reference[address][rows],
            f"{positions} {address}",
        )


@pytest.mark.parametrize("positions", ["last", "all"])
def test_attention_patterns_match_hf_eager(llm, hf_gpu, positions):
    patterns = [f"attn_pattern.{i}" for i in range(hf_gpu.num_layers)]
    (out,) = llm.generate(
        [LONG_PROMPT],
        params(
            hidden_states_layers=None,
            hidden_states_points=patterns,
            hidden_states_positions=positions,
        ),
        use_tqdm=False,
    )
    reference = hf_gpu.patterns(sequence_of(out))
    rows = slice(None) if positions == "all" else slice(-1, None)
    for i, address in enumerate(patterns):
        assert_close_gpu(
            out.outputs[0].hidden_states[address], reference[i][:, rows], f"{positions} {address}"
        )


def test_a_batch_of_differently_steered_requests_matches_hf_hooks(llm, hf_gpu):
    """Steering in the CUDA graphs (compiled) and eager, sync and async: add
    and ablate at several kinds of point, windows, and unsteered requests in
    the same batch, every layer at every position against HF forward hooks
    applying the same interventions."""
    import torch

    n = hf_gpu.num_layers

    def vec(seed):
        return torch.randn(hf_gpu.hidden_size, generator=torch.Generator().manual_seed(seed))

    steering = [
        [{"point": "resid_pre.1", "op": "add", "vector": vec(1), "strength": 4.0}],
        [{"point": f"mlp_out.{n - 1}", "op": "ablate", "vector": vec(2)}],
        [
            {
                "point": "attn_out.0",
                "op": "add",
                "vector": vec(3),
                "strength": 2.0,
                "positions": {"start": 3, "end": 20},
            },
            {"point": "resid_mid.1", "op": "ablate", "vector": vec(4), "positions": "generated"},
        ],
        None,
    ]
    layers = list(range(n + 1))
    wire = [
        None if s is None else [{**i, "vector": i["vector"].tolist()} for i in s] for s in steering
    ]
    outs = llm.generate(
        [PROMPT] * len(steering),
        [
            params(hidden_states_layers=layers, hidden_states_positions="all", steering=w)
            for w in wire
        ],
        use_tqdm=False,
    )
    for out, s in zip(outs, steering):
        ids = sequence_of(out)
        prompt_len = len(out.prompt_token_ids)
        items = []
        for i in s or []:
            positions = i.get("positions", "all")
            start, end = 0, None
            if positions == "generated":
                start = prompt_len
            elif isinstance(positions, dict):
                start, end = positions["start"], positions["end"]
            items.append(
                {
                    "point": i["point"],
                    "op": i["op"],
                    "vector": i["vector"],
                    "strength": i.get("strength", 1.0),
                    "start": start,
                    "end": end,
                }
            )
        ref = hf_gpu.steered_states(ids, items)
        for layer in layers:
            assert_close_gpu(
                out.outputs[0].hidden_states[layer],
                ref[layer].cpu(),
                f"steered {s and s[0]['point']} {layer}",
            )


def test_engine_scheduling_mode_is_the_one_asked(llm):
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is llm.async_on


def test_cuda_engine_with_hidden_states_runs_model_runner_v1(llm):
    assert llm.llm_engine.vllm_config.use_v2_model_runner is False


@pytest.mark.parametrize("positions", ["last", "all", "prompt"])
def test_positions_at_several_layers_match_hf(llm, hf_gpu, positions):
    (out,) = llm.generate([PROMPT], params(hidden_states_positions=positions), use_tqdm=False)
    check(hf_gpu, out, positions)


@pytest.mark.parametrize("positions", ["last", "all"])
def test_prompt_longer_than_the_token_budget_is_chunked_and_exact(llm, hf_gpu, positions):
    (out,) = llm.generate([LONG_PROMPT], params(hidden_states_positions=positions), use_tqdm=False)
    assert len(out.prompt_token_ids) > ENGINE_ARGS["max_num_batched_tokens"]
    check(hf_gpu, out, positions)


def test_last_position_after_a_prefix_cache_hit_is_exact(llm, hf_gpu):
    (first,) = llm.generate([LONG_PROMPT], params(max_tokens=4), use_tqdm=False)
    (second,) = llm.generate([LONG_PROMPT], params(max_tokens=6), use_tqdm=False)
    assert second.num_cached_tokens > 0  # the case under test happened
    check(hf_gpu, second, "last")


def test_mixed_batch_of_askers_and_plain_requests_is_exact(llm, hf_gpu):
    prompts = [f"{PROMPT} number {i}" for i in range(8)]
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    asks = [params(hidden_states_positions=p) for p in ("last", "all", "prompt")]
    outs = llm.generate(
        prompts, [asks[i % 3] if i % 2 else plain for i in range(8)], use_tqdm=False
    )
    for i, out in enumerate(outs):
        if i % 2:
            check(hf_gpu, out, ("last", "all", "prompt")[i % 3])
        else:
            assert out.outputs[0].hidden_states is None


def test_each_of_n_children_gets_its_own_sequences_states(llm, hf_gpu):
    (out,) = llm.generate(
        [PROMPT],
        params(n=2, temperature=1.0, seed=7, hidden_states_positions="all"),
        use_tqdm=False,
    )
    for index in range(2):
        check(hf_gpu, out, "all", index=index)


def test_stop_string_trims_the_states_with_the_output(llm, hf_gpu):
    # Own cache salts: every prefill computes the whole prompt, so the greedy
    # text (random weights, near-tied logits) is the same in each request.
    (probe,) = llm.generate(
        [{"prompt": PROMPT, "cache_salt": "stop-probe"}],
        SamplingParams(max_tokens=12, temperature=0.0),
        use_tqdm=False,
    )
    text = probe.outputs[0].text
    stop = text[len(text) // 2 :][:3]
    if not stop.strip():
        pytest.skip("greedy output has no usable stop string")  # depends on the weights
    for positions in ("last", "all"):
        (out,) = llm.generate(
            [{"prompt": PROMPT, "cache_salt": f"stop-{positions}"}],
            params(stop=[stop], hidden_states_positions=positions),
            use_tqdm=False,
        )
        assert out.outputs[0].finish_reason == "stop"
        check(hf_gpu, out, positions)


def test_stop_token_includes_the_stop_tokens_state(llm, hf_gpu):
    (probe,) = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    stop_token = probe.outputs[0].token_ids[3]
    (out,) = llm.generate(
        [PROMPT], params(stop_token_ids=[stop_token], hidden_states_positions="all"), use_tqdm=False
    )
    assert out.outputs[0].token_ids[-1] == stop_token
    check(hf_gpu, out, "all")


# -- preemption and speculative decoding: engines of their own ------------------


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm_small_kv(request, qwen3_dir):
    """KV for fewer tokens than its concurrent requests need: preemptions."""
    engine = make_llm(
        qwen3_dir,
        eager=False,
        async_on=request.param,
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
        eager=False,
        async_on=False,
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
