# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.sweep without an engine: the plan's checks, the cells'
patches (the heads axis included, switched on here), the answer's shapes."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_hidden_states import sweep
from vllm_hidden_states.points import parse_point, point_id

L, HEADS, HEAD_DIM, VOCAB = 4, 2, 3, 50


class FakeCaptures:
    """Captures resid_pre and attn_z (as an engine with --hidden-states-points attn_z)."""

    def resolve_points(self, addresses):
        out = []
        for a in addresses:
            kind, layer = parse_point(a, L)
            if kind not in ("resid_pre", "attn_z"):
                raise ValueError(f"hidden_states_points {a!r} is not capturable on this engine")
            out.append(point_id(kind, layer, L))
        return out


def steer_cfg():
    ids = {point_id(k, i, L) for k in ("resid_pre", "attn_out", "attn_z") for i in range(L)}
    return SimpleNamespace(
        num_layers=L, ids=ids, max_patch_rows=64, describe_points=lambda: "resid_pre, attn_out"
    )


def encode(text: str) -> list[int]:
    return [len(w) for w in text.split()]


def plan(max_cells: int = 100, **over):
    kw = dict(clean="aa bbb c", corrupted="dd eee f", points=["resid_pre.1"],
              metric={"logit_diff": ["aaaa", 7]})  # fmt: skip
    engine = sweep.SweepEngine(hs_cfg=FakeCaptures(), steer_cfg=steer_cfg(), vocab_size=VOCAB,
                               max_model_len=64, num_heads=HEADS, encode=encode,
                               encode_token=encode, max_cells=max_cells)  # fmt: skip
    return sweep.plan(**{**kw, **over}, engine=engine)


def test_a_plan_expands_points_by_positions_and_reads_its_metric():
    p = plan(points=["resid_pre.1", "resid_pre.3"], positions=[0, 2])
    assert p.clean_ids == [2, 3, 1] and p.metric == sweep.Metric("logit_diff", (4, 7))
    assert [(c.point, c.position) for c in p.cells()] == [
        ("resid_pre.1", 0), ("resid_pre.1", 2), ("resid_pre.3", 0), ("resid_pre.3", 2)
    ]  # fmt: skip
    assert p.metric.value({4: -1.0, 7: -3.5, 9: 0.0}) == 2.5


@pytest.mark.parametrize(
    "over, param, needle",
    [
        (dict(corrupted="dd eee"), "corrupted", "same token length"),
        (dict(points=["mlp_out.1"]), "points", "cannot be patched on this engine"),
        (dict(points=["attn_out.1"]), "points", "not capturable"),
        (dict(points=["attn_pattern.1"]), "points", "cannot be patched; patchable kinds"),
        (dict(positions=[3]), "positions", "0..2"),
        (dict(positions=[]), "positions", "non-empty"),
        (dict(metric={"logprob": "a b"}), "metric", "encodes to 2 tokens"),
        (dict(metric={"logit_diff": [3, 3]}), "metric", "twice"),
        (dict(heads=[0]), "heads", "attn_z"),
        (dict(max_cells=2), "points", "3 cells"),
    ],
)
def test_a_plan_refuses_naming_the_field(over, param, needle):
    with pytest.raises(sweep.SweepError) as e:
        plan(**over)
    assert e.value.param == param and needle in str(e.value), str(e.value)


def test_a_plain_cell_patches_its_one_clean_row():
    p = plan(positions=[1])
    rows = {"resid_pre.1": np.arange(12, dtype=np.float32).reshape(3, 4)}
    (item,) = sweep.cell_steering(p, p.cells()[0], rows)
    assert item["point"] == "resid_pre.1" and item["positions"] == {"start": 1, "end": 2}
    assert item["rows"].tolist() == [[4, 5, 6, 7]]


def test_a_head_cell_patches_its_one_head_of_the_clean_row():
    p = plan(points=["resid_pre.0", "attn_z.2"], heads=[1], positions=[0, 2])
    assert p.rows == [("resid_pre.0", None), ("attn_z.2", 1)]
    z = np.arange(3 * HEADS * HEAD_DIM, dtype=np.float32).reshape(3, HEADS, HEAD_DIM)
    cell = p.cells()[3]  # attn_z.2, head 1, position 2
    (item,) = sweep.cell_steering(p, cell, {"attn_z.2": z})
    assert item["heads"] == [1] and item["positions"] == {"start": 2, "end": 3}
    assert item["rows"].shape == (1, 1, HEAD_DIM) and item["rows"].ravel().tolist() == [15, 16, 17]
    result = sweep.assemble(p, [1.0, 2.0, 3.0, 4.0], clean=5.0, corrupted=1.0)
    assert result.grid.tolist() == [[1.0, 2.0]] and result.head_grid.tolist() == [[[3.0, 4.0]]]
    answer = result.as_json()
    assert answer["head_points"] == ["attn_z.2"] and answer["heads"] == [1]
    assert result.recovery.tolist() == [[0.0, 0.25]]
