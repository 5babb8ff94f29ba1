# SPDX-License-Identifier: Apache-2.0
"""Sharded hidden-state files written by a background thread, with a manifest.

The harvest (``vllm-hidden-states collect``) hands each finished document to
:meth:`ShardWriter.submit` and goes back to the engine; a writer thread
converts, writes (Parquet or safetensors shards, one row per token per layer
or point) and records each shard in ``manifest.json``, replaced atomically
after the shard is renamed into place, so a document is finished exactly when
its shard is listed and a killed harvest resumes without loss or repeats.
:meth:`ShardWriter.submit` blocks only past ``max_pending_bytes`` of queued
data. The row schema, storage dtypes, resume and memory: docs/datasets.md,
"Harvest a dataset".
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hidden_states import bfloat16

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
FORMATS = ("parquet", "safetensors")
_SHARD_RE = re.compile(r"^shard-(\d{5,})\.(parquet|safetensors)$")


@dataclass(frozen=True)
class HarvestMeta:
    """The harvest settings a shard directory holds; equal on every rerun.

    Attributes:
        model: model path or id.
        layers: layer indices as requested (HF ``output_hidden_states`` indexing;
            negative counts from the end).
        positions: ``"prompt"`` or ``"all"``.
        hidden_size: vector length.
        dtype: storage dtype, one of :data:`STORAGE_DTYPES`.
        fmt: ``"parquet"`` or ``"safetensors"``.
        model_dtype: the engine's dtype (informational, not compared).
        points: capture points as requested (``"attn_out.3"``), after the
            layers in each document's vectors.
    """

    model: str
    layers: tuple[int, ...]
    positions: str
    hidden_size: int
    dtype: str = "float32"
    fmt: str = "parquet"
    model_dtype: str = ""
    points: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[int | str, ...]:
        """What each document's vectors hold, in order: layers, then points."""
        return (*self.layers, *self.points)

    def __post_init__(self):
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"storage dtype {self.dtype!r} is not supported; use one of "
                f"{', '.join(STORAGE_DTYPES)}"
            )
        if self.fmt not in FORMATS:
            raise ValueError(
                f"format {self.fmt!r} is not supported; use one of {', '.join(FORMATS)}"
            )
        if not self.layers and not self.points:
            raise ValueError("layers or points must name at least one layer or point")

    def compared(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("model_dtype")
        d["layers"] = list(self.layers)
        if self.points:
            d["points"] = list(self.points)
        else:
            d.pop("points")  # manifests written before points compare equal
        return d


def _point_layer(address: str) -> int:
    """The decoder layer of a point address as named (``"attn_out.-1"`` -> -1,
    ``"blocks.3.hook_mlp_out"`` -> 3)."""
    if address.startswith("blocks."):
        return int(address.split(".")[1])
    return int(address.rsplit(".", 1)[1])


# The writer thread's queue item for "flush what you have": the producer
# waits on a partial shard.
_PARTIAL = object()


@dataclass
class DocStates:
    """One document's captured states, ready to write.

    Attributes:
        doc_id: the dataset's id (string).
        token_ids: ``[n]`` int, the document's token ids (prompt, plus output
            tokens with positions "all").
        vectors: ``[num_keys, n, hidden]``, in :attr:`HarvestMeta.keys`
            order (layers, then points); float32/float16 numpy, or uint16 holding bfloat16 bits
            (then ``bf16_bits=True``).
        bf16_bits: ``vectors`` is bfloat16 as uint16 bit patterns.
    """

    doc_id: str
    token_ids: np.ndarray
    vectors: np.ndarray
    bf16_bits: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.vectors.nbytes + np.asarray(self.token_ids).nbytes)


@dataclass
class ShardInfo:
    file: str
    rows: int
    tokens: int
    docs: list[str] = field(default_factory=list)


@dataclass
class WriterStats:
    """Counters of a :class:`ShardWriter` (read them from any thread)."""

    docs_written: int = 0
    tokens_written: int = 0
    rows_written: int = 0
    shards_written: int = 0
    bytes_written: int = 0
    producer_wait_s: float = 0.0  # time submit() blocked on a full buffer


def convert_vectors(doc: DocStates, dtype: str) -> np.ndarray:
    """``doc.vectors`` in the storage dtype (uint16 bits for bfloat16)."""
    v = doc.vectors
    if dtype == "bfloat16":
        return v if doc.bf16_bits else bfloat16.narrow(v)
    if doc.bf16_bits:
        v = bfloat16.widen(v)
    return v.astype(np.float32 if dtype == "float32" else np.float16, copy=False)


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so readers see the old or the new file,
    never a partial one (temp file in the same directory, fsync, os.replace)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class WriterError(RuntimeError):
    """The writer thread failed; the message names the shard and the cause."""


class ShardWriter:
    """Background writer of :class:`DocStates` into shards plus a manifest.

    Args:
        out_dir: the shard directory (created if missing).
        meta: the harvest settings; must equal the manifest's on a rerun.
        rows_per_shard: a shard is closed after the document that brings it to
            at least this many rows (tokens x layers).
        max_pending_bytes: bound on queued plus not-yet-written bytes (see the
            module docstring); ``submit`` blocks past it.
        parquet_compression: Parquet codec (``"zstd"``, ``"snappy"``, ``"none"``).

    Use as a context manager, or call :meth:`close` (flushes the last shard).
    """

    def __init__(
        self,
        out_dir: str | Path,
        meta: HarvestMeta,
        *,
        rows_per_shard: int = 65536,
        max_pending_bytes: int = 256 << 20,
        parquet_compression: str = "zstd",
    ):
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be >= 1, got {max_pending_bytes}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.rows_per_shard = rows_per_shard
        self.max_pending_bytes = max_pending_bytes
        self.compression = parquet_compression
        self.stats = WriterStats()
        self._shards: list[ShardInfo] = []
        self._finished: set[str] = set()
        self._next_index = 0
        self._open_existing()

        self._queue: deque[DocStates | None] = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._producer_waiting = False
        # The shard being built (writer thread only).
        self._buf: list[tuple[DocStates, np.ndarray]] = []
        self._buf_rows = 0
        self._buf_bytes = 0
        self._thread = threading.Thread(
            target=self._run, name="hidden-states-shard-writer", daemon=True
        )
        self._thread.start()

    # -- resume ---------------------------------------------------------------

    def _open_existing(self) -> None:
        manifest = read_manifest(self.out_dir)
        listed: set[str] = set()
        if manifest is not None:
            if manifest.get("manifest_version") != MANIFEST_VERSION:
                raise ValueError(
                    f"{self.out_dir / MANIFEST} has manifest_version "
                    f"{manifest.get('manifest_version')!r}; this writer reads "
                    f"version {MANIFEST_VERSION}"
                )
            theirs = manifest.get("meta", {})
            ours = self.meta.compared()
            diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
            if diff:
                detail = "; ".join(
                    f"{k}: directory has {a!r}, this run {b!r}" for k, (a, b) in diff.items()
                )
                raise ValueError(
                    f"{self.out_dir} holds a harvest with other settings ({detail}); "
                    "use a new output directory or the same settings"
                )
            self._shards = [ShardInfo(**s) for s in manifest.get("shards", [])]
            for s in self._shards:
                listed.add(s.file)
                self._finished.update(s.docs)
        highest = -1
        for path in self.out_dir.iterdir():
            name = path.name
            if name.endswith(".tmp"):
                path.unlink()
                continue
            m = _SHARD_RE.match(name)
            if m is None:
                continue
            highest = max(highest, int(m.group(1)))
            if name not in listed:
                # Renamed into place but never recorded: its documents are not
                # finished and will be written again.
                logger.warning("removing %s: not in the manifest (interrupted run)", path)
                path.unlink()
        for s in self._shards:
            m = _SHARD_RE.match(s.file)
            if m:
                highest = max(highest, int(m.group(1)))
        self._next_index = highest + 1
        if manifest is None:
            self._write_manifest()

    def finished_doc_ids(self) -> set[str]:
        """Ids of the documents already in a recorded shard (skip them)."""
        return set(self._finished)

    # -- producer side --------------------------------------------------------

    def submit(self, doc: DocStates) -> None:
        """Queue one document. Returns at once unless the pending bytes exceed
        ``max_pending_bytes`` (then waits for the writer). Raises
        :class:`WriterError` if the writer thread has failed."""
        n_layers = len(self.meta.keys)
        if (
            doc.vectors.ndim != 3
            or doc.vectors.shape[0] != n_layers
            or doc.vectors.shape[2] != self.meta.hidden_size
        ):
            raise ValueError(
                f"document {doc.doc_id!r}: vectors have shape {tuple(doc.vectors.shape)}; "
                f"expected [{n_layers} layers and points, tokens, {self.meta.hidden_size}]"
            )
        if len(doc.token_ids) != doc.vectors.shape[1]:
            raise ValueError(
                f"document {doc.doc_id!r}: {len(doc.token_ids)} token ids for "
                f"{doc.vectors.shape[1]} positions"
            )
        size = doc.nbytes
        with self._cond:
            t0 = None
            while (
                self._pending_bytes
                and self._pending_bytes + size > self.max_pending_bytes
                and self._error is None
            ):
                t0 = t0 or time.monotonic()
                # Tells the writer to close a partial shard rather than wait
                # for more rows that cannot come.
                self._producer_waiting = True
                self._cond.notify_all()
                self._cond.wait()
            self._producer_waiting = False
            if t0 is not None:
                self.stats.producer_wait_s += time.monotonic() - t0
            self._raise_if_failed()
            if self._closed:
                raise WriterError("submit() after close()")
            self._queue.append(doc)
            self._pending_bytes += size
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WriterError(f"the shard writer failed: {self._error!r}") from self._error

    def close(self) -> None:
        """Write what is queued and the last shard; wait for the thread."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._queue.append(None)
                self._cond.notify_all()
        self._thread.join()
        self._raise_if_failed()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    # -- writer thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not (self._producer_waiting and self._buf):
                        self._cond.wait()
                    doc = self._queue.popleft() if self._queue else _PARTIAL
                if doc is _PARTIAL:  # the producer waits on a partial shard
                    self._flush()
                    continue
                if doc is None:
                    self._flush()
                    return
                assert isinstance(doc, DocStates)
                vectors = convert_vectors(doc, self.meta.dtype)
                self._buf.append((doc, vectors))
                self._buf_rows += vectors.shape[0] * vectors.shape[1]
                self._buf_bytes += doc.nbytes
                if self._buf_rows >= self.rows_per_shard:
                    self._flush()
        except BaseException as e:  # noqa: BLE001 - surfaced to the producer
            logger.exception("shard writer failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _flush(self) -> None:
        if not self._buf:
            return
        name = f"shard-{self._next_index:05d}.{self.meta.fmt}"
        path = self.out_dir / name
        tmp = path.with_name(name + ".tmp")
        if self.meta.fmt == "parquet":
            self._write_parquet(tmp)
        else:
            self._write_safetensors(tmp)
        os.replace(tmp, path)
        docs = [d.doc_id for d, _ in self._buf]
        tokens = sum(d.num_tokens for d, _ in self._buf)
        self._shards.append(ShardInfo(name, self._buf_rows, tokens, docs))
        self._finished.update(docs)
        self._write_manifest()
        self._next_index += 1
        s = self.stats
        s.docs_written += len(docs)
        s.tokens_written += tokens
        s.rows_written += self._buf_rows
        s.shards_written += 1
        s.bytes_written += path.stat().st_size
        freed = self._buf_bytes
        self._buf, self._buf_rows, self._buf_bytes = [], 0, 0
        with self._cond:
            self._pending_bytes -= freed
            self._cond.notify_all()

    def _columns(self):
        meta = self.meta
        layers = np.asarray([*meta.layers, *(_point_layer(p) for p in meta.points)], dtype=np.int16)
        point_ids = np.asarray(
            [-1] * len(meta.layers) + list(range(len(meta.points))), dtype=np.int16
        )
        doc_idx, pos, tok, lay, pts, vecs = [], [], [], [], [], []
        for i, (doc, v) in enumerate(self._buf):
            n_layers, n = v.shape[0], v.shape[1]
            doc_idx.append(np.full(n_layers * n, i, dtype=np.int64))
            pos.append(np.tile(np.arange(n, dtype=np.int32), n_layers))
            tok.append(np.tile(np.asarray(doc.token_ids, dtype=np.int32), n_layers))
            lay.append(np.repeat(layers, n))
            pts.append(np.repeat(point_ids, n))
            vecs.append(v.reshape(n_layers * n, v.shape[2]))
        return (
            np.concatenate(doc_idx),
            np.concatenate(pos),
            np.concatenate(tok),
            np.concatenate(lay),
            np.concatenate(pts),
            np.concatenate(vecs),
        )

    def _write_parquet(self, tmp: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        doc_idx, pos, tok, lay, pts, vecs = self._columns()
        ids = pa.array([d.doc_id for d, _ in self._buf], pa.string())
        names = pa.array([None, *self.meta.points], pa.string())
        point = names.take(pa.array(pts.astype(np.int32) + 1))
        doc_col = pa.DictionaryArray.from_arrays(pa.array(doc_idx.astype(np.int32)), ids)
        hidden = self.meta.hidden_size
        flat = pa.array(vecs.reshape(-1))
        vector = pa.FixedSizeListArray.from_arrays(flat, hidden)
        vmeta = {"dtype": self.meta.dtype}
        schema = pa.schema(
            [
                pa.field("doc_id", pa.dictionary(pa.int32(), pa.string())),
                pa.field("position", pa.int32()),
                pa.field("token_id", pa.int32()),
                pa.field("layer", pa.int16()),
                pa.field("point", pa.string()),
                pa.field("vector", vector.type, metadata=vmeta),
            ],
            metadata={"vllm_hidden_states": json.dumps(self.meta.compared())},
        )
        table = pa.Table.from_arrays(
            [doc_col, pa.array(pos), pa.array(tok), pa.array(lay), point, vector], schema=schema
        )
        pq.write_table(
            table,
            tmp,
            compression=self.compression,
            row_group_size=min(max(self._buf_rows, 1), 65536),
        )

    def _write_safetensors(self, tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file

        doc_idx, pos, tok, lay, pts, vecs = self._columns()
        v = torch.from_numpy(np.ascontiguousarray(vecs))
        if self.meta.dtype == "bfloat16":
            v = v.view(torch.int16).view(torch.bfloat16)
        tensors = {
            "vectors": v.contiguous(),
            "doc_index": torch.from_numpy(doc_idx),
            "position": torch.from_numpy(pos),
            "token_id": torch.from_numpy(tok),
            "layer": torch.from_numpy(lay),
            "point_index": torch.from_numpy(pts),
        }
        metadata = {
            "doc_ids": json.dumps([d.doc_id for d, _ in self._buf]),
            "points": json.dumps(list(self.meta.points)),
            "vllm_hidden_states": json.dumps(self.meta.compared()),
        }
        save_file(tensors, str(tmp), metadata=metadata)

    def _write_manifest(self) -> None:
        write_json_atomic(
            self.out_dir / MANIFEST,
            {
                "manifest_version": MANIFEST_VERSION,
                "meta": {**self.meta.compared(), "model_dtype": self.meta.model_dtype},
                "finished_docs": len(self._finished),
                "shards": [asdict(s) for s in self._shards],
            },
        )
