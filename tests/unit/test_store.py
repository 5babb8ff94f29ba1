# SPDX-License-Identifier: Apache-2.0
"""The shard writer (rows, manifest, resume, bounded buffer), the activation
store (schema, partitions, retention, failures never raised, DuckDB queries)
and the dataset reader. No engine: arrays are made here."""

import datetime as dt
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
duckdb = pytest.importorskip("duckdb")

from vllm_hidden_states.store import activation_store as store  # noqa: E402
from vllm_hidden_states.store.parquet_shards import (  # noqa: E402
    DocStates,
    HarvestMeta,
    ShardWriter,
    WriterError,
    read_manifest,
)

HIDDEN = 16
LAYERS = (-2, 0)


def meta(**kw) -> HarvestMeta:
    return HarvestMeta(
        **{"model": "m", "layers": LAYERS, "positions": "prompt", "hidden_size": HIDDEN, **kw}
    )


def make_doc(i: int, n: int | None = None) -> DocStates:
    rng = np.random.default_rng(i)
    n = n or 3 + i % 5
    return DocStates(
        f"doc-{i}",
        rng.integers(0, 500, n).astype(np.int32),
        rng.standard_normal((len(LAYERS), n, HIDDEN)).astype(np.float32),
    )


def read_rows(out: Path) -> dict[tuple[str, int, int], tuple[int, np.ndarray]]:
    """(doc_id, layer, position) -> (token_id, vector), asserting no duplicates."""
    rows = {}
    for f in sorted(out.glob("shard-*.parquet")):
        t = pq.read_table(f).to_pydict()
        for d, p, tok, lay, v in zip(
            t["doc_id"], t["position"], t["token_id"], t["layer"], t["vector"]
        ):
            key = (d, lay, p)
            assert key not in rows, f"duplicate row {key}"
            rows[key] = (tok, np.asarray(v, dtype=np.float32))
    return rows


def assert_docs_stored(out: Path, docs: list[DocStates]):
    rows = read_rows(out)
    assert len(rows) == sum(len(LAYERS) * d.num_tokens for d in docs)
    for d in docs:
        for li, layer in enumerate(LAYERS):
            for p in range(d.num_tokens):
                tok, vec = rows[(d.doc_id, layer, p)]
                assert tok == d.token_ids[p]
                np.testing.assert_array_equal(vec, d.vectors[li, p])


# -- shard writer ------------------------------------------------------------------


def test_rows_shards_and_manifest(tmp_path):
    docs = [make_doc(i) for i in range(10)]
    with ShardWriter(tmp_path, meta(), rows_per_shard=20) as w:
        for d in docs:
            w.submit(d)
    assert_docs_stored(tmp_path, docs)
    m = read_manifest(tmp_path)
    assert m["finished_docs"] == 10
    assert [s["file"] for s in m["shards"]] == sorted(p.name for p in tmp_path.glob("shard-*"))
    assert sorted(d for s in m["shards"] for d in s["docs"]) == sorted(d.doc_id for d in docs)
    # a document never spans shards; shards close at >= 20 rows
    assert all(s["rows"] >= 20 for s in m["shards"][:-1])
    assert sum(s["rows"] for s in m["shards"]) == w.stats.rows_written
    schema = pq.read_schema(tmp_path / "shard-00000.parquet")
    assert schema.field("vector").type == pa.list_(pa.float32(), HIDDEN)
    assert schema.field("layer").type == pa.int16()
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_skips_finished_and_drops_unrecorded_shards(tmp_path):
    docs = [make_doc(i) for i in range(8)]
    with ShardWriter(tmp_path, meta(), rows_per_shard=1) as w:
        for d in docs[:4]:
            w.submit(d)
    # A kill after a rename but before the manifest, and a half-written temp:
    (tmp_path / "shard-00007.parquet").write_bytes(b"not recorded")
    (tmp_path / "shard-00008.parquet.tmp").write_bytes(b"partial")
    w = ShardWriter(tmp_path, meta(), rows_per_shard=1)
    assert w.finished_doc_ids() == {d.doc_id for d in docs[:4]}
    assert not (tmp_path / "shard-00007.parquet").exists()
    assert not (tmp_path / "shard-00008.parquet.tmp").exists()
    for d in docs[4:]:
        w.submit(d)
    w.close()
    assert_docs_stored(tmp_path, docs)
    # new shards are numbered after every name seen, never reusing one
    names = [s["file"] for s in read_manifest(tmp_path)["shards"]]
    assert names[4] == "shard-00008.parquet" and len(set(names)) == 8


def test_other_settings_in_same_directory_are_refused(tmp_path):
    with ShardWriter(tmp_path, meta()) as w:
        w.submit(make_doc(0))
    with pytest.raises(ValueError, match=r"layers: directory has \[-2, 0\], this run \[-1\]"):
        ShardWriter(tmp_path, meta(layers=(-1,)))


def test_submit_rejects_wrong_shapes(tmp_path):
    with ShardWriter(tmp_path, meta()) as w:
        bad = make_doc(0)
        with pytest.raises(ValueError, match=r"expected \[2 layers and points, tokens, 16\]"):
            w.submit(DocStates("x", bad.token_ids, bad.vectors[:1]))
        with pytest.raises(ValueError, match="token ids for"):
            w.submit(DocStates("x", bad.token_ids[:-1], bad.vectors))


def test_producer_blocks_only_when_buffer_is_full(tmp_path):
    """A budget of about two documents: submit returns while there is room,
    blocks past it until the writer frees space, and every document lands."""
    doc_bytes = make_doc(0, n=8).nbytes
    w = ShardWriter(tmp_path, meta(), rows_per_shard=10**9, max_pending_bytes=2 * doc_bytes)
    gate = threading.Event()
    real_flush = w._flush

    def gated_flush():
        gate.wait()
        real_flush()

    w._flush = gated_flush  # hold the writer so the buffer fills
    w.submit(make_doc(0, n=8))
    w.submit(make_doc(1, n=8))
    assert w.pending_bytes == 2 * doc_bytes
    third = threading.Thread(target=w.submit, args=(make_doc(2, n=8),))
    third.start()
    # the third waits: the writer asked for a partial-shard flush, held by gate
    deadline = 300
    while not w._producer_waiting and deadline > 0:
        third.join(0.05)
        deadline -= 0.05
    assert third.is_alive() and w.pending_bytes == 2 * doc_bytes
    gate.set()
    third.join(300)
    assert not third.is_alive()
    w.close()
    assert w.stats.producer_wait_s > 0
    assert_docs_stored(tmp_path, [make_doc(i, n=8) for i in range(3)])


def test_writer_failure_surfaces_to_producer(tmp_path):
    w = ShardWriter(tmp_path, meta(), rows_per_shard=1)

    def boom():
        raise OSError(28, "No space left on device")

    w._flush = boom
    w.submit(make_doc(0))
    w._thread.join(300)
    with pytest.raises(WriterError, match="No space left"):
        w.submit(make_doc(1))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_storage_dtypes(tmp_path, dtype):
    d = make_doc(0)
    with ShardWriter(tmp_path, meta(dtype=dtype)) as w:
        w.submit(d)
    t = pq.read_table(tmp_path / "shard-00000.parquet")
    field = t.schema.field("vector")
    assert field.metadata == {b"dtype": dtype.encode()}
    flat = t.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    if dtype == "float16":
        assert field.type.value_type == pa.float16()
        got = flat.astype(np.float32)
        np.testing.assert_allclose(got, d.vectors.reshape(-1), rtol=1e-3, atol=1e-3)
    else:
        assert field.type.value_type == pa.uint16()
        got = (flat.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_allclose(got, d.vectors.reshape(-1), rtol=8e-3, atol=1e-6)


def test_safetensors_shards(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    docs = [make_doc(i) for i in range(3)]
    with ShardWriter(tmp_path, meta(fmt="safetensors", dtype="bfloat16")) as w:
        for d in docs:
            w.submit(d)
    with safe_open(str(tmp_path / "shard-00000.safetensors"), "pt") as f:
        ids = json.loads(f.metadata()["doc_ids"])
        vec, idx, pos, lay = (
            f.get_tensor(k) for k in ("vectors", "doc_index", "position", "layer")
        )
    assert vec.dtype == torch.bfloat16 and ids == [d.doc_id for d in docs]
    for r in range(vec.shape[0]):
        d = docs[int(idx[r])]
        ref = torch.from_numpy(d.vectors[LAYERS.index(int(lay[r])), int(pos[r])])
        assert torch.equal(vec[r], ref.to(torch.bfloat16))


def test_duckdb_reads_shards(tmp_path):
    docs = [make_doc(i) for i in range(6)]
    with ShardWriter(tmp_path, meta(), rows_per_shard=10) as w:
        for d in docs:
            w.submit(d)
    glob = str(tmp_path / "shard-*.parquet")
    counts = duckdb.sql(
        f"SELECT doc_id, count(*) FROM '{glob}' WHERE layer = -2 GROUP BY doc_id ORDER BY doc_id"
    ).fetchall()
    assert counts == sorted((d.doc_id, d.num_tokens) for d in docs)
    d = docs[3]
    ((vec,),) = duckdb.sql(
        f"SELECT vector FROM '{glob}' WHERE doc_id = 'doc-3' AND layer = 0 AND position = 2"
    ).fetchall()
    np.testing.assert_array_equal(np.asarray(vec, np.float32), d.vectors[1, 2])
    ((norm,),) = duckdb.sql(
        f"SELECT sqrt(list_dot_product(vector, vector)) FROM '{glob}' "
        "WHERE doc_id = 'doc-3' AND layer = 0 AND position = 2"
    ).fetchall()
    assert norm == pytest.approx(float(np.linalg.norm(d.vectors[1, 2])), rel=1e-5)


# -- dataset reader -------------------------------------------------------------------


def test_read_dataset_formats(tmp_path):
    from vllm_hidden_states.tools.collect import read_dataset

    jl = tmp_path / "d.jsonl"
    jl.write_text('{"id": "7", "text": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    docs = list(read_dataset(jl))
    assert [(d.doc_id, d.text) for d in docs] == [("7", "a"), ("2", None)]
    assert docs[1].messages[0]["content"] == "b"
    txt = tmp_path / "d.txt"
    txt.write_text("first\n\nthird\n")
    assert [(d.doc_id, d.text) for d in read_dataset(txt)] == [("0", "first"), ("2", "third")]
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["x", "y"], "text": ["one", "two"]}), pqf)
    assert [(d.doc_id, d.text) for d in read_dataset(pqf)] == [("x", "one"), ("y", "two")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1"}\n')
    with pytest.raises(ValueError, match="exactly one of 'text'"):
        list(read_dataset(bad))


# -- activation store -------------------------------------------------------------------


class Clock:
    def __init__(self, when: dt.datetime):
        self.when = when

    def __call__(self):
        return self.when


def sae_request(
    s: store.ActivationStore, request_id: str, ids, values, prompt_len=2, tokens=None, layer=3
):
    ids = np.asarray(ids)
    return s.append_sae_features(
        request_id,
        model_id="tiny",
        sae=store.SaeSource("rel", layer),
        token_ids=tokens if tokens is not None else list(range(100, 100 + len(ids))),
        feature_ids=ids,
        values=np.asarray(values, dtype=np.float32),
        prompt_len=prompt_len,
    )


def test_sae_rows_land_with_schema_and_partition(tmp_path):
    clock = Clock(dt.datetime(2030, 5, 17, 12, 0, tzinfo=dt.timezone.utc))
    s = store.ActivationStore(tmp_path, clock=clock)
    assert sae_request(
        s,
        "r1",
        [[4, 9, -1], [9, 4, 1], [1, -1, -1]],
        [[2.0, 1.0, 0.0], [3.0, 0.5, 0.25], [1.5, 0, 0]],
    )
    assert s.flush(300)
    files = list((tmp_path / "sae_features" / "date=2030-05-17").glob("*.parquet"))
    assert len(files) == 1
    t = pq.read_table(files[0])
    assert t.schema.names == [
        "request_id",
        "choice_index",
        "step",
        "token_position",
        "token_id",
        "created_at",
        "sae_release",
        "sae_layer",
        "sae_point",
        "feature_id",
        "activation_value",
        "rank",
        "source_mode",
        "model_id",
        "schema_version",
    ]
    assert t.schema.equals(store.sae_schema(), check_metadata=False)
    rows = t.to_pylist()
    assert len(rows) == 6  # -1 slots are not written
    assert [
        (r["token_position"], r["step"], r["rank"], r["feature_id"], r["activation_value"])
        for r in rows
    ] == [
        (0, 0, 0, 4, 2.0),
        (0, 0, 1, 9, 1.0),
        (1, 0, 0, 9, 3.0),
        (1, 0, 1, 4, 0.5),
        (1, 0, 2, 1, 0.25),
        (2, 1, 0, 1, 1.5),
    ]
    r = rows[0]
    assert (
        r["request_id"],
        r["token_id"],
        r["sae_release"],
        r["sae_layer"],
        r["sae_point"],
        r["source_mode"],
        r["model_id"],
        r["schema_version"],
    ) == ("r1", 100, "rel", 3, None, "inline", "tiny", store.SCHEMA_VERSION)
    assert r["created_at"] == dt.datetime(2030, 5, 17, 12, 0)
    assert s.stats.rows_written == 6 and s.stats.requests_dropped == 0
    s.close()


def test_hidden_states_opt_in_table(tmp_path):
    s = store.ActivationStore(tmp_path)
    states = {-1: np.arange(12, dtype=np.float32).reshape(3, 4), 2: np.ones((3, 4))}
    assert s.append_hidden_states(
        "r1", model_id="tiny", token_ids=[5, 6, 7], states=states, prompt_len=3
    )
    assert s.flush(300)
    rows = (
        store.connect(tmp_path)
        .execute(
            "SELECT layer, token_position, step, token_id, vector FROM hidden_states "
            "ORDER BY layer, token_position"
        )
        .fetchall()
    )
    assert rows[0] == (-1, 0, 0, 5, [0.0, 1.0, 2.0, 3.0])
    assert rows[2] == (-1, 2, 0, 7, [8.0, 9.0, 10.0, 11.0])
    assert [r[0] for r in rows] == [-1] * 3 + [2] * 3
    s.close()


def test_retention_deletes_old_partitions(tmp_path):
    for day in ("2030-01-01", "2030-01-15", "2030-01-16", "2030-01-29"):
        for table in ("sae_features", "hidden_states"):
            p = tmp_path / table / f"date={day}"
            p.mkdir(parents=True)
            (p / "part-0.parquet").write_bytes(b"")
    (tmp_path / "sae_features" / "date=garbage").mkdir()
    deleted = store.prune(tmp_path, 14, today=dt.date(2030, 1, 29))
    assert sorted(p.name for p in deleted) == ["date=2030-01-01"] * 2
    left = sorted(p.name for p in (tmp_path / "sae_features").iterdir())
    assert left == ["date=2030-01-15", "date=2030-01-16", "date=2030-01-29", "date=garbage"]
    # the store prunes at start with its clock and the env's retention
    clock = Clock(dt.datetime(2030, 1, 31, tzinfo=dt.timezone.utc))
    os.environ[store.RETENTION_ENV] = "2"
    try:
        s = store.ActivationStore(tmp_path, clock=clock)
    finally:
        del os.environ[store.RETENTION_ENV]
    assert s.retention_days == 2 and s.stats.partitions_pruned == 4
    assert sorted(p.name for p in (tmp_path / "hidden_states").iterdir()) == ["date=2030-01-29"]
    s.close()


def test_unwritable_root_warns_and_never_raises(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=store.__name__):
        s = store.ActivationStore(blocker / "store")
    assert not s.available
    assert "is not writable" in caplog.text and "requests are served" in caplog.text
    assert sae_request(s, "r1", [[1]], [[1.0]]) is False
    assert s.stats.requests_dropped == 1
    s.close()


def test_write_failure_is_logged_and_counted(tmp_path, caplog):
    s = store.ActivationStore(tmp_path)
    (tmp_path / "sae_features").write_text("a file where the table directory goes")
    with caplog.at_level(logging.WARNING, logger=store.__name__):
        assert sae_request(s, "r1", [[1, 2]], [[1.0, 0.5]])
        assert s.flush(300)
    assert s.stats.write_errors == 1 and s.stats.rows_dropped == 2
    assert "rows dropped, serving continues" in caplog.text
    s.close()


def test_full_queue_drops_and_counts(tmp_path):
    s = store.ActivationStore(tmp_path, max_queued=1)
    hold = threading.Event()
    real = s._write

    def held(*a):
        hold.wait()
        real(*a)

    s._write = held
    s.flush_rows = 1  # every item triggers a (held) write
    results = [sae_request(s, f"r{i}", [[1]], [[1.0]]) for i in range(50)]
    assert results[0] and not all(results)
    assert s.stats.requests_dropped == results.count(False) > 0
    hold.set()
    assert s.flush(300)
    assert s.stats.rows_written == results.count(True)
    s.close()


def test_read_only_directory_warns_and_serves(tmp_path):
    """A read-only store directory: chmod 555 as an unprivileged user; as root
    (which ignores modes) a read-only bind mount of it in a private mount
    namespace (``unshare -rm``). The store warns, the append is dropped and
    counted, nothing raises."""
    root = tmp_path / "store"
    root.mkdir()
    code = (
        "import logging, sys, numpy as np\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from vllm_hidden_states.store.activation_store import ActivationStore\n"
        f"s = ActivationStore({str(root)!r})\n"
        "from vllm_hidden_states.store.activation_store import SaeSource\n"
        "ok = s.append_sae_features('r', model_id='m', sae=SaeSource('x', 1),"
        " token_ids=[1], feature_ids=np.array([[3]]), values=np.array([[1.0]]),"
        " prompt_len=1)\n"
        "s.close()\n"
        "print('served', ok, s.stats.requests_dropped)\n"
    )
    argv = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        import shutil

        if (
            shutil.which("unshare") is None
            or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0
        ):
            pytest.skip("running as root without unshare: cannot make a read-only directory")
        mount = f'mount --bind {root} {root} && mount -o remount,bind,ro {root} && exec "$@"'
        argv = ["unshare", "-rm", "sh", "-c", mount, "sh", *argv]
        expected_error = "Read-only file system"
    else:
        os.chmod(root, 0o555)
        expected_error = "Permission denied"
    try:
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
    finally:
        os.chmod(root, 0o755)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "served False 1"
    assert "is not writable" in out.stderr and expected_error in out.stderr
    assert not any(root.iterdir())


def test_feature_deltas_and_threshold_search_match_python(tmp_path):
    rng = np.random.default_rng(0)
    s = store.ActivationStore(tmp_path)
    reqs = {}
    for r in range(4):
        n, k = 6, 3
        ids = np.stack([rng.choice(8, k, replace=False) for _ in range(n)])
        vals = np.sort(rng.uniform(0.1, 5.0, (n, k)), axis=1)[:, ::-1].astype(np.float32)
        reqs[f"req-{r}"] = (ids, vals)
        assert sae_request(s, f"req-{r}", ids, vals, prompt_len=4)
    assert s.flush(300)

    ids, vals = reqs["req-1"]
    dense = np.zeros((6, 8), np.float32)
    for p in range(6):
        dense[p, ids[p]] = vals[p]
    present = sorted(set(ids.ravel().tolist()))
    rows = store.feature_deltas(tmp_path, "req-1").fetchall()
    assert len(rows) == 6 * len(present)
    for feature_id, position, step, token_id, value, delta in rows:
        assert value == pytest.approx(dense[position, feature_id])
        prev = dense[position - 1, feature_id] if position else 0.0
        assert delta == pytest.approx(dense[position, feature_id] - prev, abs=1e-6)
        assert step == max(position - 4 + 1, 0) and token_id == 100 + position
    only = store.feature_deltas(tmp_path, "req-1", features=[present[0]]).fetchall()
    assert {r[0] for r in only} == {present[0]} and len(only) == 6

    feature, threshold = 3, 2.0
    expected = {}
    for rid, (ids, vals) in reqs.items():
        hits = vals[ids == feature]
        hits = hits[hits >= threshold]
        if len(hits):
            expected[rid] = (len(hits), float(hits.max()))
    got = store.threshold_search(tmp_path, feature, threshold).fetchall()
    assert {r[0]: r[5] for r in got} == {k: v[0] for k, v in expected.items()}
    assert {r[0]: r[6] for r in got} == pytest.approx({k: v[1] for k, v in expected.items()})
    assert [r[6] for r in got] == sorted((r[6] for r in got), reverse=True)
    s.close()


def test_store_cli_query_and_prune(tmp_path, capsys):
    from vllm_hidden_states.tools.cli import main

    s = store.ActivationStore(tmp_path)
    sae_request(s, "r1", [[5, 6], [6, 5]], [[3.0, 1.0], [4.0, 2.0]])
    s.close()
    assert (
        main(
            [
                "store",
                "query",
                str(tmp_path),
                "threshold",
                "--feature",
                "6",
                "--min",
                "3.5",
                "--format",
                "json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [(r["request_id"], r["positions"], r["max_activation"]) for r in out] == [("r1", 1, 4.0)]
    assert (
        main(
            [
                "store",
                "query",
                str(tmp_path),
                "deltas",
                "--request-id",
                "r1",
                "--feature",
                "5",
                "--format",
                "csv",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "feature_id,token_position,step,token_id,activation_value,delta"
    assert lines[1:] == ["5,0,0,100,3.0,3.0", "5,1,0,101,2.0,-1.0"]
    assert (
        main(["store", "query", str(tmp_path), "sql", "SELECT count(*) AS n FROM sae_features"])
        == 0
    )
    table = capsys.readouterr().out
    assert " n " in table and " 4 " in table
    old = tmp_path / "sae_features" / "date=2000-01-01"
    old.mkdir()
    assert main(["store", "prune", str(tmp_path), "--days", "14"]) == 0
    assert not old.exists() and "deleted" in capsys.readouterr().out


def test_an_sae_at_a_capture_point_and_point_states_name_the_point(tmp_path):
    s = store.ActivationStore(tmp_path, flush_rows=1)
    s.append_sae_features(
        "cmpl-p",
        model_id="tiny",
        sae=store.SaeSource("attn-sae", 2, "attn_out.2"),
        token_ids=[7],
        feature_ids=np.array([[5]]),
        values=np.array([[1.0]]),
        prompt_len=1,
    )
    s.append_hidden_states(
        "cmpl-p",
        model_id="tiny",
        token_ids=[7],
        prompt_len=1,
        states={-1: np.ones((1, 4)), "mlp_out.3": np.zeros((1, 4))},
    )
    s.close()
    con = store.connect(tmp_path)
    assert con.execute("SELECT sae_layer, sae_point FROM sae_features").fetchall() == [
        (2, "attn_out.2")
    ]
    assert con.execute(
        "SELECT layer, point FROM hidden_states ORDER BY point NULLS FIRST"
    ).fetchall() == [
        (-1, None),
        (3, "mlp_out.3"),
    ]


def test_probe_action_firings_land_one_row_each_and_are_queried_by_duckdb(tmp_path):
    from vllm_hidden_states.contract import ProbeFiring

    clock = Clock(dt.datetime(2030, 5, 17, 12, 0, tzinfo=dt.timezone.utc))
    s = store.ActivationStore(tmp_path, clock=clock)
    firings = [
        ProbeFiring(label="topic", position=7, score=0.5, then="flag", monitor=True),
        ProbeFiring(label="harm", position=9, score=1.25, then="stop"),
    ]
    assert s.append_firings("r1", model_id="tiny", firings=firings)
    assert s.flush(300)
    assert list((tmp_path / "probe_firings").glob("date=2030-05-17/*.parquet"))
    rows = (
        store.connect(tmp_path)
        .execute(
            "SELECT request_id, action, outcome, monitor, token_position, score, model_id "
            "FROM probe_firings ORDER BY token_position"
        )
        .fetchall()
    )
    assert rows == [
        ("r1", "topic", "flag", True, 7, 0.5, "tiny"),
        ("r1", "harm", "stop", False, 9, 1.25, "tiny"),
    ]
    s.close()
