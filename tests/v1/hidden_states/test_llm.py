# SPDX-License-Identifier: Apache-2.0
"""The Python API through ``LLM``: contract for layers, positions and stops."""

import re

import pytest
import torch

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from .conftest import assert_close, token_ids_of

PROMPT = "Once upon a time there was a small robot who loved to count"
LONG_PROMPT = " ".join(["The engine schedules requests, runs the model and samples tokens."] * 10)


def greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 8)
    return SamplingParams(temperature=0.0, return_hidden_states=True, **kwargs)


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.four_modes
def test_last_token_states_match_hf_at_embedding_middle_and_final_layers(llm, hf_qwen3):
    (out,) = generate(llm, [PROMPT], greedy(hidden_states_layers=[0, 2, -2, -1]))
    states = out.outputs[0].hidden_states
    ref = hf_qwen3.states(token_ids_of(out))
    assert list(states) == [0, 2, -2, -1]
    for layer, tensor in states.items():
        assert tensor.shape == (1, hf_qwen3.hidden_size) and tensor.dtype == torch.float32
        assert_close(tensor, ref[layer][-1:], f"layer {layer}")


def test_default_layer_is_final_post_norm_state(llm, hf_qwen3):
    (out,) = generate(llm, [PROMPT], greedy())
    states = out.outputs[0].hidden_states
    assert list(states) == [-1]
    assert_close(
        states[-1], hf_qwen3.states(token_ids_of(out))[hf_qwen3.num_layers][-1:], "layer L"
    )


@pytest.mark.four_modes
def test_all_positions_cover_prompt_and_output(llm, hf_qwen3):
    (out,) = generate(
        llm, [PROMPT], greedy(hidden_states_layers=[1, -1], hidden_states_positions="all")
    )
    ids = token_ids_of(out)
    ref = hf_qwen3.states(ids)
    for layer, tensor in out.outputs[0].hidden_states.items():
        assert tensor.shape == (len(ids), hf_qwen3.hidden_size)
        assert_close(tensor, ref[layer], f"layer {layer}")


@pytest.mark.parametrize("positions", ["last", "all"])
@pytest.mark.four_modes
def test_prompt_longer_than_batch_budget_is_chunked_and_exact(llm, hf_qwen3, positions):
    params = greedy(hidden_states_layers=[-2, 1], hidden_states_positions=positions)
    (out,) = generate(llm, [LONG_PROMPT], params)
    ids = token_ids_of(out)
    assert len(out.prompt_token_ids) > 64  # max_num_batched_tokens
    ref = hf_qwen3.states(ids)
    for layer, tensor in out.outputs[0].hidden_states.items():
        expected = ref[layer] if positions == "all" else ref[layer][-1:]
        assert_close(tensor, expected, f"{positions} layer {layer}")


@pytest.mark.four_modes
def test_same_prompt_twice_hits_prefix_cache_with_identical_states(llm, hf_qwen3):
    prompt = LONG_PROMPT + " Prefix cache run."
    (first,) = generate(llm, [prompt], greedy(hidden_states_layers=[-1, 2]))
    (second,) = generate(llm, [prompt], greedy(hidden_states_layers=[-1, 2]))
    assert second.num_cached_tokens > 0
    assert token_ids_of(first) == token_ids_of(second)
    ref = hf_qwen3.states(token_ids_of(second))
    for layer in (-1, 2):
        assert_close(second.outputs[0].hidden_states[layer], ref[layer][-1:], f"layer {layer}")
        assert torch.equal(
            first.outputs[0].hidden_states[layer], second.outputs[0].hidden_states[layer]
        )


@pytest.mark.four_modes
def test_each_of_n_children_gets_its_own_sequence_states(llm, hf_qwen3):
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=8,
        return_hidden_states=True,
        hidden_states_layers=[-1, 1],
    )
    (out,) = generate(llm, [PROMPT], params)
    assert len(out.outputs) == 2
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for child in out.outputs:
        ids = list(out.prompt_token_ids) + list(child.token_ids)
        ref = hf_qwen3.states(ids)
        for layer in (-1, 1):
            assert_close(child.hidden_states[layer], ref[layer][-1:], f"child {child.index}")


@pytest.mark.four_modes
def test_batch_mixing_requests_with_and_without_states(llm, hf_qwen3):
    prompts = [PROMPT, "Hello world! How are you today?", LONG_PROMPT, "Paris is"]
    params = [greedy(hidden_states_layers=[2]), SamplingParams(temperature=0.0, max_tokens=8)] * 2
    outs = generate(llm, prompts, params)
    for out, asked in zip(outs, [True, False, True, False]):
        states = out.outputs[0].hidden_states
        if not asked:
            assert states is None
            continue
        assert_close(states[2], hf_qwen3.last(token_ids_of(out), 2), out.prompt)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT])
@pytest.mark.four_modes
def test_prompt_positions_come_from_the_requests_own_prefill(llm, hf_qwen3, prompt):
    params = greedy(max_tokens=5, hidden_states_layers=[-2, 0], hidden_states_positions="prompt")
    (out,) = generate(llm, [prompt], params)
    ref = hf_qwen3.states(list(out.prompt_token_ids))
    for layer, tensor in out.outputs[0].hidden_states.items():
        assert tensor.shape == (len(out.prompt_token_ids), hf_qwen3.hidden_size)
        assert_close(tensor, ref[layer], f"prompt layer {layer}")
    assert len(out.outputs[0].token_ids) == 5


def test_prompt_positions_are_complete_on_a_prefix_cache_hit(llm, hf_qwen3):
    prompt = LONG_PROMPT + " Cached prompt states."
    generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=2))  # fill cache
    params = greedy(max_tokens=1, hidden_states_positions="prompt")
    (out,) = generate(llm, [prompt], params)
    assert out.outputs[0].hidden_states[-1].shape[0] == len(out.prompt_token_ids)
    assert_close(
        out.outputs[0].hidden_states[-1],
        hf_qwen3.states(list(out.prompt_token_ids))[-1],
        "prompt after cache",
    )


@pytest.mark.four_modes
def test_finish_by_eos_returns_state_of_the_eos_token(llm, hf_qwen3):
    eos = llm.get_tokenizer().eos_token_id
    params = greedy(min_tokens=3, logit_bias={eos: 100.0}, max_tokens=20)
    (out,) = generate(llm, [PROMPT], params)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == eos
    assert len(completion.token_ids) == 4
    assert_close(completion.hidden_states[-1], hf_qwen3.last(token_ids_of(out), -1), "eos")


@pytest.mark.four_modes
def test_finish_by_stop_token_ids_returns_state_of_the_stop_token(llm, hf_qwen3):
    (free,) = generate(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=8))
    stop_id = free.outputs[0].token_ids[3]
    (out,) = generate(llm, [PROMPT], greedy(stop_token_ids=[stop_id]))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids[-1] == stop_id
    assert_close(completion.hidden_states[-1], hf_qwen3.last(token_ids_of(out), -1), "stop id")


@pytest.mark.four_modes
def test_finish_by_stop_string_uses_the_trimmed_token_list(llm, hf_qwen3):
    # Own cache salts: both prefills compute the whole prompt, so the greedy
    # text (random weights, near-tied logits) cannot differ between them.
    probe = {"prompt": PROMPT, "cache_salt": "stop-probe"}
    (free,) = generate(llm, [probe], SamplingParams(temperature=0.0, max_tokens=12))
    tokenizer = llm.get_tokenizer()
    # A stop string that ends inside the 6th generated token's text.
    text6 = tokenizer.decode(free.outputs[0].token_ids[:6])
    stop = text6[-3:] if len(text6) >= 3 else text6
    stopped = {"prompt": PROMPT, "cache_salt": "stop-request"}
    (out,) = generate(llm, [stopped], greedy(stop=[stop], max_tokens=12))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < len(free.outputs[0].token_ids)
    assert_close(completion.hidden_states[-1], hf_qwen3.last(token_ids_of(out), -1), "stop str")


def test_finish_by_max_tokens(llm, hf_qwen3):
    (out,) = generate(llm, [PROMPT], greedy(max_tokens=5, hidden_states_layers=[3]))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    assert_close(out.outputs[0].hidden_states[3], hf_qwen3.last(token_ids_of(out), 3), "len")


def test_requests_that_do_not_ask_get_none(llm):
    (out,) = generate(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=4))
    assert out.outputs[0].hidden_states is None


def test_out_of_range_layer_is_rejected_naming_valid_range(llm, hf_qwen3):
    n = hf_qwen3.num_layers
    message = (
        f"layer {10 * n} is out of range for a {n}-layer model; valid indices are {-(n + 1)}..{n}"
    )
    with pytest.raises(VLLMValidationError, match=re.escape(message)):
        generate(llm, [PROMPT], greedy(hidden_states_layers=[10 * n]))


def test_a_layer_named_twice_is_rejected_as_over_http(llm, hf_qwen3):
    n = hf_qwen3.num_layers
    message = f"hidden_states_layers names layer {n} twice (-1 and {n}); name each layer once"
    with pytest.raises(VLLMValidationError, match=re.escape(message)):
        generate(llm, [PROMPT], greedy(hidden_states_layers=[-1, n]))


def test_bad_positions_value_is_rejected(llm):
    with pytest.raises(
        VLLMValidationError,
        match=r"hidden_states_positions must be one of "
        r"\['last', 'all', 'prompt', 'generated'\] or a window",
    ):
        generate(llm, [PROMPT], greedy(hidden_states_positions="first"))


def test_layers_without_return_flag_is_rejected(llm):
    with pytest.raises(VLLMValidationError, match="return_hidden_states is not true"):
        generate(llm, [PROMPT], SamplingParams(max_tokens=2, hidden_states_layers=[1]))


def test_engine_keeps_serving_after_rejected_request(llm, hf_qwen3):
    with pytest.raises(VLLMValidationError):
        generate(llm, [PROMPT], greedy(hidden_states_layers=[-9]))
    (out,) = generate(llm, [PROMPT], greedy())
    assert_close(out.outputs[0].hidden_states[-1], hf_qwen3.last(token_ids_of(out), -1), "after")


@pytest.mark.four_modes
def test_abort_while_extract_pending_leaves_nothing_held(llm):
    engine = llm.llm_engine
    engine.add_request("abort-me", LONG_PROMPT, greedy(max_tokens=2, hidden_states_positions="all"))
    processor = engine.output_processor
    for _ in range(50):
        engine.step()
        if processor.extract_dispatcher.num_held:
            break
    assert processor.extract_dispatcher.num_held == 1  # final output held, extract queued
    engine.abort_request(["abort-me"], internal=False)
    for _ in range(10):
        engine.step()
    scheduler = engine.engine_core.engine_core.scheduler
    assert processor.get_num_unfinished_requests() == 0
    assert processor.extract_dispatcher.num_held == 0
    assert not scheduler.requests and not scheduler.capture_planner.active
    (out,) = generate(llm, [PROMPT], greedy())
    assert out.outputs[0].hidden_states is not None


def test_compiled_engine_matches_hf_over_zmq(llm_compiled, hf_llama):
    params = [
        greedy(hidden_states_layers=[-1, 0, 2]),
        greedy(hidden_states_layers=[-2], hidden_states_positions="all"),
    ]
    outs = generate(llm_compiled, [PROMPT, LONG_PROMPT], params)
    assert outs[0].prompt_token_ids[0] == llm_compiled.get_tokenizer().bos_token_id
    ref = hf_llama.states(token_ids_of(outs[0]))
    for layer in (-1, 0, 2):
        assert_close(outs[0].outputs[0].hidden_states[layer], ref[layer][-1:], f"layer {layer}")
    ref = hf_llama.states(token_ids_of(outs[1]))
    assert_close(outs[1].outputs[0].hidden_states[-2], ref[-2], "all, layer -2")


def test_layer_outside_capturable_set_is_rejected_naming_the_set(llm_compiled):
    with pytest.raises(
        VLLMValidationError,
        match=r"layer 1 is not capturable on this engine; "
        r"capturable layers: 0, 2, -2, -1",
    ):
        generate(llm_compiled, [PROMPT], greedy(hidden_states_layers=[1]))


def test_output_stops_one_short_of_max_model_len_so_the_last_state_exists(llm, hf_qwen3):
    max_model_len = llm.llm_engine.model_config.max_model_len
    prompt = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(max_model_len - 12)]}
    params = greedy(max_tokens=100, ignore_eos=True)
    (out,) = generate(llm, [prompt], params)
    ids = token_ids_of(out)
    assert len(ids) == max_model_len - 1 and out.outputs[0].finish_reason == "length"
    assert_close(out.outputs[0].hidden_states[-1], hf_qwen3.last(ids, -1), "at max_model_len-1")
