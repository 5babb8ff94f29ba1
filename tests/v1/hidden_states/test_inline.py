# SPDX-License-Identifier: Apache-2.0
"""positions="all" at generation speed: every position but the final token is
captured in the request's own forwards (prompt rows in its prefill, each
generated position in the decode step that feeds it); only the final token
goes through a one-token extract. Streamed per output with DELTA."""

import pytest
import torch

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from .conftest import HFReference, assert_close, num_preemptions, token_ids_of

PROMPT = "Once upon a time there was a small robot who loved to count"
# Longer than the engine's token budget (64) and its capture buffers (24 rows).
LONG_PROMPT = " ".join(["The engine schedules requests, runs the model and samples tokens."] * 10)


def all_positions(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(return_hidden_states=True, hidden_states_positions="all", **kwargs)


def assert_every_position_matches_hf(hf, output, layers, index: int = 0):
    completion = output.outputs[index]
    ids = list(output.prompt_token_ids) + list(completion.token_ids)
    ref = hf.states(ids)
    assert list(completion.hidden_states) == list(layers)
    for layer in layers:
        tensor = completion.hidden_states[layer]
        assert tensor.shape == (len(ids), hf.hidden_size), layer
        assert_close(tensor, ref[layer], f"layer {layer}")


def assert_nothing_held(llm):
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    assert engine.output_processor.get_num_unfinished_requests() == 0
    assert engine.output_processor.extract_dispatcher.num_held == 0
    assert not scheduler.requests
    assert not scheduler.capture_planner.active and not scheduler.capture_planner.parked


def test_all_positions_at_embedding_middle_and_final_layers(llm, hf_qwen3):
    layers = [0, hf_qwen3.num_layers // 2, -2, -1]
    (out,) = llm.generate([PROMPT], all_positions(hidden_states_layers=layers), use_tqdm=False)
    assert_every_position_matches_hf(hf_qwen3, out, layers)
    assert_nothing_held(llm)


@pytest.mark.four_modes
def test_all_positions_of_a_prompt_longer_than_the_token_budget(llm, hf_qwen3):
    (out,) = llm.generate(
        [LONG_PROMPT], all_positions(hidden_states_layers=[1, -1]), use_tqdm=False
    )
    assert len(out.prompt_token_ids) > 64
    assert_every_position_matches_hf(hf_qwen3, out, [1, -1])


def test_final_layer_captures_beside_buffered_ones_in_one_batch_stay_exact(llm, hf_qwen3):
    """A final-layer-only capture is not held to the buffers' rows (its rows
    come from the model output), so it schedules whole chunks beside captures
    that do fill the buffers; the worker arms the buffers with theirs only."""
    prompts = [LONG_PROMPT, PROMPT, LONG_PROMPT + " Again."]
    params = [
        all_positions(hidden_states_layers=[-1]),
        all_positions(hidden_states_layers=[0, -1]),
        all_positions(hidden_states_layers=[-1], max_tokens=3),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        assert_every_position_matches_hf(hf_qwen3, out, p.hidden_states_layers)
    assert_nothing_held(llm)


def test_all_positions_request_skips_prefix_cache_reads_and_stays_exact(llm, hf_qwen3):
    params = all_positions(hidden_states_layers=[-2])
    first, second = (llm.generate([LONG_PROMPT], params, use_tqdm=False)[0] for _ in range(2))
    for out in (first, second):
        assert_every_position_matches_hf(hf_qwen3, out, [-2])


@pytest.mark.four_modes
def test_each_of_n_children_gets_every_position_of_its_own_sequence(llm, hf_qwen3):
    params = all_positions(n=2, temperature=1.0, seed=11, hidden_states_layers=[2, -1])
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for index in (0, 1):
        assert_every_position_matches_hf(hf_qwen3, out, [2, -1], index)


@pytest.mark.four_modes
def test_stop_string_drops_the_rows_past_the_trimmed_output(llm, hf_qwen3):
    (probe,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    text = probe.outputs[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    (out,) = llm.generate(
        [PROMPT], all_positions(stop=[stop], hidden_states_layers=[-1]), use_tqdm=False
    )
    assert out.outputs[0].finish_reason == "stop"
    assert_every_position_matches_hf(hf_qwen3, out, [-1])


def test_finish_by_eos_includes_the_eos_position(llm, hf_qwen3):
    (probe,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    eos = probe.outputs[0].token_ids[2]  # stands in for EOS: finishes after 3 tokens
    (out,) = llm.generate(
        [PROMPT], all_positions(stop_token_ids=[eos], hidden_states_layers=[0, -1]), use_tqdm=False
    )
    assert out.outputs[0].token_ids[-1] == eos
    assert_every_position_matches_hf(hf_qwen3, out, [0, -1])


def test_max_tokens_1_has_the_prompt_rows_and_the_one_generated_token(llm, hf_qwen3):
    (out,) = llm.generate(
        [PROMPT], all_positions(max_tokens=1, hidden_states_layers=[-1]), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 1
    assert_every_position_matches_hf(hf_qwen3, out, [-1])


def test_abort_mid_generation_leaves_nothing_held(llm, hf_qwen3):
    engine = llm.llm_engine
    engine.add_request("inline-abort", LONG_PROMPT, all_positions(max_tokens=400, ignore_eos=True))
    for _ in range(200):
        outputs = engine.step()
        if any(o.request_id == "inline-abort" and o.outputs[0].token_ids for o in outputs):
            break  # past the prefill, generating
    engine.abort_request(["inline-abort"], internal=False)
    for _ in range(10):
        engine.step()
    runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    capture = runner.hidden_states_capture
    assert not capture._partial and not capture._ready and capture._ready_group is None
    assert_nothing_held(llm)
    (out,) = llm.generate([PROMPT], all_positions(hidden_states_layers=[-1]), use_tqdm=False)
    assert_every_position_matches_hf(hf_qwen3, out, [-1])


def test_the_final_token_costs_one_token_on_the_requests_own_kv_blocks(llm):
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    planner = core.scheduler.capture_planner
    engine.add_request("inline-park", PROMPT, all_positions(max_tokens=3))
    adopted = None
    for _ in range(100):
        engine.step()
        # vLLM suffixes internal request ids; the extract's ends in "-hs".
        extracts = [r for rid, r in core.scheduler.requests.items() if rid.endswith("-hs")]
        if extracts and adopted is None:
            (extract,) = extracts
            adopted = extract.num_computed_tokens, extract.num_tokens
        if engine.output_processor.get_num_unfinished_requests() == 0:
            break
    assert adopted is not None and adopted[0] == adopted[1] - 1
    assert not planner.parked


# --------------------------------------------------------------------------
# DELTA streaming


@pytest.mark.four_modes
def test_delta_outputs_concatenate_to_the_non_streamed_result_bit_for_bit(llm):
    layers = [0, -1]
    (whole,) = llm.generate(
        [LONG_PROMPT], all_positions(hidden_states_layers=layers), use_tqdm=False
    )
    engine = llm.llm_engine
    engine.add_request(
        "inline-delta",
        LONG_PROMPT,
        all_positions(hidden_states_layers=layers, output_kind=RequestOutputKind.DELTA),
    )
    deltas = []
    for _ in range(300):
        for out in engine.step():
            if out.request_id == "inline-delta":
                deltas.append(out)
        if deltas and deltas[-1].finished:
            break
    assert deltas[-1].finished
    streamed = [d.outputs[0].hidden_states for d in deltas if d.outputs[0].hidden_states]
    for layer in layers:
        joined = torch.cat([chunk[layer] for chunk in streamed])
        assert torch.equal(joined, whole.outputs[0].hidden_states[layer])


@pytest.mark.four_modes
def test_each_delta_carries_the_positions_fed_since_the_previous_one(llm):
    engine = llm.llm_engine
    engine.add_request(
        "inline-rows",
        PROMPT,
        all_positions(max_tokens=6, hidden_states_layers=[-1], output_kind=RequestOutputKind.DELTA),
    )
    deltas = []
    for _ in range(100):
        deltas += [o for o in engine.step() if o.request_id == "inline-rows"]
        if deltas and deltas[-1].finished:
            break
    prompt_len = len(deltas[0].prompt_token_ids)
    rows = [d.outputs[0].hidden_states[-1].shape[0] for d in deltas]
    tokens = [len(d.outputs[0].token_ids) for d in deltas]
    # The first output: every prompt position. Then one row per token fed
    # back; the final output also carries the final token's row.
    assert rows[0] == prompt_len
    assert rows[1:-1] == tokens[:-2] if len(deltas) > 2 else True
    assert sum(rows) == prompt_len + sum(tokens)


# --------------------------------------------------------------------------
# preemption


@pytest.mark.four_modes
def test_preemption_and_recompute_neither_duplicate_nor_lose_rows(llm_small_kv, hf_qwen3):
    prompts = [f"{PROMPT} number {i}" for i in range(4)]
    params = all_positions(max_tokens=60, ignore_eos=True, hidden_states_layers=[0, -1])
    outs = llm_small_kv.generate(prompts, params, use_tqdm=False)
    assert num_preemptions(llm_small_kv) > 0  # the case under test happened
    for out in outs:
        assert_every_position_matches_hf(hf_qwen3, out, [0, -1])


@pytest.mark.four_modes
def test_preempted_requests_capture_each_kind_of_point_once_per_position(
    llm_small_kv, hf_qwen3, qwen3_dir
):
    """attn_out and MLP neurons captured inline across preemption and
    recompute, and an attention pattern (its own recomputing extract), for
    every position: exact, no row twice, none lost."""
    from .test_patterns import hf_patterns

    points = ["attn_out.1", "mlp_post.2", "attn_pattern.3"]
    prompts = [f"{PROMPT} number {i}" for i in range(4)]
    params = all_positions(max_tokens=60, ignore_eos=True, hidden_states_points=points)
    before = num_preemptions(llm_small_kv)
    outs = llm_small_kv.generate(prompts, params, use_tqdm=False)
    assert num_preemptions(llm_small_kv) > before  # the case under test happened
    eager = HFReference(qwen3_dir)
    eager.model.set_attn_implementation("eager")
    for out in outs:
        ids = token_ids_of(out)
        states = out.outputs[0].hidden_states
        reference = hf_qwen3.points(ids)
        for address in points[:2]:
            assert states[address].shape[0] == len(ids), address
            assert_close(states[address], reference[address], f"preempted {address}")
        assert_close(states["attn_pattern.3"], hf_patterns(eager, ids)[3], "preempted pattern")
