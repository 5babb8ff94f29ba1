# SPDX-License-Identifier: Apache-2.0
"""``vllm-hidden-states collect`` on real engines, checked against HF.

* offline, on the session's in-process engine (``llm``, every layer
  capturable): prompt positions of text and chat documents, and positions
  "all"; every stored vector vs HF ``output_hidden_states`` on the stored
  token ids (max|diff| / max|ref| < 1e-3), DuckDB queries over the shards;
* kill and resume: the CLI in a child process (its own engine) reads a FIFO
  that holds only the first documents, so it is still running when the test
  sees the manifest record a finished document and SIGKILLs it; a rerun of the
  whole dataset then skips what the manifest holds, and every document is
  stored exactly once;
* against a real ``vllm serve`` process (POST /v1/hidden_states);
* long and refused documents: a 3 MB document is cut to ``--max-length``
  tokens on the client (server mode; the offline engine counts its cuts too),
  and a document the server refuses (413: no local tokenizer to cut it with)
  is skipped and recorded while the rest of the run goes on;
* one output directory, two runs: the CLI in a child process holds the
  directory (it reads a FIFO that stays open); a second CLI run into the same
  directory is refused at once, and the first then finishes undisturbed.
"""

import json
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pyarrow")
duckdb = pytest.importorskip("duckdb")

from vllm_hidden_states.store.parquet_shards import read_manifest  # noqa: E402
from vllm_hidden_states.tools.collect import CollectConfig, collect  # noqa: E402

from .conftest import assert_close  # noqa: E402
from .server_utils import test_server_process, wait_until  # noqa: E402

TEXTS = [
    "Once upon a time there was a small robot who loved to count",
    "A beautiful sunset over the ocean",
    "The engine schedules requests, runs the model and samples tokens.",
    "Hidden states are the residual stream between decoder layers.",
    "Short.",
    "Parquet shards are read by DuckDB without loading them first.",
]
MESSAGES = [{"role": "user", "content": "Describe a red bicycle leaning on a wall."}]


def shard_rows(out: Path) -> dict[tuple[str, int], tuple[list[int], np.ndarray]]:
    """(doc_id, layer) -> (token ids, vectors [n, hidden]) from the Parquet
    shards through DuckDB, asserting positions 0..n-1 each exactly once."""
    glob = str(out / "shard-*.parquet")
    rows = duckdb.sql(
        f"SELECT doc_id, layer, list(position ORDER BY position), "
        f"list(token_id ORDER BY position), list(vector ORDER BY position) "
        f"FROM '{glob}' GROUP BY doc_id, layer"
    ).fetchall()
    out_rows = {}
    for doc_id, layer, positions, token_ids, vectors in rows:
        assert positions == list(range(len(positions))), (doc_id, layer, positions)
        out_rows[(doc_id, layer)] = (token_ids, np.asarray(vectors, dtype=np.float32))
    return out_rows


def assert_matches_hf(rows, hf, layers, doc_ids):
    assert {d for d, _ in rows} == set(doc_ids)
    for doc_id in doc_ids:
        ids = rows[(doc_id, layers[0])][0]
        ref = hf.states(ids)
        for layer in layers:
            token_ids, vectors = rows[(doc_id, layer)]
            assert token_ids == ids
            assert_close(torch.from_numpy(vectors), ref[layer], f"doc {doc_id} layer {layer}")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompt_positions_of_text_and_chat_documents_match_hf(llm, hf_qwen3, qwen3_dir, tmp_path):
    records = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)]
    records.insert(2, {"id": "chat", "messages": MESSAGES})
    dataset = write_jsonl(tmp_path / "d.jsonl", records)
    layers = [-2, 0, 2]
    cfg = CollectConfig(
        dataset=str(dataset),
        out=str(tmp_path / "out"),
        model=str(qwen3_dir),
        layers=layers,
        batch_size=3,
        rows_per_shard=40,
        progress=False,
    )
    result = collect(cfg, llm=llm)
    assert result.docs == len(records) and result.skipped == 0

    out = tmp_path / "out"
    rows = shard_rows(out)
    assert_matches_hf(rows, hf_qwen3, layers, [r["id"] for r in records])
    tokenizer = llm.get_tokenizer()
    for i, text in enumerate(TEXTS):
        assert rows[(f"t{i}", -2)][0] == tokenizer.encode(text)
    chat_text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rows[("chat", 0)][0] == tokenizer.encode(chat_text, add_special_tokens=False)

    manifest = read_manifest(out)
    assert len(manifest["shards"]) > 1  # rows_per_shard=40 split the run
    assert manifest["finished_docs"] == len(records)
    total = sum(len(rows[(r["id"], -2)][0]) for r in records)
    assert result.tokens == total
    # DuckDB over the shards: the README's queries
    glob = str(out / "shard-*.parquet")
    per_layer = duckdb.sql(
        f"SELECT layer, count(*) FROM '{glob}' GROUP BY layer ORDER BY layer"
    ).fetchall()
    assert per_layer == [(-2, total), (0, total), (2, total)]
    ((doc_id, position),) = duckdb.sql(
        f"SELECT doc_id, position FROM '{glob}' WHERE layer = -2 "
        "ORDER BY sqrt(list_dot_product(vector, vector)) DESC LIMIT 1"
    ).fetchall()
    norms = {
        (d, p): float(np.linalg.norm(v))
        for (d, layer), (_, vs) in rows.items()
        if layer == -2
        for p, v in enumerate(vs)
    }
    assert (doc_id, position) == max(norms, key=norms.get)


def test_points_are_stored_after_the_layers_with_their_address(hf_qwen3, qwen3_dir, tmp_path):
    """``--points`` on an offline engine of its own (the points capturable):
    each point's rows carry its address in ``point`` and its decoder layer in
    ``layer``, and equal HF's forward-hook values."""
    dataset = write_jsonl(
        tmp_path / "d.jsonl", [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS[:3])]
    )
    points = ["attn_out.1", "blocks.2.hook_mlp_out"]
    cfg = CollectConfig(
        dataset=str(dataset),
        out=str(tmp_path / "out"),
        model=str(qwen3_dir),
        layers=[-2],
        points=points,
        progress=False,
        engine_kwargs=dict(dtype="float32", max_model_len=512, enforce_eager=True),
    )
    assert collect(cfg).docs == 3
    glob = str(tmp_path / "out" / "shard-*.parquet")
    stored = duckdb.sql(
        f"SELECT doc_id, point, any_value(layer), list(token_id ORDER BY position), "
        f"list(vector ORDER BY position) FROM '{glob}' WHERE point IS NOT NULL "
        "GROUP BY doc_id, point"
    ).fetchall()
    assert len(stored) == 3 * len(points)
    for doc_id, point, layer, token_ids, vectors in stored:
        assert layer == {"attn_out.1": 1, "blocks.2.hook_mlp_out": 2}[point]
        reference = hf_qwen3.points(token_ids)["attn_out.1" if layer == 1 else "mlp_out.2"]
        assert_close(torch.tensor(np.asarray(vectors)), reference, f"{doc_id} {point}")
    ((layer_rows,),) = duckdb.sql(f"SELECT count(*) FROM '{glob}' WHERE point IS NULL").fetchall()
    assert layer_rows == sum(len(t) for *_, t, _ in stored) // len(points)


def test_all_positions_cover_prompt_and_generated_tokens(llm, hf_qwen3, qwen3_dir, tmp_path):
    dataset = tmp_path / "d.txt"
    dataset.write_text("\n".join(TEXTS[:3]) + "\n")
    cfg = CollectConfig(
        dataset=str(dataset),
        out=str(tmp_path / "out"),
        model=str(qwen3_dir),
        layers=[-1, 1],
        positions="all",
        max_tokens=5,
        progress=False,
    )
    result = collect(cfg, llm=llm)
    rows = shard_rows(tmp_path / "out")
    assert_matches_hf(rows, hf_qwen3, [-1, 1], ["0", "1", "2"])
    tokenizer = llm.get_tokenizer()
    for i, text in enumerate(TEXTS[:3]):
        ids = rows[(str(i), 1)][0]
        prompt = tokenizer.encode(text)
        assert ids[: len(prompt)] == prompt and len(ids) > len(prompt)
    assert result.tokens == sum(len(rows[(str(i), 1)][0]) for i in range(3))


def test_killed_run_resumes_without_losing_or_duplicating_documents(
    llm, hf_qwen3, qwen3_dir, tmp_path
):
    n_docs, first = 14, 6
    lines = [f"Document number {i}: " + TEXTS[i % len(TEXTS)] for i in range(n_docs)]
    fifo = tmp_path / "feed.txt"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    layers = [-2, 1]
    argv = [
        sys.executable,
        "-m",
        "vllm_hidden_states.tools.cli",
        "collect",
        str(fifo),
        str(out),
        "--model",
        str(qwen3_dir),
        "--layers=-2,1",
        "--batch-size",
        "2",
        "--rows-per-shard",
        "1",
        "--no-progress",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--engine-dtype",
        "float32",
        "--engine-arg",
        "gpu_memory_utilization=0.2",
    ]
    log = open(tmp_path / "child.log", "wb")
    child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    feed = {}

    def feed_first_lines():
        # Blocks until the child opens the dataset; stays open, so the child
        # waits for more lines after these instead of finishing.
        feed["f"] = open(fifo, "w")
        feed["f"].write("".join(line + "\n" for line in lines[:first]))
        feed["f"].flush()

    feeder = threading.Thread(target=feed_first_lines, daemon=True)
    feeder.start()
    try:

        def finished():
            if child.poll() is not None:
                raise AssertionError(
                    "collect exited before it was killed:\n"
                    + (tmp_path / "child.log").read_text()[-3000:]
                )
            m = read_manifest(out) if (out / "manifest.json").exists() else None
            return m is not None and m["finished_docs"] >= 1

        wait_until(finished, "the manifest to record a finished document", timeout=600)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        log.close()
        feeder.join(60)
        if "f" in feed:
            try:
                feed["f"].close()
            except BrokenPipeError:
                pass
    assert child.returncode == -signal.SIGKILL
    done_before = set(d for s in read_manifest(out)["shards"] for d in s["docs"])
    assert done_before and done_before <= {str(i) for i in range(first)}

    full = tmp_path / "full.txt"
    full.write_text("".join(line + "\n" for line in lines))
    cfg = CollectConfig(
        dataset=str(full),
        out=str(out),
        model=str(qwen3_dir),
        layers=layers,
        batch_size=4,
        rows_per_shard=1,
        progress=False,
    )
    result = collect(cfg, llm=llm)
    assert result.skipped == len(done_before)
    assert result.docs == n_docs - len(done_before)

    manifest = read_manifest(out)
    recorded = [d for s in manifest["shards"] for d in s["docs"]]
    assert sorted(recorded) == sorted(str(i) for i in range(n_docs))  # none lost, none twice
    assert sorted(p.name for p in out.glob("shard-*")) == sorted(
        s["file"] for s in manifest["shards"]
    )
    rows = shard_rows(out)  # asserts each position once per (doc, layer)
    assert_matches_hf(rows, hf_qwen3, layers, [str(i) for i in range(n_docs)])


@pytest.fixture(scope="module")
def collect_server(qwen3_dir, tmp_path_factory):
    server = test_server_process(
        qwen3_dir,
        ["--enable-hidden-states", "--max-model-len", "512"],
        tmp_path_factory.mktemp("collect-server") / "server.log",
        name="tiny-qwen3",
    ).start()
    try:
        yield server.wait_ready(timeout=600)
    finally:
        server.stop()


def test_collect_against_a_server_matches_hf(collect_server, hf_qwen3, tmp_path):
    records = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)]
    records.append({"id": "chat", "messages": MESSAGES})
    dataset = write_jsonl(tmp_path / "d.jsonl", records)
    layers = [-2, 1]
    cfg = CollectConfig(
        dataset=str(dataset),
        out=str(tmp_path / "out"),
        server_url=collect_server.base_url,
        layers=layers,
        batch_size=4,
        concurrency=2,
        rows_per_shard=50,
        progress=False,
    )
    result = collect(cfg)
    assert result.docs == len(records)
    rows = shard_rows(tmp_path / "out")
    assert_matches_hf(rows, hf_qwen3, layers, [r["id"] for r in records])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_qwen3.model.config._name_or_path)
    for i, text in enumerate(TEXTS):
        assert rows[(f"t{i}", 1)][0] == tokenizer.encode(text)
    # a rerun skips everything
    again = collect(cfg)
    assert again.docs == 0 and again.skipped == len(records)


# -- long documents, refused documents, one directory per run --------------------------


def big_document(chars: int = 3_000_000) -> str:
    """About 3 MB of ordinary text (over the server's 2,000,000-character
    default --hidden-states-max-input-chars)."""
    unit = " ".join(TEXTS) + " "
    return (unit * (chars // len(unit) + 1))[:chars]


def cli_argv(dataset: Path, out: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm_hidden_states.tools.cli",
        "collect",
        str(dataset),
        str(out),
        "--no-progress",
        *args,
    ]


def test_server_harvest_cuts_a_3mb_document_to_max_length_tokens_before_sending(
    collect_server, hf_qwen3, qwen3_dir, tmp_path
):
    big = big_document()
    records = [
        {"id": "a", "text": TEXTS[0]},
        {"id": "big", "text": big},
        {"id": "b", "text": TEXTS[1]},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out"
    run = subprocess.run(
        cli_argv(
            dataset,
            out,
            "--server-url",
            collect_server.base_url,
            "--layers=-2,1",
            "--max-length",
            "64",
            "--batch-size",
            "2",
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert (report["docs"], report["truncated"], report["refused"]) == (3, 1, 0), report

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    rows = shard_rows(out)
    assert rows[("big", -2)][0] == tokenizer.encode(big)[:64]
    assert_matches_hf(rows, hf_qwen3, [-2, 1], ["a", "big", "b"])
    assert not (out / "refused.json").exists()


def test_server_harvest_skips_and_records_a_document_the_server_refuses(
    collect_server, hf_qwen3, tmp_path
):
    no_tokenizer = tmp_path / "no-tokenizer"  # no local tokenizer: the text goes as it is
    no_tokenizer.mkdir()
    records = [
        {"id": "a", "text": TEXTS[0]},
        {"id": "big", "text": big_document()},
        {"id": "b", "text": TEXTS[1]},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out"
    cfg = CollectConfig(
        dataset=str(dataset),
        out=str(out),
        server_url=collect_server.base_url,
        tokenizer=str(no_tokenizer),
        layers=[-2],
        max_length=64,
        batch_size=2,
        progress=False,
    )
    result = collect(cfg)
    assert (result.docs, result.refused, result.truncated) == (2, 1, 0)
    recorded = json.loads((out / "refused.json").read_text())
    assert list(recorded) == ["big"]
    assert recorded["big"]["status"] == 413
    assert "characters" in recorded["big"]["error"]  # the server's own reason
    assert read_manifest(out)["finished_docs"] == 2
    assert_matches_hf(shard_rows(out), hf_qwen3, [-2], ["a", "b"])


def test_offline_harvest_counts_documents_cut_to_max_length(llm, hf_qwen3, qwen3_dir, tmp_path):
    long_text = " ".join(TEXTS)
    tokenizer = llm.get_tokenizer()
    assert len(tokenizer.encode(TEXTS[4])) <= 16 < len(tokenizer.encode(long_text))
    dataset = write_jsonl(
        tmp_path / "d.jsonl", [{"id": "short", "text": TEXTS[4]}, {"id": "long", "text": long_text}]
    )
    cfg = CollectConfig(
        dataset=str(dataset),
        out=str(tmp_path / "out"),
        model=str(qwen3_dir),
        layers=[-2],
        max_length=16,
        progress=False,
    )
    result = collect(cfg, llm=llm)
    assert (result.docs, result.truncated, result.refused) == (2, 1, 0)
    rows = shard_rows(tmp_path / "out")
    assert rows[("long", -2)][0] == tokenizer.encode(long_text)[:16]
    assert_matches_hf(rows, hf_qwen3, [-2], ["short", "long"])


def test_second_collect_into_a_directory_in_use_is_refused_and_the_first_finishes(
    collect_server, hf_qwen3, tmp_path
):
    lines = [f"Line {i}: " + TEXTS[i % len(TEXTS)] for i in range(5)]
    fifo = tmp_path / "feed.txt"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    server = ["--server-url", collect_server.base_url, "--layers=-2", "--batch-size", "1"]
    log_path = tmp_path / "first.log"
    log = open(log_path, "wb")
    first = subprocess.Popen(
        cli_argv(fifo, out, *server), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    feed: dict = {}
    opened = threading.Event()

    def open_feed():
        # Returns once the first run opened its dataset, which it does after
        # it took the directory (and while it stays open, the run goes on).
        feed["f"] = open(fifo, "w")
        opened.set()

    feeder = threading.Thread(target=open_feed, daemon=True)
    feeder.start()
    try:
        wait_until(
            lambda: opened.is_set() or first.poll() is not None,
            "the first collect to open its dataset",
            timeout=600,
        )
        assert first.poll() is None, log_path.read_text()[-3000:]

        full = tmp_path / "full.txt"
        full.write_text("".join(line + "\n" for line in lines))
        second = subprocess.run(
            cli_argv(full, out, *server), capture_output=True, text=True, timeout=600
        )
        assert second.returncode == 2, (second.stdout, second.stderr[-3000:])
        assert str(out) in second.stderr
        assert "another `vllm-hidden-states collect`" in second.stderr
        assert first.poll() is None  # undisturbed: still waiting for its dataset

        feed["f"].write("".join(line + "\n" for line in lines))
        feed["f"].close()
        assert first.wait(timeout=600) == 0, log_path.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        log.close()
        if not opened.is_set() and stat.S_ISFIFO(os.stat(fifo).st_mode):
            # unblock the feeder's open() if the first run never opened it
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        feeder.join(60)
        if "f" in feed and not feed["f"].closed:
            try:
                feed["f"].close()
            except BrokenPipeError:
                pass
    manifest = read_manifest(out)
    recorded = sorted(d for s in manifest["shards"] for d in s["docs"])
    assert recorded == [str(i) for i in range(len(lines))]  # each once
    assert_matches_hf(shard_rows(out), hf_qwen3, [-2], [str(i) for i in range(len(lines))])
