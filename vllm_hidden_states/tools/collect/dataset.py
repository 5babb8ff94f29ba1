# SPDX-License-Identifier: Apache-2.0
"""The documents of a ``collect`` dataset, read lazily (JSON lines, Parquet or
plain text; the formats and the id rule: docs/datasets.md), and in batches
of unique ids that skip the documents an earlier run finished."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hidden_states.tools.collect.config import CollectResult


@dataclass
class Doc:
    """One dataset record: exactly one of ``text`` and ``messages``."""

    doc_id: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None


def _record_to_doc(rec: dict[str, Any], default_id: int, where: str, unit: str) -> Doc:
    if "id" in rec:
        doc_id = rec["id"]
        if not isinstance(doc_id, str):
            try:
                shown = json.dumps(doc_id)[:80]
            except (TypeError, ValueError):
                shown = repr(doc_id)[:80]
            if doc_id is not None:
                shown += f" ({type(doc_id).__name__})"
            raise ValueError(
                f"{where}: 'id' is {shown}; an id must be a string (e.g. \"doc-17\"), or "
                f"leave 'id' out and the record gets its 0-based {unit} ({default_id})"
            )
    else:
        doc_id = str(default_id)
    text, messages = rec.get("text"), rec.get("messages")
    if (text is None) == (messages is None):
        raise ValueError(
            f"{where}: a record needs exactly one of 'text' (a string) and "
            f"'messages' (a list of chat messages); got keys {sorted(rec)}"
        )
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: 'text' must be a string, got {type(text).__name__}")
    if messages is not None and not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list, got {type(messages).__name__}")
    return Doc(doc_id, text, messages)


def read_dataset(path: str | Path) -> Iterator[Doc]:
    """The documents of ``path`` in order: JSON lines (``*.jsonl``, ``*.json``:
    ``{"id", "text" | "messages"}``), Parquet (columns ``id``, ``text`` or
    ``messages``, read in record batches) or plain text (a prompt a line, blank
    lines skipped, the 0-based line number its id). An id is a string, or left
    out for the 0-based line (blank lines counted) or row number; any other is
    refused, naming the line or row (docs/datasets.md)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}:{i + 1}: not valid JSON ({e}); expected one JSON object per line"
                    ) from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}:{i + 1}: expected a JSON object per line")
                yield _record_to_doc(rec, i, f"{path}:{i + 1}", "line number")
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                yield _record_to_doc(rec, row, f"{path} row {row}", "row number")
                row += 1
    else:
        with open(path) as f:
            for i, line in enumerate(f):
                text = line.rstrip("\n")
                if text.strip():
                    yield Doc(str(i), text)


def batches(
    docs: Iterator[Doc], finished: set[str], size: int, limit: int | None, result: CollectResult
) -> Iterator[list[Doc]]:
    seen: set[str] = set()
    batch: list[Doc] = []
    for n, doc in enumerate(docs):
        if limit is not None and n >= limit:
            break
        if doc.doc_id in seen:
            raise ValueError(
                f"document id {doc.doc_id!r} appears twice in the dataset; "
                "ids must be unique (they key resume)"
            )
        seen.add(doc.doc_id)
        if doc.doc_id in finished:
            result.skipped += 1
            continue
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
