# SPDX-License-Identifier: Apache-2.0
"""CapturedRows: every kind of captured data joined and cut along positions by
one path (vllm_hidden_states.wire)."""

import msgspec
import torch

from vllm.v1.engine import CapturedRows
from vllm_hidden_states.wire import POSITION_AXIS, cat_rows, num_positions, slice_rows

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


def test_every_field_has_a_position_axis():
    assert {f.name for f in msgspec.structs.fields(CapturedRows)} == set(POSITION_AXIS)


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
