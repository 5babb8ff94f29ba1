# SPDX-License-Identifier: Apache-2.0
"""Positions beyond "last"/"all"/"prompt": ``"generated"`` (output positions
only) and windows ``{"start": s, "end": e}`` over prompt + output.

The session engine (tiny Qwen3, 24-row capture buffers, prefix caching on),
every row compared with HF transformers on the token ids vLLM reports. A
window is captured inline like "all", only its own rows; one that ends before
the final token needs no extract.
"""

import pytest
import torch

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from .conftest import assert_close, token_ids_of
from .test_inline import assert_nothing_held

PROMPT = "Once upon a time there was a small robot who loved to count"
LAYERS = [0, 2, -1]


def states(llm, positions, prompt=PROMPT, max_tokens=8, **kwargs):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_layers=LAYERS,
        hidden_states_positions=positions,
        **kwargs,
    )
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0].hidden_states, token_ids_of(out), len(out.prompt_token_ids)


def assert_rows(got, hf, ids, span: slice, what: str):
    reference = hf.states(ids)
    for layer in LAYERS:
        expected = reference[layer][span]
        assert got[layer].shape == expected.shape, (what, layer, got[layer].shape)
        assert_close(got[layer], expected, f"{what} layer {layer}")


def test_generated_is_every_output_position(llm, hf_qwen3):
    got, ids, prompt_len = states(llm, "generated")
    assert got[-1].shape[0] == len(ids) - prompt_len
    assert_rows(got, hf_qwen3, ids, slice(prompt_len, None), "generated")


def test_a_window_inside_the_prompt_is_its_rows_only(llm, hf_qwen3):
    got, ids, _ = states(llm, {"start": 2, "end": 7})
    assert_rows(got, hf_qwen3, ids, slice(2, 7), "window in the prompt")


def test_a_window_ending_before_the_final_token_keeps_no_kv_blocks(llm):
    # No extract follows it, so its finished blocks go back to the pool at once.
    states(llm, {"start": 2, "end": 7})
    assert_nothing_held(llm)


@pytest.mark.four_modes
def test_a_window_across_prompt_and_output(llm, hf_qwen3):
    _, _, prompt_len = states(llm, "last", max_tokens=1)
    window = {"start": prompt_len - 3, "end": prompt_len + 2}
    got, ids, _ = states(llm, window)
    assert_rows(got, hf_qwen3, ids, slice(prompt_len - 3, prompt_len + 2), "across")


def test_an_open_window_runs_to_the_final_token(llm, hf_qwen3):
    got, ids, _ = states(llm, {"start": 5})
    assert_rows(got, hf_qwen3, ids, slice(5, None), "open window")


@pytest.mark.four_modes
def test_a_window_longer_than_the_capture_buffers_is_split_over_steps(llm, hf_qwen3):
    prompt = " ".join([PROMPT] * 5)  # ~60 tokens; the buffers hold 24 rows
    got, ids, _ = states(llm, {"start": 4, "end": 55}, prompt=prompt, max_tokens=2)
    assert_rows(got, hf_qwen3, ids, slice(4, 55), "long window")


def test_a_window_reaching_past_the_sequence_has_the_rows_that_exist(llm, hf_qwen3):
    """The window may end past the final token (max_tokens allows it; a stop
    string ends generation first): the answer has the positions that exist."""
    _, _, prompt_len = states(llm, "last", max_tokens=1)
    window = {"start": prompt_len + 2, "end": prompt_len + 10}
    got, ids, _ = states(llm, window, max_tokens=10, stop=[" "], include_stop_str_in_output=False)
    assert len(ids) < prompt_len + 10
    assert got[-1].shape == (max(len(ids) - (prompt_len + 2), 0), hf_qwen3.hidden_size)
    if len(ids) > prompt_len + 2:
        assert_rows(got, hf_qwen3, ids, slice(prompt_len + 2, None), "window past the end")


def test_a_window_starting_past_the_reachable_positions_is_refused(llm):
    with pytest.raises(VLLMValidationError, match="past the last position"):
        states(llm, {"start": 500}, max_tokens=4)


def test_a_window_ending_past_the_reachable_positions_is_refused(llm):
    with pytest.raises(VLLMValidationError, match="lower end or leave it out"):
        states(llm, {"start": 0, "end": 500}, max_tokens=4)


@pytest.mark.four_modes
def test_generated_reads_the_prefix_cache_and_stays_exact(llm, hf_qwen3):
    """Prompt rows are not asked, so the prompt may come from the prefix
    cache: the same request twice gives the same rows."""
    salted = {"prompt": PROMPT, "cache_salt": "windows-generated"}
    first, ids, prompt_len = states(llm, "generated", prompt=salted)
    again, ids_again, _ = states(llm, "generated", prompt=salted)
    assert ids == ids_again
    for layer in LAYERS:
        assert torch.equal(first[layer], again[layer]), layer
    assert_rows(again, hf_qwen3, ids, slice(prompt_len, None), "generated, cached prompt")
