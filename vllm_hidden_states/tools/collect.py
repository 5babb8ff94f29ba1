# SPDX-License-Identifier: Apache-2.0
"""``vllm-hidden-states collect``: harvest hidden states of a dataset to shards.

    vllm-hidden-states collect DATASET OUT --model M [--layers -2] [--points attn_out.3]
                                            [--positions prompt]
    vllm-hidden-states collect DATASET OUT --server-url http://host:8000 [--layers -2]

**Datasets** (read lazily, one batch at a time; document ids must be unique):

* ``*.jsonl`` / ``*.json`` (JSON lines): ``{"id": ..., "text": "..."}`` or
  ``{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}`` (the
  model's chat template is applied with ``add_generation_prompt=True``).
  ``id`` is a string; a line without ``id`` gets its 0-based line number
  (blank lines counted). Any other ``id`` (null, a number, a list...) is
  refused, naming the line.
* ``*.parquet``: columns ``id`` (optional; else the 0-based row number; a
  string column, nulls refused) and ``text`` (or ``messages``), read in
  record batches.
* anything else: plain text, one prompt per line; the id is the line number
  (0-based); blank lines are skipped.

**Long and refused documents.** Each document keeps its first
``--max-length`` tokens, cut on this side: the offline engine gets the token
ids; in server mode, with a local tokenizer (``--tokenizer``, default the
server's model root), a longer text is sent as a prefix that encodes to the
same first ``--max-length`` tokens (checked here; likewise a long chat
conversation), so a 3 MB document costs a small request. A document the
server still refuses (HTTP 400, 413 or 422: over its input-size limits
without a local tokenizer to cut it with, too long for its context...) is
skipped and recorded in ``OUT/refused.json`` (``{id: {"status", "error"}}``;
a rerun tries it again and drops it from there once stored); the run goes
on. The final report counts ``truncated`` and ``refused`` documents.

**One run per directory.** A run holds an exclusive lock (``fcntl.flock``
on ``OUT/.collect.lock``) from its start to its end; a second run into the
same directory is refused at once (:class:`OutputLocked`, exit status 2)
instead of deleting the first one's temporary shards.

**Engines.** ``--model``: the offline engine in this process (``vllm.LLM``
with ``enable_hidden_states``, the capturable set = ``--layers``); each batch
of ``--batch-size`` documents runs as one ``LLM.generate`` with
``SamplingParams(return_hidden_states=True, hidden_states_positions=...)``.
``--positions prompt``: every prompt position, one forward (``max_tokens=1``,
the text-encoder and SAE-training use); ``--positions all``: prompt and
``--max-tokens`` generated positions. ``--server-url``: a running ``vllm
serve --enable-hidden-states``: POST /v1/hidden_states per batch and layer
(base64), ``--concurrency`` batches in flight (prompt positions only). Token
ids come from the model's tokenizer here (text; the same ``encode`` the route
uses) or the server's /tokenize (messages), cut to the returned length.

**Output**: see :mod:`vllm_hidden_states.store.parquet_shards` (rows, manifest,
resume). Rerunning the same command after a kill skips finished documents.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from vllm_hidden_states.store.parquet_shards import (
    FORMATS,
    STORAGE_DTYPES,
    DocStates,
    HarvestMeta,
    ShardWriter,
    write_json_atomic,
)

# Not vllm.logger.init_logger: the console script imports this module for
# every command, ``patch apply`` included, which must not import vLLM. The
# logger is the same object (loggers are per name); the plugin routes
# ``vllm_hidden_states.*`` records through vLLM's handlers once vLLM loads.
logger = logging.getLogger(__name__)

POSITIONS = ("prompt", "all")
LOCK_FILE = ".collect.lock"
REFUSED_FILE = "refused.json"
# Answers that refuse one document (its size, its length, its content), not
# the run: the document is skipped and recorded.
REFUSAL_STATUSES = (400, 413, 422)


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
    """The documents of ``path`` in order (see the module docstring)."""
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


@dataclass
class CollectConfig:
    """What ``collect`` does; the command-line flags map one to one.

    Attributes:
        dataset: dataset path. out: shard directory.
        model: model for the offline engine (or None with ``server_url``).
        server_url: base URL of a running server (``http://host:port``).
        served_model: the server's model name (default: its first model).
        layers: layer indices (HF ``output_hidden_states`` indexing).
        points: capture points (``"attn_out.3"``, ``"blocks.3.hook_mlp_out"``),
            stored after the layers (``point`` column).
        positions: ``"prompt"`` or ``"all"``.
        max_tokens: generated tokens per document with ``"all"``.
        max_length: prompt tokens kept per document (the first ones).
        batch_size: documents per engine call / HTTP request.
        concurrency: HTTP batches in flight (server mode).
        dtype: storage dtype; fmt: ``"parquet"`` or ``"safetensors"``.
        rows_per_shard, max_pending_mb: see :class:`ShardWriter`.
        limit: stop after this many documents of the dataset (None: all).
        progress: show a tqdm bar (tokens/s).
        engine_kwargs: extra ``vllm.LLM`` keyword arguments.
    """

    dataset: str
    out: str
    model: str | None = None
    server_url: str | None = None
    served_model: str | None = None
    tokenizer: str | None = None
    layers: list[int] = field(default_factory=lambda: [-2])
    points: list[str] = field(default_factory=list)
    positions: str = "prompt"
    max_tokens: int = 16
    max_length: int = 512
    batch_size: int = 32
    concurrency: int = 2
    dtype: str = "float32"
    fmt: str = "parquet"
    rows_per_shard: int = 65536
    max_pending_mb: int = 256
    limit: int | None = None
    progress: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if (self.model is None) == (self.server_url is None):
            raise ValueError("give exactly one of --model (offline engine) and --server-url")
        if self.positions not in POSITIONS:
            raise ValueError(f"--positions {self.positions!r}: use one of {', '.join(POSITIONS)}")
        if self.server_url is not None and self.positions != "prompt":
            raise ValueError(
                "--server-url collects prompt positions only (POST "
                "/v1/hidden_states); use --model for --positions all"
            )
        if len(set(self.layers)) != len(self.layers) or len(set(self.points)) != len(self.points):
            raise ValueError(
                f"--layers {self.layers} / --points {self.points}: name each layer and point once"
            )
        if not self.layers and not self.points:
            raise ValueError("name at least one layer (--layers) or point (--points)")
        from vllm_hidden_states.points import is_neuron_address, is_pattern_address

        other = [p for p in self.points if is_neuron_address(p) or is_pattern_address(p)]
        if other:
            raise ValueError(
                f"--points {other}: collect stores rows of the model's hidden size; "
                "mlp_post (intermediate_size wide) and attention patterns are served "
                "on the completion routes and the Python API, not by collect yet"
            )
        for name in ("batch_size", "max_length", "max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


@dataclass
class CollectResult:
    """What a run did. ``tokens_per_s``: tokens written per second of wall time
    (engine start excluded)."""

    out: str
    docs: int = 0
    tokens: int = 0
    skipped: int = 0  # finished by an earlier run (resume)
    empty: int = 0  # encode to no tokens
    truncated: int = 0  # stored as their first max_length tokens
    refused: int = 0  # refused by the server: skipped, in OUT/refused.json
    refused_docs: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    producer_wait_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _batches(
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


def _to_numpy(t) -> tuple[np.ndarray, bool]:
    """A CPU torch tensor as numpy; bfloat16 as uint16 bits (flag True)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), True
    return t.numpy(), False


def _progress(cfg: CollectConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(unit="tok", unit_scale=True, desc="collect", dynamic_ncols=True)


def _tokenize_text(tokenizer, text: str, max_length: int) -> list[int]:
    """The first ``max_length`` token ids of a text, as the route encodes it
    (benchmarks/harvest.py uses it)."""
    return list(tokenizer.encode(text))[:max_length]


def _render_ids(tokenizer, messages) -> list[int]:
    """A conversation's token ids: the chat template with the generation
    prompt, encoded without adding special tokens (the template has them)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def _doc_ids(tokenizer, doc: Doc) -> list[int]:
    """Every token id of a document (not cut)."""
    if doc.text is not None:
        return list(tokenizer.encode(doc.text))
    return _render_ids(tokenizer, doc.messages)


# A first guess of characters per token for a prefix; doubled until it holds.
_CHARS_PER_TOKEN = 8


def _text_prefix(tokenizer, text: str, full_ids: list[int], max_length: int) -> str | None:
    """A prefix of ``text`` whose encoding starts with the same ``max_length``
    tokens as the whole text's (``full_ids``), so a server that encodes it and
    keeps the first ``max_length`` tokens computes exactly those: starts near
    ``max_length`` tokens' worth of characters and doubles until that holds.
    None if only the whole text does."""
    want = full_ids[:max_length]
    chars = _CHARS_PER_TOKEN * max_length + 64
    while chars < len(text):
        prefix = text[:chars]
        if list(tokenizer.encode(prefix))[:max_length] == want:
            return prefix
        chars *= 2
    return None


def _messages_prefix(
    tokenizer, messages: list[dict[str, Any]], full_ids: list[int], max_length: int
) -> list[dict[str, Any]] | None:
    """Like :func:`_text_prefix` for a conversation: the messages cut to a
    budget of content characters (later ones dropped) whose rendering starts
    with the same ``max_length`` tokens as the whole conversation's. None if
    none does short of the whole (or a content is not a string)."""
    want = full_ids[:max_length]
    if not all(isinstance(m.get("content"), str) for m in messages):
        return None
    contents: list[str] = [m["content"] for m in messages]
    total = sum(map(len, contents))
    budget = _CHARS_PER_TOKEN * max_length + 64
    while budget < total:
        cut, left = [], budget
        for message, content in zip(messages, contents):
            if left <= 0:
                break
            cut.append({**message, "content": content[:left]})
            left -= len(content)
        try:
            if _render_ids(tokenizer, cut)[:max_length] == want:
                return cut
        except Exception:  # noqa: BLE001 - a template that wants the whole conversation
            return None
        budget *= 2
    return None


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


# -- offline engine ----------------------------------------------------------------


def _collect_offline(cfg: CollectConfig, llm, result: CollectResult) -> None:
    from vllm import LLM

    if llm is None:
        kwargs = dict(cfg.engine_kwargs)
        import torch

        if not torch.cuda.is_available():
            # vLLM CPU reserves gpu_memory_utilization x the machine's RAM
            # (0.92 by default), which fails beside any other process; take
            # what `make serve` takes unless told otherwise.
            kwargs.setdefault("gpu_memory_utilization", 0.3)
        llm = LLM(
            model=cfg.model,
            enable_hidden_states=True,
            hidden_states_layers=list(cfg.layers) or [-1],
            hidden_states_points=list(cfg.points) or None,
            **kwargs,
        )
        try:
            _run_offline(cfg, llm, result)
        finally:
            llm.llm_engine.engine_core.shutdown()
    else:
        _run_offline(cfg, llm, result)


def _run_offline(cfg: CollectConfig, llm, result: CollectResult) -> None:
    import torch

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_config = llm.llm_engine.model_config
    tokenizer = llm.get_tokenizer()
    meta = HarvestMeta(
        model=str(cfg.model),
        layers=tuple(cfg.layers),
        points=tuple(cfg.points),
        positions=cfg.positions,
        hidden_size=model_config.get_hidden_size(),
        dtype=cfg.dtype,
        fmt=cfg.fmt,
        model_dtype=str(model_config.dtype).removeprefix("torch."),
    )
    # The prompt must leave room for one generated token (and, with "all",
    # for the final token's extract).
    max_prompt = min(cfg.max_length, model_config.max_model_len - 2)
    params = SamplingParams(
        max_tokens=1 if cfg.positions == "prompt" else cfg.max_tokens,
        temperature=0.0,
        detokenize=False,
        return_hidden_states=True,
        hidden_states_layers=list(cfg.layers) or None,
        hidden_states_points=list(cfg.points) or None,
        hidden_states_positions=cfg.positions,
    )
    with ShardWriter(
        cfg.out, meta, rows_per_shard=cfg.rows_per_shard, max_pending_bytes=cfg.max_pending_mb << 20
    ) as writer:
        bar = _progress(cfg)
        t0 = time.monotonic()
        for batch in _batches(
            read_dataset(cfg.dataset), writer.finished_doc_ids(), cfg.batch_size, cfg.limit, result
        ):
            prompts, kept = [], []
            for doc in batch:
                ids = _doc_ids(tokenizer, doc)
                if not ids:
                    result.empty += 1
                    logger.warning("document %r encodes to no tokens; skipped", doc.doc_id)
                    continue
                if len(ids) > max_prompt:
                    result.truncated += 1
                    ids = ids[:max_prompt]
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                kept.append(doc)
            outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
            tokens = 0
            for doc, out in zip(kept, outputs):
                completion = out.outputs[0]
                token_ids = list(out.prompt_token_ids)
                if cfg.positions == "all":
                    token_ids += list(completion.token_ids)
                states = completion.hidden_states
                if states is None:
                    raise RuntimeError(
                        f"document {doc.doc_id!r}: the engine returned no hidden states"
                    )
                keys = [*cfg.layers, *cfg.points]
                vectors, bf16 = _to_numpy(torch.stack([states[key] for key in keys]))
                writer.submit(
                    DocStates(doc.doc_id, np.asarray(token_ids, dtype=np.int32), vectors, bf16)
                )
                tokens += len(token_ids)
                result.docs += 1
            result.tokens += tokens
            if bar is not None:
                bar.update(tokens)
                bar.set_postfix(
                    docs=result.docs,
                    skipped=result.skipped,
                    truncated=result.truncated,
                    refresh=False,
                )
        writer.close()
        result.seconds = time.monotonic() - t0
        result.producer_wait_s = writer.stats.producer_wait_s
        result.stats = vars(writer.stats).copy()
        if bar is not None:
            bar.close()


# -- server ---------------------------------------------------------------------------


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
            prefix = _text_prefix(self.tokenizer, doc.text, full, max_length)
            return _Prepared(
                doc, doc.text if prefix is None else prefix, None, full[:max_length], True
            )
        assert doc.messages is not None  # a document is text or messages
        try:
            full = _render_ids(self.tokenizer, doc.messages)
        except Exception:  # noqa: BLE001 - no chat template here: the server's decides
            return _Prepared(doc, None, doc.messages, None, None)
        if len(full) <= max_length:
            return _Prepared(doc, None, doc.messages, None, False)
        cut = _messages_prefix(self.tokenizer, doc.messages, full, max_length)
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


def _collect_server(cfg: CollectConfig, result: CollectResult) -> None:
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
            bar = _progress(cfg)
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

            for batch in _batches(
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


class OutputLocked(RuntimeError):
    """Another ``collect`` run holds the output directory."""


@contextmanager
def lock_output(out: str | Path):
    """Hold ``OUT/.collect.lock`` (``fcntl.flock``, exclusive) while the block
    runs; :class:`OutputLocked` at once if another process (or another open of
    it here) holds it. The file stays (removing it would race a waiting run);
    the lock goes with the process."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise OutputLocked(
                f"{out} is in use: another `vllm-hidden-states collect` (pid {holder}) "
                f"holds it ({path}); two runs into one directory would delete each "
                "other's shards. Wait for that run to end, or give another output "
                "directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def collect(cfg: CollectConfig, llm=None) -> CollectResult:
    """Harvest ``cfg.dataset`` into ``cfg.out``; ``llm``: an already built
    ``vllm.LLM`` (with ``enable_hidden_states`` and the layers capturable) to
    use instead of building one from ``cfg.model``. Holds ``cfg.out`` for the
    whole run (:func:`lock_output`)."""
    cfg.check()
    if cfg.dtype not in STORAGE_DTYPES:
        raise ValueError(f"--dtype {cfg.dtype!r}: use one of {', '.join(STORAGE_DTYPES)}")
    if cfg.fmt not in FORMATS:
        raise ValueError(f"--format {cfg.fmt!r}: use one of {', '.join(FORMATS)}")
    result = CollectResult(out=str(cfg.out))
    with lock_output(cfg.out):
        if cfg.server_url is not None:
            _collect_server(cfg, result)
        else:
            _collect_offline(cfg, llm, result)
    return result


# -- command line ------------------------------------------------------------------


def _points(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated integers, e.g. -2 or 0,8,-1"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dataset", help="JSONL ({id, text|messages}), Parquet, or text (one prompt a line)"
    )
    p.add_argument("out", help="output directory (shards + manifest.json); rerun to resume")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model for the offline engine")
    src.add_argument("--server-url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", help="server mode: the model name (default: the first)")
    p.add_argument(
        "--tokenizer",
        help="server mode: tokenizer for token ids (default: the "
        "server's model root, else the server's /tokenize)",
    )
    p.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help="comma-separated (default -2, none with --points)",
    )
    p.add_argument(
        "--points",
        type=_points,
        default=[],
        help="capture points, comma-separated, e.g. attn_out.3,blocks.3.hook_mlp_out "
        "(offline: made capturable; server: started with --hidden-states-points)",
    )
    p.add_argument("--positions", choices=POSITIONS, default="prompt")
    p.add_argument(
        "--max-tokens", type=int, default=16, help="generated tokens with --positions all"
    )
    p.add_argument("--max-length", type=int, default=512, help="prompt tokens kept per document")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2, help="server mode: batches in flight")
    p.add_argument("--dtype", choices=STORAGE_DTYPES, default="float32", help="storage dtype")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="parquet")
    p.add_argument("--rows-per-shard", type=int, default=65536)
    p.add_argument(
        "--max-pending-mb",
        type=int,
        default=256,
        help="writer buffer; the engine waits only when it is full",
    )
    p.add_argument("--limit", type=int, help="stop after this many dataset records")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--max-model-len", type=int, help="offline engine: vLLM max_model_len")
    p.add_argument("--engine-dtype", help="offline engine: vLLM dtype (auto, float32, bfloat16...)")
    p.add_argument("--enforce-eager", action="store_true", help="offline engine: no torch.compile")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="offline engine: extra vllm.LLM argument, e.g. gpu_memory_utilization=0.5",
    )


def run(args: argparse.Namespace) -> int:
    engine_kwargs: dict[str, Any] = {}
    if args.max_model_len:
        engine_kwargs["max_model_len"] = args.max_model_len
    if args.engine_dtype:
        engine_kwargs["dtype"] = args.engine_dtype
    if args.enforce_eager:
        engine_kwargs["enforce_eager"] = True
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        try:
            engine_kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_kwargs[key] = value
    cfg = CollectConfig(
        dataset=args.dataset,
        out=args.out,
        model=args.model,
        server_url=args.server_url,
        served_model=args.served_model,
        tokenizer=args.tokenizer,
        layers=args.layers if args.layers is not None else ([] if args.points else [-2]),
        points=args.points,
        positions=args.positions,
        max_tokens=args.max_tokens,
        max_length=args.max_length,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        dtype=args.dtype,
        fmt=args.fmt,
        rows_per_shard=args.rows_per_shard,
        max_pending_mb=args.max_pending_mb,
        limit=args.limit,
        progress=not args.no_progress,
        engine_kwargs=engine_kwargs,
    )
    try:
        result = collect(cfg)
    except (ValueError, OutputLocked) as e:
        print(f"vllm-hidden-states collect: {e}", file=sys.stderr)
        return 2
    if result.refused:
        print(
            f"vllm-hidden-states collect: {result.refused} document(s) refused by the "
            f"server and skipped, listed in {Path(result.out) / REFUSED_FILE}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "out": result.out,
                "docs": result.docs,
                "skipped": result.skipped,
                "empty": result.empty,
                "truncated": result.truncated,
                "refused": result.refused,
                "tokens": result.tokens,
                "seconds": round(result.seconds, 3),
                "tokens_per_s": round(result.tokens_per_s, 1),
                "engine_waited_on_writer_s": round(result.producer_wait_s, 3),
            }
        )
    )
    return 0


# -- store query / prune ------------------------------------------------------------


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="store_command", required=True)
    q = sub.add_parser("query", help="query an activation store with DuckDB")
    q.add_argument("root", help="the store directory (--activation-store DIR)")
    qs = q.add_subparsers(dest="query", required=True)
    d = qs.add_parser("deltas", help="feature activations over the positions of one request")
    d.add_argument(
        "--request-id",
        required=True,
        help="the response's id (the `id` field: cmpl-..., chatcmpl-...)",
    )
    d.add_argument(
        "--choice-index",
        type=int,
        default=0,
        help="the choice's index in the response (default 0; n > 1 or several prompts have more)",
    )
    d.add_argument("--feature", type=int, action="append", help="only these feature ids")
    d.add_argument("--layer", type=int, help="only this SAE layer")
    t = qs.add_parser("threshold", help="requests where a feature reached a value")
    t.add_argument("--feature", type=int, required=True)
    t.add_argument("--min", dest="min_activation", type=float, required=True)
    t.add_argument("--model-id")
    s = qs.add_parser("sql", help="any SQL over the views sae_features and hidden_states")
    s.add_argument("sql")
    for sp in (d, t, s):
        sp.add_argument(
            "--format", dest="out_format", choices=["table", "csv", "json"], default="table"
        )
    pr = sub.add_parser("prune", help="delete partitions older than --days")
    pr.add_argument("root")
    pr.add_argument(
        "--days",
        type=int,
        default=None,
        help="retention in days (default: $VLLM_HIDDEN_STATES_STORE_RETENTION_DAYS or 14)",
    )


TABLE_MAX_ROWS = 1_000_000  # --format table; csv and json print every row


def _print_relation(rel, out_format: str) -> None:
    """A DuckDB relation on stdout: DuckDB's own table, JSON records or CSV."""
    if out_format == "table":
        rel.show(max_rows=TABLE_MAX_ROWS, max_width=10_000)
        return
    cols, rows = rel.columns, rel.fetchall()
    if out_format == "json":
        print(json.dumps([dict(zip(cols, r)) for r in rows], default=str))
    else:
        import csv

        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)


def run_store(args: argparse.Namespace) -> int:
    from vllm_hidden_states.store import activation_store as store

    if args.store_command == "prune":
        days = store.retention_days_from_env() if args.days is None else args.days
        for path in store.prune(args.root, days):
            print(f"deleted {path}")
        return 0
    if not Path(args.root).is_dir():
        print(f"vllm-hidden-states store: {args.root} is not a directory", file=sys.stderr)
        return 2
    if args.query == "deltas":
        cur = store.feature_deltas(
            args.root, args.request_id, args.feature, args.layer, choice_index=args.choice_index
        )
    elif args.query == "threshold":
        cur = store.threshold_search(
            args.root, args.feature, args.min_activation, model_id=args.model_id
        )
    else:
        cur = store.connect(args.root).sql(args.sql)
    _print_relation(cur, args.out_format)
    return 0
