# SPDX-License-Identifier: Apache-2.0
"""CapturedRows: every kind of captured data joined and cut along positions by
one path (vllm_hidden_states.wire)."""

import msgspec
import torch

from vllm.v1.engine import CapturedRows, EngineCoreOutput, EngineCoreOutputs
from vllm_hidden_states import wire
from vllm_hidden_states.frontend.firings import record_firings
from vllm_hidden_states.wire import (
    POSITION_AXIS,
    cat_rows,
    group_rows,
    hand_out_captured,
    num_positions,
    slice_rows,
    split_group,
    without,
)

LAYERS, HIDDEN, K = 3, 8, 4


def rows(start: int, count: int, features: bool = True) -> CapturedRows:
    """Rows whose values name their position, so joins and cuts are checkable."""
    pos = torch.arange(start, start + count, dtype=torch.float32)
    hidden = pos[None, :, None].expand(LAYERS, count, HIDDEN).clone()
    if not features:
        return CapturedRows(hidden=hidden)
    ids = pos.to(torch.int32)[:, None].expand(count, K).clone()
    return CapturedRows(
        hidden=hidden, sae_ids=ids, sae_values=pos[:, None].expand(count, K).clone()
    )


def assert_same(a: CapturedRows, b: CapturedRows) -> None:
    for name in POSITION_AXIS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


GROUP_FIELDS = {"req_ids", "counts", "firsts", "op_results"}


def test_every_data_field_has_a_position_axis():
    data = {f.name for f in msgspec.structs.fields(CapturedRows)} - GROUP_FIELDS
    assert data == set(POSITION_AXIS)


def test_consecutive_parts_join_into_the_whole_run():
    parts = [rows(0, 2), rows(2, 3), rows(5, 1)]
    assert_same(cat_rows(parts), rows(0, 6))
    assert num_positions(cat_rows(parts)) == 6


def test_a_slice_is_the_run_of_those_positions():
    whole = rows(0, 6)
    assert_same(slice_rows(whole, 2, 5), rows(2, 3))
    assert_same(slice_rows(whole, 4), rows(4, 2))
    assert num_positions(slice_rows(whole, 0, 0)) == 0


def test_absent_fields_stay_absent():
    joined = cat_rows([rows(0, 2, features=False), rows(2, 2, features=False)])
    assert joined.sae_ids is None and joined.sae_values is None
    assert_same(joined, rows(0, 4, features=False))


def test_rows_round_trip_through_vllms_msgpack():
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    original = rows(0, 5)
    frames = MsgpackEncoder().encode(original)
    assert_same(MsgpackDecoder(CapturedRows).decode(frames), original)


def step_group(counts: list[int]) -> CapturedRows:
    """One step's rows of requests r0, r1, ... (``counts`` positions each),
    as one group whose values name their positions."""
    group = rows(0, sum(counts))
    group.req_ids = [f"r{i}" for i in range(len(counts))]
    group.counts = counts
    group.firsts = [100 * i for i in range(len(counts))]
    return group


def test_a_group_splits_into_each_requests_run_in_order():
    parts = dict(split_group(step_group([2, 1, 3])))
    assert list(parts) == ["r0", "r1", "r2"]
    assert_same(parts["r0"], rows(0, 2))
    assert_same(parts["r1"], rows(2, 1))
    assert_same(parts["r2"], rows(3, 3))


def test_a_group_of_one_is_its_requests_rows():
    one = group_rows(rows(0, 4), "r9", 0)
    assert (one.req_ids, one.counts) == (["r9"], [4])
    [(req_id, part)] = split_group(one)
    assert req_id == "r9"
    assert_same(part, rows(0, 4))


def test_a_group_without_some_requests_keeps_the_others_rows():
    kept = without(step_group([2, 1, 3]), {"r1"})
    assert (kept.req_ids, kept.counts, kept.firsts) == (["r0", "r2"], [2, 3], [0, 200])
    parts = dict(split_group(kept))
    assert_same(parts["r2"], rows(3, 3))
    assert without(step_group([2]), {"r0"}) is None


def test_the_client_records_a_steps_firings_as_it_hands_them_out():
    """A request whose only actions are server monitors has no tracker in the
    front-end: its firings are recorded as they pass the client."""
    from vllm_hidden_states.contract import OpResults, ProbeFiring

    seen = []
    wire.on_firings(lambda request_id, firings: seen.append((request_id, firings)))
    try:
        firing = ProbeFiring(label="harm", position=7, score=0.9, monitor=True)
        outputs = EngineCoreOutputs(
            outputs=[EngineCoreOutput(request_id="m", new_token_ids=[1])],
            captured=[
                CapturedRows(req_ids=["m"], counts=[0], op_results=OpResults(firings=[firing]))
            ],
        )
        hand_out_captured(outputs)
    finally:
        wire.on_firings(record_firings)
    assert seen == [("m", [firing])]


def test_the_client_hands_each_output_its_rows_from_the_step_group():
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=f"r{i}", new_token_ids=[1]) for i in range(3)]
        + [EngineCoreOutput(request_id="plain", new_token_ids=[1])],
        captured=[step_group([1, 2, 1])],
    )
    hand_out_captured(outputs)
    assert outputs.captured is None
    by_id = {o.request_id: o for o in outputs.outputs}
    assert_same(by_id["r1"].captured, rows(1, 2))
    assert_same(by_id["r2"].captured, rows(3, 1))
    assert by_id["plain"].captured is None


def test_a_steps_group_crosses_msgpack_as_one_frame_per_field():
    """Not a frame per request: 24 requests' rows cost three frames (hidden,
    sae ids, sae values) plus the message."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=f"r{i}", new_token_ids=[1]) for i in range(24)],
        captured=[step_group([1] * 24)],
    )
    frames = MsgpackEncoder(size_threshold=0).encode(outputs)
    assert len(frames) == 1 + 3
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    hand_out_captured(decoded)
    for i, eco in enumerate(decoded.outputs):
        assert_same(eco.captured, rows(i, 1))


def test_rows_of_a_request_without_an_output_are_dropped_not_raised():
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id="r0", new_token_ids=[1])],
        captured=[step_group([1, 1])],
    )
    hand_out_captured(outputs)
    assert_same(outputs.outputs[0].captured, rows(0, 1))


def test_a_value_of_op_results_only_joins_the_rows_of_its_request():
    from vllm_hidden_states.contract import OpResults, ProbeFiring
    from vllm_hidden_states.wire import with_op_results

    firing = ProbeFiring(label="harm", position=4, score=0.9)
    ops = CapturedRows(op_results=OpResults(firings=[firing]))
    for first, second in ((rows(0, 2), ops), (ops, rows(0, 2))):
        joined = with_op_results(first, second)
        assert_same(joined, rows(0, 2))
        assert joined.op_results.firings == [firing]


def wide_rows(start: int, count: int) -> CapturedRows:
    """Rows with two points of their own widths (an mlp_post 16 wide, an
    attn_z 6 wide) whose values name their position."""
    pos = torch.arange(start, start + count, dtype=torch.float32)[:, None]
    return CapturedRows(
        hidden=pos[None].expand(LAYERS, count, HIDDEN).clone(),
        neurons=[pos.expand(count, 16).clone(), -pos.expand(count, 6).clone()],
    )


def assert_same_wide(a: CapturedRows, b: CapturedRows) -> None:
    assert torch.equal(a.hidden, b.hidden)
    assert len(a.neurons) == len(b.neurons)
    for x, y in zip(a.neurons, b.neurons):
        assert torch.equal(x, y)


def test_points_of_different_widths_join_cut_and_split_per_point():
    """mlp_post and attn_z rows (intermediate_size and heads * head_dim
    wide) travel as one tensor per point, each cut along its positions."""
    joined = cat_rows([wide_rows(0, 2), wide_rows(2, 3)])
    assert_same_wide(joined, wide_rows(0, 5))
    assert num_positions(joined) == 5
    assert num_positions(CapturedRows(neurons=wide_rows(0, 3).neurons)) == 3
    assert_same_wide(slice_rows(joined, 1, 4), wide_rows(1, 3))
    group = group_rows(wide_rows(0, 5), "r0", 0)
    group.req_ids, group.counts = ["r0", "r1"], [2, 3]
    parts = dict(split_group(group))
    assert_same_wide(parts["r0"], wide_rows(0, 2))
    assert_same_wide(parts["r1"], wide_rows(2, 3))


def test_points_of_different_widths_cross_vllms_msgpack():
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=f"r{i}", new_token_ids=[1]) for i in range(2)],
        captured=[
            cat_rows(
                [group_rows(wide_rows(0, 1), "r0", 0), group_rows(wide_rows(1, 2), "r1", 1)],
                grouped=True,
            )
        ],
    )
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    hand_out_captured(decoded)
    assert_same_wide(decoded.outputs[0].captured, wide_rows(0, 1))
    assert_same_wide(decoded.outputs[1].captured, wide_rows(1, 2))
