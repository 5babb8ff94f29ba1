# SPDX-License-Identifier: Apache-2.0
"""The CUDA engine, exact against HF on the same GPU.

Every case runs on each engine kind ``HS_GPU_ENGINES`` names (see
``engine_support``: vLLM's CUDA defaults, V1 + sync scheduling, eager), one
engine start per kind for all of them: "last", "all" and "prompt" at several
layers, every capture point, attention patterns, a batch of differently
steered requests, chunked prefill, a prefix-cache hit, a mixed batch, n=2,
stop strings and stop tokens. Preemption and n-gram speculative decoding have
engines of their own (``test_engine_special_gpu.py``).
"""

import pytest

from vllm import SamplingParams

from .conftest import assert_close_gpu, engine_mode
from .engine_support import (
    ENGINE_ARGS,
    ENGINE_KINDS,
    LONG_PROMPT,
    PROMPT,
    check,
    engine_kinds,
    environment,
    make_llm,
    params,
    sequence_of,
)

# What each kind must resolve to on CUDA: vLLM's own choices where nothing is
# asked (Model Runner V2, async scheduling, FULL_AND_PIECEWISE CUDA graphs
# compiled, none eager), and what is asked where it is.
EXPECTED_MODES = {
    "default": {"runner": "V2", "async_scheduling": True, "cudagraph_mode": "FULL_AND_PIECEWISE"},
    "v1-sync": {"runner": "V1", "async_scheduling": False},
    "eager": {"runner": "V2", "async_scheduling": True, "cudagraph_mode": "NONE"},
}


@pytest.fixture(scope="module", params=engine_kinds())
def llm(request, qwen3_dir):
    eager, kwargs, env = ENGINE_KINDS[request.param]
    with environment(env):
        engine = make_llm(qwen3_dir, request.param, eager=eager, **kwargs)
        engine.kind = request.param
        yield engine
        engine.llm_engine.engine_core.shutdown()


def test_engine_resolves_the_runner_scheduling_and_graphs_of_its_kind(llm):
    mode = engine_mode(llm)
    want = EXPECTED_MODES[llm.kind]
    assert {k: mode[k] for k in want} == want, mode


@pytest.mark.parametrize("positions", ["last", "all"])
def test_every_capture_point_matches_hf_hooks(llm, hf_gpu, positions):
    from vllm_hidden_states.points import POINT_KINDS

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
