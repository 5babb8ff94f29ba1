# SPDX-License-Identifier: Apache-2.0
"""DELTA outputs that vLLM merges because the consumer lagged behind
(``RequestOutputCollector``) keep every row and every SAE feature."""

import torch

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.output_processor import RequestOutputCollector


def delta(token: int, rows: torch.Tensor | None, features=None, finished=False) -> RequestOutput:
    completion = CompletionOutput(
        0,
        "x",
        [token],
        None,
        None,
        finish_reason="length" if finished else None,
        hidden_states=None if rows is None else {-1: rows, 0: rows + 1},
        sae_features=features,
    )
    return RequestOutput("r", None, [1, 2], None, [completion], finished)


def features(ids: list[int]) -> dict:
    return {
        "layer": 2,
        "ids": torch.tensor([ids], dtype=torch.int32),
        "values": torch.tensor([[float(i) for i in ids]]),
    }


def test_merged_delta_outputs_concatenate_their_rows_in_order():
    collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    first, second = torch.zeros(2, 4), torch.ones(1, 4)
    collector.put(delta(7, first))
    collector.put(delta(8, second))  # not consumed in between: merged
    merged = collector.get_nowait().outputs[0]
    assert merged.token_ids == [7, 8]
    assert torch.equal(merged.hidden_states[-1], torch.cat([first, second]))
    assert torch.equal(merged.hidden_states[0], torch.cat([first, second]) + 1)


def test_a_merged_output_without_rows_keeps_the_earlier_rows():
    collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    collector.put(delta(7, torch.zeros(3, 4)))
    collector.put(delta(8, None))
    assert collector.get_nowait().outputs[0].hidden_states[-1].shape == (3, 4)


def test_merged_delta_outputs_concatenate_sae_features():
    collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    collector.put(delta(7, None, features([4, 1])))
    collector.put(delta(8, None, features([9, 3]), finished=True))
    merged = collector.get_nowait().outputs[0].sae_features
    assert merged["layer"] == 2
    assert merged["ids"].tolist() == [[4, 1], [9, 3]]
    assert merged["values"].tolist() == [[4.0, 1.0], [9.0, 3.0]]
