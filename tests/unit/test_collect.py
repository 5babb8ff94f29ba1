# SPDX-License-Identifier: Apache-2.0
"""``vllm-hidden-states collect`` without an engine or a server: the dataset's
id rule, the output directory's lock, and the client-side cut of a long
document (on a real byte-level BPE tokenizer, trained here in memory).
The harvests themselves, on real engines and servers, are in
``tests/v1/hidden_states/test_collect.py``."""

import json
import re
import time

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from vllm_hidden_states.tools.collect import (  # noqa: E402
    LOCK_FILE,
    CollectConfig,
    OutputLocked,
    collect,
    lock_output,
    read_dataset,
    tokens,
)

# -- ids ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, shown", [(None, "null"), (7, "7"), (1.5, "1.5"), (["a"], '["a"]'), (True, "true")]
)
def test_jsonl_id_that_is_not_a_string_is_refused_naming_the_line(tmp_path, bad, shown):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n' + json.dumps({"id": bad, "text": "y"}) + "\n")
    with pytest.raises(ValueError) as e:
        list(read_dataset(path))
    msg = str(e.value)
    assert f"{path}:2" in msg  # the line, 1-based as editors count
    assert f"'id' is {shown}" in msg
    assert "must be a string" in msg and "leave 'id' out" in msg
    assert "line number (1)" in msg  # the default that omitting it gives


def test_parquet_null_id_is_refused_naming_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["x", None], "text": ["one", "two"]}), path)
    with pytest.raises(ValueError, match=re.escape(f"{path} row 1: 'id' is null")) as e:
        list(read_dataset(path))
    assert "must be a string" in str(e.value) and "row number (1)" in str(e.value)


def test_record_without_id_gets_its_0_based_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"id": "named", "text": "b"}\n{"text": "c"}\n')
    assert [d.doc_id for d in read_dataset(path)] == ["0", "named", "3"]
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", "two"]}), pqf)
    assert [d.doc_id for d in read_dataset(pqf)] == ["0", "1"]


# -- lock ----------------------------------------------------------------------------


def test_collect_into_a_directory_another_collect_holds_is_refused_at_once(tmp_path):
    out = tmp_path / "out"
    dataset = tmp_path / "d.txt"
    dataset.write_text("hello\n")
    # Nothing listens there: the refusal must come before any connection.
    cfg = CollectConfig(
        dataset=str(dataset), out=str(out), server_url="http://127.0.0.1:9", progress=False
    )
    with lock_output(out):
        t0 = time.monotonic()
        with pytest.raises(OutputLocked) as e:
            collect(cfg)
        assert time.monotonic() - t0 < 60  # generous: it must not wait for the lock
    msg = str(e.value)
    assert str(out) in msg and "another `vllm-hidden-states collect`" in msg
    assert "another output directory" in msg
    assert list(out.iterdir()) == [out / LOCK_FILE]  # nothing else touched


def test_lock_is_released_when_the_run_ends(tmp_path):
    out = tmp_path / "out"
    with lock_output(out):
        pass
    with lock_output(out):  # would raise OutputLocked if still held
        pass


# -- client-side cut of long documents ------------------------------------------------


@pytest.fixture(scope="module", params=["chatml", "llama"])
def tokenizer(request):
    """A real byte-level BPE tokenizer (the tiny models' own, trained in memory);
    ``llama`` adds a BOS token to every encode."""
    from vllm_hidden_states.tools.tiny_models import _tokenizer

    return _tokenizer(request.param, 512)[0]


LONG = (
    "Once upon a time there was a small robot who loved to count: one, two, "
    "three. Hidden states are the activations of a language model. "
) * 400


@pytest.mark.parametrize("max_length", [1, 7, 64, 300])
def test_text_prefix_encodes_to_the_same_first_tokens_as_the_whole_text(tokenizer, max_length):
    full = tokenizer.encode(LONG)
    prefix = tokens.text_prefix(tokenizer, LONG, full, max_length)
    assert prefix is not None and LONG.startswith(prefix)
    assert len(prefix) < len(LONG) // 10  # what is sent is about max_length tokens
    assert tokenizer.encode(prefix)[:max_length] == full[:max_length]


def test_messages_prefix_renders_to_the_same_first_tokens_as_the_whole_conversation(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": LONG},
    ]
    full = tokens.render_ids(tokenizer, messages)
    cut = tokens.messages_prefix(tokenizer, messages, full, 100)
    assert cut is not None
    assert sum(len(m["content"]) for m in cut) < len(LONG) // 10
    assert tokens.render_ids(tokenizer, cut)[:100] == full[:100]


@pytest.mark.parametrize(
    "point",
    [
        "mlp_post.1",
        "attn_pattern.0",
        "blocks.0.attn.hook_pattern",
        "attn_z.0",
        "blocks.0.attn.hook_z",
    ],
)
def test_collect_refuses_points_that_are_not_hidden_size_rows(point):
    from vllm_hidden_states.tools.collect import CollectConfig

    cfg = CollectConfig(dataset="d.jsonl", out="out", model="m", points=[point])
    with pytest.raises(ValueError, match="not by collect yet"):
        cfg.check()
