# SPDX-License-Identifier: Apache-2.0
"""The activation store: per-request SAE features (and, opt-in, hidden states)
appended to date-partitioned Parquet, off the serving path.

:class:`ActivationStore` queues each request's arrays and returns at once; a
daemon thread writes one Parquet file per flush under
``<root>/<table>/date=YYYY-MM-DD/``. A full queue or a failed write is logged
and counted, never raised: the request is served as usual. :func:`prune`
applies the retention; :func:`feature_deltas` and :func:`threshold_search`
query the files with DuckDB. The tables' schemas (:data:`SCHEMA_VERSION`) and
their history: docs/datasets.md, "Activation store".
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 3
SAE_TABLE = "sae_features"
HIDDEN_TABLE = "hidden_states"
PROBE_TABLE = "probe_scores"
FIRING_TABLE = "probe_firings"
TABLES = (SAE_TABLE, HIDDEN_TABLE, PROBE_TABLE, FIRING_TABLE)
DEFAULT_RETENTION_DAYS = 14
RETENTION_ENV = "VLLM_HIDDEN_STATES_STORE_RETENTION_DAYS"
SOURCE_MODES = ("inline", "nearline")
_LOG_EVERY_S = 60.0


def _token_columns(pa) -> list:
    """The per-token columns both tables start with."""
    return [
        ("request_id", pa.string()),
        ("choice_index", pa.int32()),
        ("step", pa.int32()),
        ("token_position", pa.int32()),
        ("token_id", pa.int32()),
        ("created_at", pa.timestamp("us")),
    ]


def sae_schema():
    import pyarrow as pa

    return pa.schema(
        [
            *_token_columns(pa),
            ("sae_release", pa.string()),
            ("sae_layer", pa.int16()),
            ("sae_point", pa.string()),
            ("feature_id", pa.int32()),
            ("activation_value", pa.float32()),
            ("rank", pa.int16()),
            ("source_mode", pa.string()),
            ("model_id", pa.string()),
            ("schema_version", pa.int16()),
        ],
        metadata={"schema_version": str(SCHEMA_VERSION)},
    )


def hidden_schema():
    import pyarrow as pa

    return pa.schema(
        [
            *_token_columns(pa),
            ("layer", pa.int16()),
            ("point", pa.string()),
            ("vector", pa.list_(pa.float32())),
            ("model_id", pa.string()),
            ("schema_version", pa.int16()),
        ],
        metadata={"schema_version": str(SCHEMA_VERSION)},
    )


def probe_schema():
    """One row per token and probe: its ``k`` scores (``f(normalise(x) @ W.T
    + b)``, float32)."""
    import pyarrow as pa

    return pa.schema(
        [
            *_token_columns(pa),
            ("probe", pa.string()),
            ("scores", pa.list_(pa.float32())),
            ("model_id", pa.string()),
            ("schema_version", pa.int16()),
        ],
        metadata={"schema_version": str(SCHEMA_VERSION)},
    )


def firing_schema():
    """One row per probe action firing (a server monitor's or a request's own):
    where it held and the probe's score there."""
    import pyarrow as pa

    return pa.schema(
        [
            ("request_id", pa.string()),
            ("token_position", pa.int32()),
            ("created_at", pa.timestamp("us")),
            ("action", pa.string()),
            ("outcome", pa.string()),  # "stop" or "flag" (the action's then)
            ("monitor", pa.bool_()),
            ("score", pa.float32()),
            ("model_id", pa.string()),
            ("schema_version", pa.int16()),
        ],
        metadata={"schema_version": str(SCHEMA_VERSION)},
    )


@dataclass
class StoreStats:
    """Counters, updated by the writer thread and the appenders."""

    requests_queued: int = 0
    requests_dropped: int = 0  # queue full or store unavailable
    rows_written: int = 0
    rows_dropped: int = 0  # a write failed
    files_written: int = 0
    write_errors: int = 0
    partitions_pruned: int = 0


@dataclass(frozen=True)
class SaeSource:
    """The SAE that encoded a request's features.

    Attributes:
        release: its name (the ``--sae`` directory's), the ``sae_release`` column.
        layer: the decoder layer it reads (that of ``point`` when set).
        point: the capture point it reads (e.g. ``"attn_out.2"``); None for
            the residual stream at ``layer``.
    """

    release: str
    layer: int
    point: str | None = None


@dataclass
class _SaeItem:
    request_id: str
    choice_index: int
    model_id: str
    sae_release: str
    sae_layer: int
    token_ids: np.ndarray  # [n] int
    positions: np.ndarray  # [n] int
    prompt_len: int
    feature_ids: np.ndarray  # [n, k] int, -1 = empty slot
    values: np.ndarray  # [n, k] float
    source_mode: str
    created_at: dt.datetime
    sae_point: str | None = None


@dataclass
class _HiddenItem:
    request_id: str
    choice_index: int
    model_id: str
    token_ids: np.ndarray
    positions: np.ndarray
    prompt_len: int
    # HF layer, or a capture point's canonical address ("mlp_out.3") -> [n, hidden]
    states: dict[int | str, np.ndarray]
    created_at: dt.datetime


@dataclass
class _ProbeItem:
    request_id: str
    choice_index: int
    model_id: str
    token_ids: np.ndarray
    positions: np.ndarray
    prompt_len: int
    scores: dict[str, np.ndarray]  # probe name -> float32 [n, k]
    created_at: dt.datetime


@dataclass
class _FiringItem:
    request_id: str
    model_id: str
    firings: list[Any]  # ProbeFiring
    created_at: dt.datetime


def _point_layer(address: str) -> int:
    """The decoder layer of a canonical point address ``"kind.i"``."""
    return int(address.rsplit(".", 1)[1])


def _steps(positions: np.ndarray, prompt_len: int) -> np.ndarray:
    return np.maximum(positions.astype(np.int64) - prompt_len + 1, 0).astype(np.int32)


def sae_table(items: Sequence[_SaeItem]):
    """Arrow table of ``items`` in :func:`sae_schema`."""
    import pyarrow as pa

    cols: dict[str, list] = {name: [] for name in sae_schema().names}
    for it in items:
        ids = np.asarray(it.feature_ids)
        vals = np.asarray(it.values, dtype=np.float32)
        n, k = ids.shape
        keep = ids >= 0
        rows = int(keep.sum())
        pos = np.repeat(np.asarray(it.positions, dtype=np.int32), k).reshape(n, k)[keep]
        tok = np.repeat(np.asarray(it.token_ids, dtype=np.int32), k).reshape(n, k)[keep]
        cols["request_id"].append(np.full(rows, it.request_id, dtype=object))
        cols["choice_index"].append(np.full(rows, it.choice_index, dtype=np.int32))
        cols["step"].append(_steps(pos, it.prompt_len))
        cols["token_position"].append(pos)
        cols["token_id"].append(tok)
        cols["created_at"].append(
            np.full(rows, np.datetime64(it.created_at.replace(tzinfo=None), "us"))
        )
        cols["sae_release"].append(np.full(rows, it.sae_release, dtype=object))
        cols["sae_layer"].append(np.full(rows, it.sae_layer, dtype=np.int16))
        cols["sae_point"].append(np.full(rows, it.sae_point, dtype=object))
        cols["feature_id"].append(ids[keep].astype(np.int32))
        cols["activation_value"].append(vals[keep])
        cols["rank"].append(np.tile(np.arange(k, dtype=np.int16), n).reshape(n, k)[keep])
        cols["source_mode"].append(np.full(rows, it.source_mode, dtype=object))
        cols["model_id"].append(np.full(rows, it.model_id, dtype=object))
        cols["schema_version"].append(np.full(rows, SCHEMA_VERSION, dtype=np.int16))
    schema = sae_schema()
    arrays = [
        pa.array(np.concatenate(cols[f.name]) if cols[f.name] else [], type=f.type) for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def hidden_table(items: Sequence[_HiddenItem]):
    import pyarrow as pa

    schema = hidden_schema()
    cols: dict[str, list] = {name: [] for name in schema.names}
    vec_chunks = []
    for it in items:
        pos = np.asarray(it.positions, dtype=np.int32)
        tok = np.asarray(it.token_ids, dtype=np.int32)
        for key, rows in it.states.items():
            layer, point = (key, None) if isinstance(key, int) else (_point_layer(key), key)
            rows = np.asarray(rows, dtype=np.float32)
            n = rows.shape[0]
            cols["request_id"].append(np.full(n, it.request_id, dtype=object))
            cols["choice_index"].append(np.full(n, it.choice_index, dtype=np.int32))
            cols["step"].append(_steps(pos, it.prompt_len))
            cols["token_position"].append(pos)
            cols["token_id"].append(tok)
            cols["created_at"].append(
                np.full(n, np.datetime64(it.created_at.replace(tzinfo=None), "us"))
            )
            cols["layer"].append(np.full(n, layer, dtype=np.int16))
            cols["point"].append(np.full(n, point, dtype=object))
            vec_chunks.append(rows)
            cols["model_id"].append(np.full(n, it.model_id, dtype=object))
            cols["schema_version"].append(np.full(n, SCHEMA_VERSION, dtype=np.int16))
    arrays = []
    for f in schema:
        if f.name == "vector":
            if vec_chunks:
                flat = np.concatenate([c.reshape(-1) for c in vec_chunks])
                offsets = np.concatenate(
                    [
                        [0],
                        np.cumsum(
                            np.concatenate([np.full(c.shape[0], c.shape[1]) for c in vec_chunks])
                        ),
                    ]
                )
                arrays.append(
                    pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
                )
            else:
                arrays.append(pa.array([], type=f.type))
        else:
            arrays.append(
                pa.array(np.concatenate(cols[f.name]) if cols[f.name] else [], type=f.type)
            )
    return pa.Table.from_arrays(arrays, schema=schema)


def probe_table(items: Sequence[_ProbeItem]):
    """Arrow table of ``items`` in :func:`probe_schema`."""
    import pyarrow as pa

    schema = probe_schema()
    cols: dict[str, list] = {name: [] for name in schema.names if name != "scores"}
    flat: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for it in items:
        pos = np.asarray(it.positions, dtype=np.int32)
        tok = np.asarray(it.token_ids, dtype=np.int32)
        for name, rows in it.scores.items():
            n, k = rows.shape
            cols["request_id"].append(np.full(n, it.request_id, dtype=object))
            cols["choice_index"].append(np.full(n, it.choice_index, dtype=np.int32))
            cols["step"].append(_steps(pos, it.prompt_len))
            cols["token_position"].append(pos)
            cols["token_id"].append(tok)
            cols["created_at"].append(
                np.full(n, np.datetime64(it.created_at.replace(tzinfo=None), "us"))
            )
            cols["probe"].append(np.full(n, name, dtype=object))
            cols["model_id"].append(np.full(n, it.model_id, dtype=object))
            cols["schema_version"].append(np.full(n, SCHEMA_VERSION, dtype=np.int16))
            flat.append(rows.reshape(-1))
            lengths.append(np.full(n, k))
    arrays = []
    for f in schema:
        if f.name == "scores":
            offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]) if flat else [0]
            values = np.concatenate(flat) if flat else np.zeros(0, np.float32)
            arrays.append(
                pa.ListArray.from_arrays(
                    pa.array(np.asarray(offsets, dtype=np.int32)), pa.array(values)
                )
            )
        else:
            arrays.append(
                pa.array(np.concatenate(cols[f.name]) if cols[f.name] else [], type=f.type)
            )
    return pa.Table.from_arrays(arrays, schema=schema)


def firing_table(items: Sequence[_FiringItem]):
    """Arrow table of ``items`` in :func:`firing_schema`."""
    import pyarrow as pa

    rows = [(it, f) for it in items for f in it.firings]
    when = [it.created_at.replace(tzinfo=None) for it, _ in rows]
    columns = {
        "request_id": [it.request_id for it, _ in rows],
        "token_position": [f.position for _, f in rows],
        "created_at": when,
        "action": [f.label for _, f in rows],
        "outcome": [f.then for _, f in rows],
        "monitor": [f.monitor for _, f in rows],
        "score": [f.score for _, f in rows],
        "model_id": [it.model_id for it, _ in rows],
        "schema_version": [SCHEMA_VERSION] * len(rows),
    }
    schema = firing_schema()
    return pa.Table.from_arrays(
        [pa.array(columns[f.name], type=f.type) for f in schema], schema=schema
    )


def _partition_dates(root: Path, table: str) -> list[tuple[dt.date, Path]]:
    out: list[tuple[dt.date, Path]] = []
    base = root / table
    if not base.is_dir():
        return out
    for p in base.iterdir():
        if p.is_dir() and p.name.startswith("date="):
            try:
                out.append((dt.date.fromisoformat(p.name[5:]), p))
            except ValueError:
                continue
    return sorted(out)


def prune(
    root: str | Path, retention_days: int = DEFAULT_RETENTION_DAYS, today: dt.date | None = None
) -> list[Path]:
    """Delete ``date=`` partitions of every table older than ``retention_days``
    days before ``today`` (UTC). A partition dated exactly ``today -
    retention_days`` is kept. Returns the deleted directories."""
    if retention_days < 0:
        raise ValueError(f"retention_days must be >= 0, got {retention_days}")
    root = Path(root)
    today = today or dt.datetime.now(dt.timezone.utc).date()
    cutoff = today - dt.timedelta(days=retention_days)
    deleted = []
    for table in TABLES:
        for date, path in _partition_dates(root, table):
            if date < cutoff:
                shutil.rmtree(path)
                deleted.append(path)
    return deleted


def retention_days_from_env() -> int:
    raw = os.environ.get(RETENTION_ENV)
    if raw is None:
        return DEFAULT_RETENTION_DAYS
    try:
        days = int(raw)
        if days < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{RETENTION_ENV}={raw!r}: expected a whole number of days >= 0") from None
    return days


class ActivationStore:
    """Appends per-request rows to the store under ``root``, in a daemon thread.

    Args:
        root: store directory (created if possible).
        retention_days: delete partitions older than this (None: from
            ``VLLM_HIDDEN_STATES_STORE_RETENTION_DAYS``, default 14).
        max_queued: requests waiting to be written; past it, appends are
            dropped and counted.
        flush_rows: rows buffered before a file is written.
        flush_interval_s: longest time rows wait in the buffer.
        clock: ``() -> datetime`` (UTC) for created_at and partition dates
            (tests).

    Never raises from the append methods; :meth:`close` flushes.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        retention_days: int | None = None,
        max_queued: int = 1024,
        flush_rows: int = 100_000,
        flush_interval_s: float = 5.0,
        clock=None,
    ):
        self.root = Path(root)
        self.retention_days = (
            retention_days_from_env() if retention_days is None else retention_days
        )
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.stats = StoreStats()
        self._clock = clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._last_log: dict[str, float] = {}
        self._pruned_on: dt.date | None = None
        self._flushed = threading.Event()
        self.available = self._probe()
        if self.available:
            self._maybe_prune()
        self._thread = threading.Thread(
            target=self._run, name="activation-store-writer", daemon=True
        )
        self._thread.start()

    # -- serving side -------------------------------------------------------------

    def append_sae_features(
        self,
        request_id: str,
        *,
        model_id: str,
        sae: SaeSource,
        token_ids: Sequence[int] | np.ndarray,
        feature_ids: np.ndarray,
        values: np.ndarray,
        prompt_len: int,
        positions: Sequence[int] | np.ndarray | None = None,
        source_mode: str = "inline",
        choice_index: int = 0,
    ) -> bool:
        """Queue one request's top-k features of ``sae``; ``feature_ids``/``values`` are
        ``[n, k]`` (int, float) for the positions ``positions`` (default
        ``0..n-1``) whose tokens are ``token_ids`` ``[n]``. ``request_id``:
        the response's id; ``choice_index``: the choice's index in it.
        Returns whether it was queued (False: dropped and counted). Never
        raises."""
        try:
            n = len(token_ids)
            item = _SaeItem(
                request_id,
                int(choice_index),
                model_id,
                sae.release,
                int(sae.layer),
                np.asarray(token_ids),
                np.arange(n) if positions is None else np.asarray(positions),
                int(prompt_len),
                np.asarray(feature_ids),
                np.asarray(values),
                source_mode,
                self._clock(),
                sae.point,
            )
            if (
                item.feature_ids.shape != item.values.shape
                or item.feature_ids.ndim != 2
                or item.feature_ids.shape[0] != n
                or len(item.positions) != n
            ):
                raise ValueError(
                    f"feature_ids {item.feature_ids.shape} and values {item.values.shape} "
                    f"must both be [n, k] with n = {n} token ids and positions"
                )
            return self._put(item)
        except Exception as e:  # noqa: BLE001 - never fail the request
            self.stats.requests_dropped += 1
            self._log("bad", "activation store: dropped request %s: %s", request_id, e)
            return False

    def append_hidden_states(
        self,
        request_id: str,
        *,
        model_id: str,
        token_ids: Sequence[int] | np.ndarray,
        states: dict[int | str, Any],
        prompt_len: int,
        positions: Sequence[int] | np.ndarray | None = None,
        choice_index: int = 0,
    ) -> bool:
        """Queue one request's hidden states ``{layer or point: [n, hidden]}``
        (numpy or CPU torch tensors of any float dtype; a point by its
        canonical address ``"kind.i"``, ``i`` absolute); ``request_id`` and
        ``choice_index`` as in :meth:`append_sae_features`. Never raises."""
        try:
            n = len(token_ids)
            conv = {
                (k if isinstance(k, str) else int(k)): np.asarray(
                    v.float() if hasattr(v, "float") else v, dtype=np.float32
                )
                for k, v in states.items()
            }
            item = _HiddenItem(
                request_id,
                int(choice_index),
                model_id,
                np.asarray(token_ids),
                np.arange(n) if positions is None else np.asarray(positions),
                int(prompt_len),
                conv,
                self._clock(),
            )
            return self._put(item)
        except Exception as e:  # noqa: BLE001
            self.stats.requests_dropped += 1
            self._log("bad", "activation store: dropped request %s: %s", request_id, e)
            return False

    def append_probe_scores(
        self,
        request_id: str,
        *,
        model_id: str,
        token_ids: Sequence[int] | np.ndarray,
        scores: dict[str, Any],
        prompt_len: int,
        positions: Sequence[int] | np.ndarray | None = None,
        choice_index: int = 0,
    ) -> bool:
        """Queue one request's probe scores ``{probe name: [n, k]}`` (numpy or
        CPU torch, float32); ``request_id`` and ``choice_index`` as in
        :meth:`append_sae_features`. Never raises."""
        try:
            n = len(token_ids)
            item = _ProbeItem(
                request_id,
                int(choice_index),
                model_id,
                np.asarray(token_ids),
                np.arange(n) if positions is None else np.asarray(positions),
                int(prompt_len),
                {name: np.asarray(v, dtype=np.float32) for name, v in scores.items()},
                self._clock(),
            )
            return self._put(item)
        except Exception as e:  # noqa: BLE001
            self.stats.requests_dropped += 1
            self._log("bad", "activation store: dropped request %s: %s", request_id, e)
            return False

    def append_firings(self, request_id: str, *, model_id: str, firings: list[Any]) -> bool:
        """Queue a request's probe action firings (``ProbeFiring``: a row each
        in ``probe_firings``). Never raises."""
        try:
            return self._put(_FiringItem(request_id, model_id, list(firings), self._clock()))
        except Exception as e:  # noqa: BLE001
            self.stats.requests_dropped += 1
            self._log("bad", "activation store: dropped firings of %s: %s", request_id, e)
            return False

    def _put(self, item) -> bool:
        if not self.available:
            self.stats.requests_dropped += 1
            return False
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats.requests_dropped += 1
            self._log(
                "full",
                "activation store queue full (%d requests); dropping rows "
                "(%d requests dropped so far)",
                self._queue.maxsize,
                self.stats.requests_dropped,
            )
            return False
        self.stats.requests_queued += 1
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Ask the writer to write what it has; wait until it did (tests,
        shutdown). Returns False on timeout."""
        self._flushed.clear()
        try:
            self._queue.put(_FLUSH, timeout=timeout)
        except queue.Full:
            return False
        return self._flushed.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        self.flush(timeout)
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    # -- writer thread -------------------------------------------------------------

    def _probe(self) -> bool:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError as e:
            logger.warning(
                "activation store %s is not writable (%s); requests are served "
                "and their activation rows dropped (counted in the store's stats)",
                self.root,
                e,
            )
            return False

    def _log(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -1e9) >= _LOG_EVERY_S:
            self._last_log[kind] = now
            logger.warning(msg, *args)

    def _maybe_prune(self) -> None:
        today = self._clock().date()
        if self._pruned_on == today:
            return
        self._pruned_on = today
        try:
            deleted = prune(self.root, self.retention_days, today)
            self.stats.partitions_pruned += len(deleted)
            if deleted:
                logger.info(
                    "activation store: deleted %d partitions older than %d days",
                    len(deleted),
                    self.retention_days,
                )
        except OSError as e:
            self._log("prune", "activation store: retention failed: %s", e)

    def _run(self) -> None:
        sae: list[_SaeItem] = []
        hid: list[_HiddenItem] = []
        probes: list[_ProbeItem] = []
        firings: list[_FiringItem] = []
        rows = 0
        deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = _FLUSH
            if isinstance(item, _SaeItem):
                sae.append(item)
                rows += item.feature_ids.size
            elif isinstance(item, _HiddenItem):
                hid.append(item)
                rows += sum(len(v) for v in item.states.values())
            elif isinstance(item, _ProbeItem):
                probes.append(item)
                rows += sum(len(v) for v in item.scores.values())
            elif isinstance(item, _FiringItem):
                firings.append(item)
                rows += len(item.firings)
            if deadline is None and (sae or hid or probes or firings):
                deadline = time.monotonic() + self.flush_interval_s
            if item is _FLUSH or item is _STOP or rows >= self.flush_rows:
                self._write(sae, hid, probes, firings)
                sae, hid, probes, firings, rows, deadline = [], [], [], [], 0, None
                if item is _FLUSH:
                    self._flushed.set()
            if item is _STOP:
                self._flushed.set()
                return

    def _write(
        self,
        sae: list[_SaeItem],
        hid: list[_HiddenItem],
        probes: list[_ProbeItem] | None = None,
        firings: list[_FiringItem] | None = None,
    ) -> None:
        if not (sae or hid or probes or firings):
            return
        if not self.available:
            self.available = self._probe()
        for table_name, items, build in (
            (SAE_TABLE, sae, sae_table),
            (HIDDEN_TABLE, hid, hidden_table),
            (PROBE_TABLE, probes or [], probe_table),
            (FIRING_TABLE, firings or [], firing_table),
        ):
            if not items:
                continue
            nrows = 0
            try:
                # Each builder is paired with its own table's items.
                table = cast(Callable[[Any], Any], build)(items)
                nrows = table.num_rows
                self._write_table(table_name, table)
                self.stats.rows_written += nrows
                self.stats.files_written += 1
            except Exception as e:  # noqa: BLE001 - full disk, read-only, ...
                self.stats.write_errors += 1
                self.stats.rows_dropped += nrows
                self._log(
                    "write",
                    "activation store: writing %d %s rows under %s failed "
                    "(%s); rows dropped, serving continues",
                    nrows,
                    table_name,
                    self.root,
                    e,
                )
        if self.available:
            self._maybe_prune()

    def _write_table(self, table_name: str, table) -> None:
        import pyarrow.parquet as pq

        date = self._clock().date().isoformat()
        part = self.root / table_name / f"date={date}"
        part.mkdir(parents=True, exist_ok=True)
        name = f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = part / f".{name}.tmp"
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, part / name)


_FLUSH = object()
_STOP = object()


# -- queries (DuckDB) ------------------------------------------------------------


def _glob(root: str | Path, table: str) -> str:
    return str(Path(root) / table / "date=*" / "*.parquet")


def connect(root: str | Path):
    """A DuckDB connection with views ``sae_features``, ``hidden_states``,
    ``probe_scores`` and ``probe_firings`` over the store's Parquet files
    (hive partitioning: a ``date`` column; files of every schema version by
    column name, ``choice_index`` 0 where a version-1 file has none)."""
    import duckdb

    con = duckdb.connect()
    for table in TABLES:
        if any((Path(root) / table).glob("date=*/*.parquet")):
            # A relation, not SQL text: the path needs no quoting.
            rel = con.read_parquet(_glob(root, table), hive_partitioning=True, union_by_name=True)
            if table == FIRING_TABLE:
                pass  # one row per firing, of the engine request that fired
            elif "choice_index" in rel.columns:
                rel = rel.project("* REPLACE (coalesce(choice_index, 0)::INTEGER AS choice_index)")
            else:  # version-1 files only
                rel = rel.project("*, 0::INTEGER AS choice_index")
            rel.create_view(table)
    return con


FEATURE_DELTAS_SQL = """
WITH r AS (
    SELECT token_position, step, token_id, feature_id, activation_value
    FROM sae_features WHERE request_id = $request_id AND choice_index = $choice_index
        AND sae_layer = coalesce($layer, sae_layer)
),
pos AS (SELECT DISTINCT token_position, step, token_id FROM r),
feat AS (SELECT DISTINCT feature_id FROM r
         WHERE $features IS NULL OR list_contains($features, feature_id)),
grid AS (
    SELECT p.token_position, p.step, p.token_id, f.feature_id,
           coalesce(r.activation_value, 0.0) AS activation_value
    FROM pos p CROSS JOIN feat f
    LEFT JOIN r ON r.token_position = p.token_position AND r.feature_id = f.feature_id
)
SELECT feature_id, token_position, step, token_id, activation_value,
       activation_value - lag(activation_value, 1, 0.0)
           OVER (PARTITION BY feature_id ORDER BY token_position) AS delta
FROM grid ORDER BY feature_id, token_position
"""

THRESHOLD_SQL = """
SELECT request_id, choice_index, model_id, sae_release, sae_layer,
       count(*) AS positions, max(activation_value) AS max_activation,
       min(token_position) AS first_position, min(created_at) AS created_at
FROM sae_features
WHERE feature_id = $feature_id AND activation_value >= $min_activation
  AND ($since IS NULL OR created_at >= $since)
  AND ($model_id IS NULL OR model_id = $model_id)
GROUP BY ALL
ORDER BY max_activation DESC, request_id, choice_index
"""


def feature_deltas(
    root: str | Path,
    request_id: str,
    features: Sequence[int] | None = None,
    layer: int | None = None,
    choice_index: int = 0,
):
    """Feature activations over the positions of one request's choice
    (``request_id``: the response's id; ``choice_index``: the choice's index,
    0 unless the request asked for several).

    One row per (feature, position) for every feature that appears in the
    request's top-k anywhere (or the given ``features``), on every position of
    the request: ``feature_id, token_position, step, token_id,
    activation_value`` (0 where the feature was not in that position's top-k)
    and ``delta`` (change from the previous position; the first position's
    delta is its value). Returns a DuckDB relation (``.fetchall()``, ``.df()``,
    ``.arrow()``)."""
    return connect(root).sql(
        FEATURE_DELTAS_SQL,
        params={
            "request_id": request_id,
            "layer": layer,
            "choice_index": int(choice_index),
            "features": None if features is None else [int(f) for f in features],
        },
    )


def threshold_search(
    root: str | Path,
    feature_id: int,
    min_activation: float,
    since: dt.datetime | None = None,
    model_id: str | None = None,
):
    """Requests (across runs and days) where ``feature_id`` reached
    ``min_activation``, one row per choice: ``request_id, choice_index,
    model_id, sae_release, sae_layer, positions`` (how many positions),
    ``max_activation, first_position, created_at``, strongest first."""
    return connect(root).sql(
        THRESHOLD_SQL,
        params={
            "feature_id": int(feature_id),
            "min_activation": float(min_activation),
            "since": since,
            "model_id": model_id,
        },
    )


class RowsNotStored(LookupError):
    """The rows asked of :func:`stored_rows` are not (all) in the store; the
    message says what it holds."""


STORED_ROWS_SQL = f"""
SELECT token_position, vector FROM {HIDDEN_TABLE}
WHERE request_id = $id AND choice_index = $choice
  AND (point = $point OR (point IS NULL AND layer = $layer))
  AND token_position >= $start AND token_position < $end
ORDER BY token_position
"""


def stored_rows(
    root: str | Path,
    request_id: str,
    choice: int,
    point: str,
    layer: int | None,
    start: int,
    end: int,
) -> np.ndarray:
    """The hidden-state rows of one stored response: request ``request_id``'s
    choice ``choice`` at ``point`` (or, for rows stored by layer, HF layer
    ``layer``, the same stream), positions ``start .. end - 1``; float32
    ``[end - start, hidden]``. Raises :class:`RowsNotStored` naming what the
    store holds when any row is missing."""
    con = connect(root)
    try:
        tables = {row[0] for row in con.execute("SHOW TABLES").fetchall()}
        if HIDDEN_TABLE not in tables:
            raise RowsNotStored("the activation store holds no hidden states yet")
        found = con.execute(
            STORED_ROWS_SQL,
            {"id": request_id, "choice": choice, "point": point, "layer": layer,
             "start": start, "end": end},
        ).fetchall()  # fmt: skip
    finally:
        con.close()
    rows: dict[int, Any] = {}
    for position, vector in found:
        rows.setdefault(int(position), vector)
    missing = [p for p in range(start, end) if p not in rows]
    if missing:
        raise RowsNotStored(
            f"the activation store holds {len(rows)} of positions {start}..{end - 1} of "
            f"request {request_id!r} choice {choice} at {point}; missing {missing[:8]}"
            + ("..." if len(missing) > 8 else "")
            + " (did that request ask for this point at these positions?)"
        )
    return np.asarray([rows[p] for p in range(start, end)], dtype=np.float32)
