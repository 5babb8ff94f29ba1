# SPDX-License-Identifier: Apache-2.0
"""A request whose hidden states could not be captured fails visibly.

The failure is forced between the real engine and the real front-end: the
in-process engine's ``get_output`` is wrapped for one test so that the rows
the engine captured for one request go missing on their way to the
OutputProcessor (what the async-scheduling defect did on a GPU: rows that
never arrived). The caller must see ``finish_reason == "error"`` and
``RequestOutput.error``, never ``hidden_states=None`` with a normal finish;
and the engine keeps serving exact states afterwards.
"""

import pytest

from vllm import SamplingParams
from vllm_hidden_states.frontend.dispatcher import CAPTURE_FAILED
from vllm_hidden_states.wire import extract_id_for

from .conftest import assert_close
from .test_inline import assert_nothing_held

PROMPT = "The robot counted the stars one by one until the sky went dark"


@pytest.fixture
def drop_rows(llm, monkeypatch):
    """``drop_rows(pred)``: from now on, the hidden states of every
    EngineCoreOutput for which ``pred(output)`` holds are lost in transit."""
    client = llm.llm_engine.engine_core
    get_output = client.get_output

    def install(pred):
        def lossy_get_output():
            outputs = get_output()
            for eco in outputs.outputs:
                if eco.captured is not None and pred(eco):
                    eco.captured = None
            return outputs

        monkeypatch.setattr(client, "get_output", lossy_get_output)

    return install


def generate_one(llm, params: SamplingParams):
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    return out


def assert_failed_visibly(out):
    completion = out.outputs[0]
    assert completion.finish_reason == "error"
    assert completion.stop_reason.startswith(CAPTURE_FAILED + ": ")
    assert completion.hidden_states is None
    return completion.stop_reason


def test_all_positions_whose_decode_rows_never_arrived_finish_with_an_error(llm, drop_rows):
    seen = set()

    def second_chunk_of_any_request(eco):
        if eco.request_id in seen:
            return True
        seen.add(eco.request_id)
        return False

    drop_rows(second_chunk_of_any_request)
    params = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_positions="all",
    )
    out = generate_one(llm, params)
    assert "inline positions arrived" in assert_failed_visibly(out)
    assert_nothing_held(llm)


def test_last_position_whose_extract_returned_no_rows_finishes_with_an_error(llm, drop_rows):
    drop_rows(lambda eco: eco.request_id.endswith(extract_id_for("")))
    params = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_layers=[-1, 1],
    )
    out = generate_one(llm, params)
    assert "extraction failed" in assert_failed_visibly(out)
    assert_nothing_held(llm)


def test_prompt_positions_whose_prefill_rows_never_arrived_finish_with_an_error(llm, drop_rows):
    drop_rows(lambda eco: True)
    params = SamplingParams(
        max_tokens=3,
        temperature=0.0,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_positions="prompt",
    )
    out = generate_one(llm, params)
    assert "no prompt rows" in assert_failed_visibly(out)
    assert_nothing_held(llm)


def test_engine_serves_exact_states_after_a_failed_capture(llm, drop_rows, hf_qwen3):
    drop_rows(lambda eco: True)
    params = SamplingParams(
        max_tokens=3, temperature=0.0, return_hidden_states=True, hidden_states_layers=[-2]
    )
    assert_failed_visibly(generate_one(llm, params))
    drop_rows(lambda eco: False)
    out = generate_one(llm, params)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason in ("length", "stop")
    assert_close(out.outputs[0].hidden_states[-2], hf_qwen3.last(ids, -2), "layer -2")
