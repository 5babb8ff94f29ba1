# SPDX-License-Identifier: Apache-2.0
"""The capture plan: the planner works out each request's rows for a step
(offset from its first scheduled token, count, done), and the worker turns
them into batch rows. Stand-ins replace the scheduler's requests and the
runner's batch; the arithmetic is the package's own."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hidden_states.engine.planner import CapturePlanner
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.wire import HiddenStatesSpec
from vllm_hidden_states.worker.capture import HiddenStatesCapture
from vllm_hidden_states.worker.step_batch import StepBatch

L = 4  # decoder layers of the stand-in model


def make_planner(monkeypatch, data_parallel_size: int = 1, external_lb: bool = False):
    config = HiddenStatesConfig(num_layers=L, layers=tuple(range(L + 1)), max_rows=64)
    monkeypatch.setattr(HiddenStatesConfig, "from_vllm_config", staticmethod(lambda _: config))
    return CapturePlanner(
        SimpleNamespace(
            additional_config={},  # no steering: no patch table
            model_config=SimpleNamespace(max_model_len=512),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
            parallel_config=SimpleNamespace(
                data_parallel_size=data_parallel_size, data_parallel_external_lb=external_lb
            ),
        )
    )


@pytest.fixture
def planner(monkeypatch) -> CapturePlanner:
    return make_planner(monkeypatch)


def plan_of(planner: CapturePlanner, requests: dict[str, tuple[int, int, int]]):
    """The plan of one step: ``requests`` maps an id to (computed tokens,
    sequence length, tokens scheduled now)."""
    scheduler = SimpleNamespace(
        requests={
            rid: SimpleNamespace(
                num_computed_tokens=computed, num_tokens=length, num_output_placeholders=0
            )
            for rid, (computed, length, _) in requests.items()
        }
    )
    output = SimpleNamespace(
        num_scheduled_tokens={rid: n for rid, (_, _, n) in requests.items()}, capture_plan=None
    )
    planner.plan_step(scheduler, output)
    return output.capture_plan


def test_a_decode_step_of_inline_all_captures_is_one_group_of_a_row_each(planner):
    for rid in ("a", "b", "c"):
        planner.active[rid] = planner._spec((2,), "all", None)
    plan = plan_of(planner, {"a": (40, 41, 1), "b": (7, 8, 1), "c": (12, 13, 1)})
    assert plan.req_ids == ["a", "b", "c"]
    assert plan.offsets == [0, 0, 0] and plan.counts == [1, 1, 1]
    assert plan.done == [True, True, True] and plan.one_group
    assert len(plan.kinds) == 1 and plan.kind_of == [0, 0, 0]


def test_a_last_capture_gets_its_row_only_in_the_chunk_that_computes_its_last_position(
    planner,
):
    planner.active["x"] = planner._spec((1, L), "last", 20)
    first_chunk = plan_of(planner, {"x": (0, 20, 16)})
    assert first_chunk.counts == [0] and first_chunk.done == [False]
    assert not first_chunk.one_group
    last_chunk = plan_of(planner, {"x": (16, 20, 4)})
    assert last_chunk.offsets == [3] and last_chunk.counts == [1] and last_chunk.done == [True]


def test_delivered_positions_and_a_window_end_bound_an_all_captures_rows(planner):
    spec = planner._spec((2,), "all", None)
    spec.delivered, spec.end = 5, 9  # positions 5..8 of the sequence
    planner.active["w"] = spec
    plan = plan_of(planner, {"w": (0, 12, 12)})
    assert plan.offsets == [5] and plan.counts == [4] and plan.done == [True]


def test_a_step_recomputing_only_delivered_positions_plans_nothing(planner):
    spec = planner._spec((2,), "all", None)
    spec.delivered = 30  # delivered before a preemption
    planner.active["p"] = spec
    assert plan_of(planner, {"p": (0, 31, 16)}) is None


class Points:
    """Stands in for the capture points: records what is armed."""

    def __init__(self) -> None:
        self.rows = torch.zeros(64, dtype=torch.int64)
        self.armed: tuple[list[int], set[int]] | None = None

    def arm(self, rows: np.ndarray, layers: set[int]) -> None:
        self.rows[: len(rows)] = torch.from_numpy(rows)
        self.armed = (rows.tolist(), set(layers))


def armed_rows(plan, batch: list[str], query_start: list[int]) -> HiddenStatesCapture:
    """A worker-side capture state armed with ``plan`` over a batch whose
    requests ``batch`` start at rows ``query_start``."""
    capture = HiddenStatesCapture.__new__(HiddenStatesCapture)
    capture.plan, capture.points = plan, Points()
    capture._partial, capture._ready, capture._armed, capture._group = {}, {}, [], None
    capture.final_layer, capture.sae_layer = L, None
    step_batch = StepBatch(
        index_of={rid: i for i, rid in enumerate(batch)},
        query_start=np.array(query_start, dtype=np.int32),
        num_computed=np.zeros(len(batch), dtype=np.int32),
    )
    capture._arm(step_batch, torch.device("cpu"))
    return capture


def test_the_worker_arms_a_decode_group_at_each_requests_batch_row(planner):
    for rid in ("a", "b", "c"):
        planner.active[rid] = planner._spec((2,), "all", None)
    plan = plan_of(planner, {"a": (40, 41, 1), "b": (7, 8, 1), "c": (12, 13, 1)})
    capture = armed_rows(plan, ["c", "a", "b"], [0, 1, 2, 3])
    assert capture.points.armed == ([1, 2, 0], {2})
    assert capture._group is not None and capture._group.req_ids == ["a", "b", "c"]


def test_the_worker_arms_a_mixed_step_request_by_request(planner):
    planner.active["d"] = planner._spec((2,), "all", None)  # decoding
    planner.active["x"] = planner._spec((1, L), "last", 20)  # prefill, last chunk
    plan = plan_of(planner, {"d": (9, 10, 1), "x": (16, 20, 4)})
    capture = armed_rows(plan, ["x", "d"], [0, 4, 5])
    # d's row is batch row 4; x's last position is the 4th of its chunk.
    assert capture.points.armed == ([4, 3], {1, 2, L})
    assert capture._group is None
    assert [(a.req_id, a.offset, a.count, a.inner_offset) for a in capture._armed] == [
        ("d", 0, 1, 0),
        ("x", 1, 1, 1),
    ]


def finished_request(spec: HiddenStatesSpec, num_tokens: int = 20, stop: list[str] | None = None):
    """A stand-in of a request that finished in the engine (EOS, stop token, length)."""
    return SimpleNamespace(
        hidden_states_spec=spec,
        num_tokens=num_tokens,
        sampling_params=SimpleNamespace(stop=stop or []),
    )


LAST = HiddenStatesSpec(layers=[-1], abs_layers=[L], positions="last")


def test_the_engine_queues_the_extract_of_a_last_request_without_stop_strings(planner):
    assert planner.engine_queues_extract(finished_request(LAST))


def test_a_request_with_stop_strings_leaves_its_extract_to_the_front_end(planner):
    # Only the front-end matches (and trims) stop strings: its token list is final.
    assert not planner.engine_queues_extract(finished_request(LAST, stop=["\n\n"]))


def test_a_prompt_capture_has_no_extract(planner):
    spec = HiddenStatesSpec(layers=[-1], abs_layers=[L], positions="prompt")
    assert not planner.engine_queues_extract(finished_request(spec))


def test_an_inline_window_ending_before_the_final_token_has_no_extract(planner):
    window = HiddenStatesSpec(layers=[1], abs_layers=[1], positions="all", inline=True, end=10)
    assert not planner.engine_queues_extract(finished_request(window, num_tokens=20))
    assert planner.engine_queues_extract(finished_request(window, num_tokens=10))


def test_a_load_balancing_data_parallel_front_end_sends_every_extract(monkeypatch):
    # It routes each extract to its request's engine and counts it in flight.
    assert not make_planner(monkeypatch, 2).engine_queues_extract(finished_request(LAST))
    external = make_planner(monkeypatch, 2, external_lb=True)  # one engine per front-end
    assert external.engine_queues_extract(finished_request(LAST))
