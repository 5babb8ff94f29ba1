# SPDX-License-Identifier: Apache-2.0
"""The activation store keys rows by the response's id and the choice's index
(schema version 2), and still reads version-1 files. No engine: arrays are
made here; the server's side is in tests/v1/hidden_states/test_sae.py."""

import datetime as dt
import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("duckdb")

from vllm_hidden_states.store import activation_store as store  # noqa: E402


def two_choices(s: store.ActivationStore, request_id: str = "cmpl-abc"):
    """One request, two choices of 2 positions and k=1, different features."""
    for choice, feature in ((0, 5), (1, 9)):
        assert s.append_sae_features(
            request_id,
            model_id="tiny",
            sae=store.SaeSource("rel", 3),
            token_ids=[100 + choice, 200 + choice],
            feature_ids=np.array([[feature], [feature]]),
            values=np.array([[1.0], [3.0]], np.float32),
            prompt_len=1,
            choice_index=choice,
        )


def test_rows_carry_the_choice_index_in_its_own_column(tmp_path):
    s = store.ActivationStore(tmp_path)
    two_choices(s)
    assert s.append_hidden_states(
        "cmpl-abc",
        model_id="tiny",
        token_ids=[7],
        prompt_len=1,
        states={2: np.ones((1, 4))},
        choice_index=1,
    )
    s.close()
    assert store.SCHEMA_VERSION == 3
    con = store.connect(tmp_path)
    rows = con.execute(
        "SELECT DISTINCT request_id, choice_index, feature_id, schema_version "
        "FROM sae_features ORDER BY 2"
    ).fetchall()
    assert rows == [("cmpl-abc", 0, 5, 3), ("cmpl-abc", 1, 9, 3)]
    assert con.execute("SELECT request_id, choice_index FROM hidden_states").fetchall() == [
        ("cmpl-abc", 1)
    ]


def test_deltas_are_over_one_choice_of_the_request(tmp_path, capsys):
    from vllm_hidden_states.tools.cli import main

    s = store.ActivationStore(tmp_path)
    two_choices(s)
    s.close()
    first = store.feature_deltas(tmp_path, "cmpl-abc").fetchall()
    assert first == [(5, 0, 0, 100, 1.0, 1.0), (5, 1, 1, 200, 3.0, 2.0)]
    second = store.feature_deltas(tmp_path, "cmpl-abc", choice_index=1).fetchall()
    assert second == [(9, 0, 0, 101, 1.0, 1.0), (9, 1, 1, 201, 3.0, 2.0)]
    assert (
        main(
            [
                "store",
                "query",
                str(tmp_path),
                "deltas",
                "--request-id",
                "cmpl-abc",
                "--choice-index",
                "1",
                "--format",
                "json",
            ]
        )
        == 0
    )
    assert {r["feature_id"] for r in json.loads(capsys.readouterr().out)} == {9}
    hits = store.threshold_search(tmp_path, 9, 2.0).fetchall()
    assert [(r[0], r[1], r[5]) for r in hits] == [("cmpl-abc", 1, 1)]


def test_version_1_files_are_read_with_choice_index_0(tmp_path):
    """A partition written before choice_index existed (schema version 1),
    beside a version-2 file: both read, the old rows as choice 0."""
    s = store.ActivationStore(tmp_path)
    two_choices(s, "cmpl-new")
    s.close()
    v1 = pa.schema([f for f in store.sae_schema() if f.name != "choice_index"])
    row = {
        "request_id": "cmpl-old-0",
        "step": 0,
        "token_position": 0,
        "token_id": 1,
        "created_at": dt.datetime(2030, 1, 1),
        "sae_release": "rel",
        "sae_layer": 3,
        "feature_id": 4,
        "activation_value": 2.0,
        "rank": 0,
        "source_mode": "inline",
        "model_id": "tiny",
        "schema_version": 1,
    }
    day = next((tmp_path / "sae_features").iterdir())
    pq.write_table(pa.Table.from_pylist([row], schema=v1), day / "part-0-old.parquet")
    got = (
        store.connect(tmp_path)
        .execute(
            "SELECT request_id, choice_index, schema_version FROM sae_features WHERE feature_id = 4"
        )
        .fetchall()
    )
    assert got == [("cmpl-old-0", 0, 1)]
    assert len(store.feature_deltas(tmp_path, "cmpl-new", choice_index=1).fetchall()) == 2
