# SPDX-License-Identifier: Apache-2.0
"""The front-end's OutputProcessor (patch 0004), fed engine outputs by hand in
the order a busy engine sends them: no engine runs here, so the order is
exact, not a race."""

import json

import pytest
import torch

from vllm import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.v1.engine import CapturedRows, EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor
from vllm_hidden_states.frontend.dispatcher import CAPTURE_FAILED, ExtractDispatcher
from vllm_hidden_states.wire import HiddenStatesSpec, extract_id_for

from .conftest import engine_core_request

REQ_ID = "stop-1"


@pytest.fixture()
def processor_and_tokens(qwen3_dir):
    """An OutputProcessor with one request that asked for the last position's
    states and stops on a string, and the token ids of
    ``" alpha beta gamma delta"`` (the stop string is ``"gamma"``)."""
    tokenizer = get_tokenizer(str(qwen3_dir))
    processor = OutputProcessor(tokenizer, log_stats=False)
    request = engine_core_request(
        REQ_ID,
        tokenizer.encode("A prompt"),
        SamplingParams(max_tokens=16, temperature=0.0, stop=["gamma"]),
        HiddenStatesSpec(layers=[-1], abs_layers=[2], positions="last"),
    )
    processor.add_request(request, prompt=None)
    return processor, tokenizer.encode(" alpha beta gamma delta")


def _step(processor: OutputProcessor, token_ids: list[int]):
    return processor.process_outputs([EngineCoreOutput(request_id=REQ_ID, new_token_ids=token_ids)])


def _stop_then_late_tokens(processor: OutputProcessor, tokens: list[int]) -> list:
    """The stop string matches in the first output (the request is held and
    its abort sent); the engine, not yet aborted, sends two more tokens.
    Returns the processor's answers to those two."""
    first = _step(processor, tokens)
    assert [e.request_id for e in first.hidden_states_extracts] == [f"{REQ_ID}-hs"]
    assert REQ_ID in first.reqs_to_abort
    return [_step(processor, [token]) for token in tokens[:2]]


def test_tokens_sent_before_the_engine_saw_the_abort_send_no_second_extract(
    processor_and_tokens,
):
    processor, tokens = processor_and_tokens
    late = _stop_then_late_tokens(processor, tokens)
    assert [out.hidden_states_extracts for out in late] == [[], []]
    dispatcher = ExtractDispatcher.of(processor)
    assert dispatcher.num_held == 1
    assert dispatcher.holds(processor.request_states[REQ_ID])


def test_tokens_sent_before_the_engine_saw_the_abort_never_reach_the_request(
    processor_and_tokens,
):
    processor, tokens = processor_and_tokens
    late = _stop_then_late_tokens(processor, tokens)
    assert [out.request_outputs for out in late] == [[], []]
    text = processor.request_states[REQ_ID].detokenizer.output_text
    assert "gamma" not in text and "delta" not in text
    assert text.endswith("beta ")


def _extract_result(rows: CapturedRows | None) -> EngineCoreOutput:
    """The finished output of the request's HIDDEN_STATES_EXTRACT."""
    return EngineCoreOutput(
        request_id=extract_id_for(REQ_ID),
        new_token_ids=[0],
        finish_reason=FinishReason.LENGTH,
        captured=rows,
    )


def _one_row(qwen3_dir) -> torch.Tensor:
    """The final token's state at one layer: ``[1 layer, 1 position, hidden_size]``."""
    hidden_size = json.loads((qwen3_dir / "config.json").read_text())["hidden_size"]
    return torch.randn(1, 1, hidden_size)


def test_the_extracts_result_emits_the_held_output_with_its_states(processor_and_tokens, qwen3_dir):
    processor, tokens = processor_and_tokens
    _step(processor, tokens)
    row = _one_row(qwen3_dir)
    released = processor.process_outputs([_extract_result(CapturedRows(hidden=row))])
    [output] = released.request_outputs
    assert output.finished
    completion = output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "gamma"
    assert completion.text.endswith("beta ")
    assert torch.equal(completion.hidden_states[-1], row[0])


def test_a_released_request_is_freed(processor_and_tokens, qwen3_dir):
    processor, tokens = processor_and_tokens
    _step(processor, tokens)
    processor.process_outputs([_extract_result(CapturedRows(hidden=_one_row(qwen3_dir)))])
    assert processor.get_num_unfinished_requests() == 0
    assert ExtractDispatcher.of(processor).num_held == 0


def test_an_extract_without_rows_emits_the_held_output_as_a_failure(processor_and_tokens):
    processor, tokens = processor_and_tokens
    _step(processor, tokens)
    [output] = processor.process_outputs([_extract_result(None)]).request_outputs
    completion = output.outputs[0]
    assert completion.finish_reason == "error"
    assert completion.stop_reason.startswith(CAPTURE_FAILED + ": ")
    assert completion.hidden_states is None
    assert processor.get_num_unfinished_requests() == 0


def test_aborting_a_held_request_aborts_its_extract_too(processor_and_tokens):
    processor, tokens = processor_and_tokens
    _step(processor, tokens)
    aborted = processor.abort_requests([REQ_ID], internal=True)
    assert set(aborted) == {REQ_ID, extract_id_for(REQ_ID)}
    assert ExtractDispatcher.of(processor).num_held == 0
    # The extract's result, if the engine had sent it already, reaches no one.
    late = processor.process_outputs([_extract_result(None)])
    assert late.request_outputs == []
