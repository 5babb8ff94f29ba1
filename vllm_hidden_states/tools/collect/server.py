# SPDX-License-Identifier: Apache-2.0
"""``collect --server-url``: harvest from a running ``vllm serve
--enable-hidden-states`` over HTTP (POST /v1/hidden_states per batch and
layer, base64; ``--concurrency`` batches in flight; prompt positions only).
Token ids come from a local tokenizer (the route's own ``encode``) or the
server's /tokenize (conversations; text without a local tokenizer), cut to
the returned length.
A document the server refuses (400, 413, 422) is skipped and recorded in
``OUT/refused.json``; the run goes on (docs/datasets.md, "Refused
documents")."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from vllm_hidden_states.store.parquet_shards import (
    DocStates,
    HarvestMeta,
    ShardWriter,
    write_json_atomic,
)
from vllm_hidden_states.tools.collect.config import CollectConfig, CollectResult, progress_bar
from vllm_hidden_states.tools.collect.dataset import Doc, batches, read_dataset
from vllm_hidden_states.tools.collect.tokens import messages_prefix, render_ids, text_prefix

# Not vllm.logger.init_logger: the console script imports this module for
# every command, ``patch apply`` included, which must not import vLLM. The
# logger is the same object (loggers are per name); the plugin routes
# ``vllm_hidden_states.*`` records through vLLM's handlers once vLLM loads.
logger = logging.getLogger(__name__)

REFUSED_FILE = "refused.json"
# Answers that refuse one document (its size, its length, its content), not
# the run: the document is skipped and recorded.
REFUSAL_STATUSES = (400, 413, 422)


class _RefusalLog:
    """``OUT/refused.json``: the documents the server refused, ``{id:
    {"status": int, "error": str}}``; an entry goes once its document is
    stored by a later run."""

    def __init__(self, out: Path):
        self.path = Path(out) / REFUSED_FILE
        self.docs: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self.docs = json.loads(self.path.read_text())

    def add(self, doc_id: str, status: int, error: str) -> None:
        self.docs[doc_id] = {"status": status, "error": error}
        write_json_atomic(self.path, self.docs)

    def drop_finished(self, finished: set[str]) -> None:
        done = [d for d in self.docs if d in finished]
        for d in done:
            del self.docs[d]
        if done:
            if self.docs:
                write_json_atomic(self.path, self.docs)
            else:
                self.path.unlink()


class _Refused(RuntimeError):
    """The server refused a request with a 4xx status naming the input."""

    def __init__(self, method: str, path: str, status: int, error: str):
        super().__init__(f"{method} {path} answered {status}: {error}")
        self.status = status
        self.error = error


@dataclass
class _Prepared:
    """A document as it is sent: ``text`` or ``messages`` (cut to about
    ``max_length`` tokens when a local tokenizer could check the cut),
    ``ids`` its token ids when known here (already cut), ``truncated`` whether
    it is longer than ``max_length`` (None: not known yet)."""

    doc: Doc
    text: str | None
    messages: list[dict[str, Any]] | None
    ids: list[int] | None
    truncated: bool | None


class _ServerClient:
    def __init__(self, cfg: CollectConfig):
        import httpx

        assert cfg.server_url is not None  # _ServerClient serves --server-url runs
        self.base = cfg.server_url.rstrip("/")
        self.http = httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0))
        models = self._json("GET", "/v1/models")["data"]
        if cfg.served_model is None:
            self.model, root = models[0]["id"], models[0].get("root")
        else:
            match = [m for m in models if m["id"] == cfg.served_model]
            if not match:
                raise ValueError(
                    f"the server does not serve {cfg.served_model!r}; it serves "
                    f"{', '.join(m['id'] for m in models)}"
                )
            self.model, root = match[0]["id"], match[0].get("root")
        self.root = root or self.model
        self.tokenizer = None
        source = cfg.tokenizer or self.root
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as e:  # noqa: BLE001 - fall back to the server's /tokenize
            logger.warning(
                "no local tokenizer from %s (%s); using the server's /tokenize, "
                "and documents go whole (the server cuts them to --max-length; "
                "one over its input limits is skipped and recorded)",
                source,
                e,
            )

    def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        r = self.http.request(method, self.base + path, json=body)
        if r.status_code != 200:
            try:
                error = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - not vLLM's error object
                error = r.text
            error = error[:500]
            if r.status_code in REFUSAL_STATUSES:
                raise _Refused(method, path, r.status_code, error)
            raise RuntimeError(f"{method} {path} answered {r.status_code}: {error}")
        return r.json()

    def prepare(self, doc: Doc, max_length: int) -> _Prepared:
        """Cut a long document here when the local tokenizer can check the cut."""
        if self.tokenizer is None:
            return _Prepared(doc, doc.text, doc.messages, None, None)
        if doc.text is not None:
            full = list(self.tokenizer.encode(doc.text))
            if len(full) <= max_length:
                return _Prepared(doc, doc.text, None, full, False)
            prefix = text_prefix(self.tokenizer, doc.text, full, max_length)
            return _Prepared(
                doc, doc.text if prefix is None else prefix, None, full[:max_length], True
            )
        assert doc.messages is not None  # a document is text or messages
        try:
            full = render_ids(self.tokenizer, doc.messages)
        except Exception:  # noqa: BLE001 - no chat template here: the server's decides
            return _Prepared(doc, None, doc.messages, None, None)
        if len(full) <= max_length:
            return _Prepared(doc, None, doc.messages, None, False)
        cut = messages_prefix(self.tokenizer, doc.messages, full, max_length)
        return _Prepared(doc, None, doc.messages if cut is None else cut, None, True)

    def token_ids(self, p: _Prepared, max_length: int) -> list[int]:
        """The document's token ids, cut to ``max_length`` (sets ``p.truncated``
        when only the server could tell)."""
        if p.ids is not None:
            return p.ids
        # Messages are always tokenized by the server (its chat template).
        body: dict[str, Any] = {"model": self.model}
        if p.text is not None:
            body["prompt"] = p.text
        else:
            body.update(messages=p.messages, add_generation_prompt=True)
        ids = list(self._json("POST", "/tokenize", body)["tokens"])
        if p.truncated is None:
            p.truncated = len(ids) > max_length
        return ids[:max_length]

    def states(self, docs: list[_Prepared], layer: int | str, max_length: int) -> list[np.ndarray]:
        """``[n_i, hidden]`` float32 per document at ``layer`` (a point: its address)."""
        address = {"point": layer} if isinstance(layer, str) else {"layer": layer}
        from vllm_hidden_states.client import to_numpy

        texts = [p for p in docs if p.text is not None]
        out: dict[int, np.ndarray] = {}
        if texts:
            body = {
                "model": self.model,
                "input": [p.text for p in texts],
                **address,
                "max_length": max_length,
                "encoding_format": "base64",
            }
            arrays = to_numpy(self._json("POST", "/v1/hidden_states", body))
            out.update({id(p): a for p, a in zip(texts, arrays)})
        for p in docs:
            if p.messages is not None:
                body = {
                    "model": self.model,
                    "messages": p.messages,
                    **address,
                    "max_length": max_length,
                    "encoding_format": "base64",
                }
                # One conversation per request: one array back.
                out[id(p)] = cast(
                    np.ndarray, to_numpy(self._json("POST", "/v1/hidden_states", body))
                )
        return [out[id(p)] for p in docs]

    def _run(self, docs: list[_Prepared], layers: list[int | str], max_length: int):
        per_layer = [self.states(docs, layer, max_length) for layer in layers]
        results = []
        for i, p in enumerate(docs):
            n = per_layer[0][i].shape[0]
            ids = self.token_ids(p, max_length)
            if len(ids) < n:
                raise RuntimeError(
                    f"document {p.doc.doc_id!r}: the server returned {n} positions but the "
                    f"tokenizer gives {len(ids)} tokens; pass --tokenizer matching the "
                    "server's model"
                )
            results.append(
                (
                    p.doc,
                    (
                        np.asarray(ids[:n], dtype=np.int32),
                        np.stack([layer_rows[i] for layer_rows in per_layer]),
                        bool(p.truncated),
                    ),
                )
            )
        return results

    def batch(self, docs: list[Doc], layers: list[int | str], max_length: int):
        """``(doc, (token_ids [n], vectors [layers, n, hidden], truncated))``
        per document, or ``(doc, _Refused)`` for one the server refused (a
        refused batch is retried one document at a time to find which)."""
        prepared = [self.prepare(doc, max_length) for doc in docs]
        try:
            return self._run(prepared, layers, max_length)
        except _Refused as e:
            if len(prepared) == 1:
                return [(docs[0], e)]
        results = []
        for p in prepared:
            try:
                results += self._run([p], layers, max_length)
            except _Refused as e:
                results.append((p.doc, e))
        return results

    def close(self) -> None:
        self.http.close()


def collect_server(cfg: CollectConfig, result: CollectResult) -> None:
    client = _ServerClient(cfg)
    layers: list[int | str] = [*cfg.layers, *cfg.points]
    try:
        # One small request per layer: a layer or setting the server refuses
        # ends the run here, not as one refusal per document.
        probe = [_Prepared(Doc("probe", text="a"), "a", None, None, None)]
        hidden = [int(client.states(probe, layer, 8)[0].shape[1]) for layer in layers]
        meta = HarvestMeta(
            model=f"{client.base}#{client.model}",
            layers=tuple(cfg.layers),
            points=tuple(cfg.points),
            positions="prompt",
            hidden_size=hidden[0],
            dtype=cfg.dtype,
            fmt=cfg.fmt,
            model_dtype="float32 (HTTP)",
        )
        refusals = _RefusalLog(Path(cfg.out))
        with (
            ShardWriter(
                cfg.out,
                meta,
                rows_per_shard=cfg.rows_per_shard,
                max_pending_bytes=cfg.max_pending_mb << 20,
            ) as writer,
            ThreadPoolExecutor(max_workers=cfg.concurrency) as pool,
        ):
            bar = progress_bar(cfg)
            t0 = time.monotonic()
            inflight: list[Future] = []

            def drain_one() -> None:
                tokens = 0
                for doc, got in inflight.pop(0).result():
                    if isinstance(got, _Refused):
                        result.refused += 1
                        result.refused_docs[doc.doc_id] = {"status": got.status, "error": got.error}
                        refusals.add(doc.doc_id, got.status, got.error)
                        logger.warning(
                            "document %r skipped: the server refused it (%d: %s); recorded in %s",
                            doc.doc_id,
                            got.status,
                            got.error,
                            refusals.path,
                        )
                        continue
                    ids, vectors, truncated = got
                    writer.submit(DocStates(doc.doc_id, ids, vectors))
                    tokens += len(ids)
                    result.docs += 1
                    result.truncated += truncated
                result.tokens += tokens
                if bar is not None:
                    bar.update(tokens)
                    bar.set_postfix(
                        docs=result.docs,
                        skipped=result.skipped,
                        truncated=result.truncated,
                        refused=result.refused,
                        refresh=False,
                    )

            for batch in batches(
                read_dataset(cfg.dataset),
                writer.finished_doc_ids(),
                cfg.batch_size,
                cfg.limit,
                result,
            ):
                inflight.append(pool.submit(client.batch, batch, layers, cfg.max_length))
                while len(inflight) >= cfg.concurrency:
                    drain_one()
            while inflight:
                drain_one()
            writer.close()
            refusals.drop_finished(writer.finished_doc_ids())
            result.seconds = time.monotonic() - t0
            result.producer_wait_s = writer.stats.producer_wait_s
            result.stats = vars(writer.stats).copy()
            if bar is not None:
                bar.close()
    finally:
        client.close()
