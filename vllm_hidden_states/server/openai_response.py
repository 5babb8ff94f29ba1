# SPDX-License-Identifier: Apache-2.0
"""The response side of /v1/chat/completions and /v1/completions.

For a request that :func:`.openai_request.admit` admitted, vLLM's serving
code (patch ``0009-openai-serving``) hands this module its result iterator
(:func:`observe`: each choice's rows recorded, finished choices written to the
activation store), its SSE stream (:func:`stream`: rows on the chunk with a
choice's ``finish_reason``, or on every chunk with ``hidden_states_stream``)
and its non-streamed response (:func:`finish`); :func:`json_response_class`
writes those bodies with orjson. Each choice carries ``hidden_states``,
``neurons``, ``attention_patterns``, ``sae_features`` and ``probe_scores``
objects as asked
(encoded here per choice); their layout is told in docs/openai_server.md.
"""

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import orjson
from fastapi.responses import JSONResponse

from vllm_hidden_states.server import openai_request
from vllm_hidden_states.server.encoding import ORJSON_OPTIONS, dtype_name, encode_array
from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.openai_request import AdmittedAsk, HiddenStatesAsk
from vllm_hidden_states.store import choice_writer
from vllm_hidden_states.store.choice_writer import StoredChoice


def _concat(chunks: list[dict[int | str, Any]], ask: HiddenStatesAsk) -> dict[int | str, Any]:
    import torch

    if len(chunks) == 1:
        return chunks[0]
    return {k: torch.cat([c[k] for c in chunks]) for k in (*ask.keys, *ask.neurons)}


def encode_choice_states(
    states: dict[int | str, Any] | None, ask: HiddenStatesAsk, start: int = 0
) -> dict[str, Any] | None:
    """The ``hidden_states`` object of one choice (or of one streamed chunk).

    Args:
        states: ``CompletionOutput.hidden_states``: ``{layer as requested:
            [num_positions, hidden] tensor}``; the last row is the last token.
        ask: the request's layers (row order), positions and encoding.
        start: "all"/"prompt": the position of the first row.
    """
    if states is None:
        return None
    names: dict[str, Any] = {"layers": list(ask.layers)}
    if ask.points:
        names["points"] = list(ask.points)
    return _rows_object(states, ask.keys, names, ask, start)


def encode_choice_neurons(
    states: dict[int | str, Any] | None, ask: HiddenStatesAsk, start: int = 0
) -> dict[str, dict[str, Any]]:
    """The ``neurons`` and ``head_outputs`` objects of one choice (or
    streamed chunk), by name, those asked: MLP neurons (``mlp_post``, with
    ``intermediate_size`` values per row) and the heads' outputs (``attn_z``,
    ``heads * head_dim`` values per row, head ``h`` at columns ``h *
    head_dim`` onwards), each laid out like ``hidden_states``."""
    if states is None:
        return {}
    return {
        name: _rows_object(states, points, {"points": list(points)}, ask, start)
        for name, points in ask.wide_objects.items()
    }


def _rows_object(
    states: dict[int | str, Any],
    keys: tuple[int | str, ...],
    names: dict[str, Any],
    ask: HiddenStatesAsk,
    start: int,
) -> dict[str, Any]:
    """Rows of ``keys`` as one object: "last": ``[keys, width]``, else
    ``[keys, positions, width]`` from position ``start``; ``names`` first."""
    import torch

    out = dict(names)
    if ask.positions == "last":
        rows = torch.cat([states[k][-1:] for k in keys])  # [keys, width]
        out["positions"] = "last"
    else:
        rows = torch.stack([states[k] for k in keys])  # [keys, positions, width]
        out.update(positions=ask.positions_json, start=start)
    out["shape"] = list(rows.shape)
    out["dtype"] = dtype_name(rows.dtype)
    out["encoding_format"] = ask.encoding_format
    out["data"] = encode_array(rows, ask.encoding_format)
    return out


def encode_choice_patterns(
    states: dict[int | str, Any] | None, ask: HiddenStatesAsk, start: int = 0
) -> dict[str, Any] | None:
    """The ``attention_patterns`` object of one choice: ``[points, heads,
    queries, keys]`` float32, the query rows of the positions asked (from
    ``start``) over every key up to them."""
    if states is None:
        return None
    import torch

    rows = torch.stack([states[p] for p in ask.patterns])
    if ask.heads is not None:
        rows = rows[:, list(ask.heads)]
    if ask.positions == "last":
        start = rows.shape[-1] - 1  # the final position's row, over every key
    return {
        "points": list(ask.patterns),
        **({} if ask.heads is None else {"heads": list(ask.heads)}),
        "positions": ask.positions_json,
        "start": start,
        "shape": list(rows.shape),
        "dtype": dtype_name(rows.dtype),
        "encoding_format": ask.encoding_format,
        "data": encode_array(rows, ask.encoding_format),
    }


def encode_choice_features(
    parts: list[dict[str, Any]] | None, ask: HiddenStatesAsk, start: int = 0
) -> dict[str, Any] | None:
    """The ``sae_features`` object of one choice (or streamed chunk).

    Args:
        parts: ``CompletionOutput.sae_features`` of the outputs since the
            last chunk: ``{"layer", "ids" int32 [n, k], "values" float32 [n, k]}``.
        ask: the request (positions, top_k).
        start: "all"/"prompt": the position of the first row.
    """
    if not parts:
        return None
    import torch

    ids = torch.cat([p["ids"] for p in parts]) if len(parts) > 1 else parts[0]["ids"]
    values = torch.cat([p["values"] for p in parts]) if len(parts) > 1 else parts[0]["values"]
    if ask.positions == "last":
        ids, values = ids[-1:], values[-1:]
    reads = "point" if "point" in parts[0] else "layer"
    out: dict[str, Any] = {
        reads: parts[0][reads],
        "top_k": ask.sae_top_k,
        "positions": ask.positions_json,
    }
    if ask.positions != "last":
        out["start"] = start
    out["shape"] = list(ids.shape)
    out["ids"] = ids.numpy()
    out["values"] = values.numpy()
    return out


def encode_choice_scores(
    parts: list[dict[str, Any]] | None, ask: HiddenStatesAsk, start: int = 0
) -> dict[str, Any] | None:
    """The ``probe_scores`` object of one choice (or streamed chunk):
    ``{probe name: {"positions", "start" (not with "last"), "shape": [n, k],
    "dtype": "float32", "encoding_format", "data"}}``.

    Args:
        parts: ``CompletionOutput.probe_scores`` of the outputs since the
            last chunk: ``{name: float32 [n, k]}``.
        ask: the request (probes, positions, encoding).
        start: "all"/"prompt": the position of the first row.
    """
    if not parts:
        return None
    import torch

    out: dict[str, Any] = {}
    for name in ask.probes:
        scores = torch.cat([p[name] for p in parts]) if len(parts) > 1 else parts[0][name]
        entry: dict[str, Any] = {"positions": ask.positions_json}
        if ask.positions == "last":
            scores = scores[-1:]
        else:
            entry["start"] = start
        entry["shape"] = list(scores.shape)
        entry["dtype"] = "float32"
        entry["encoding_format"] = ask.encoding_format
        entry["data"] = encode_array(scores, ask.encoding_format)
        out[name] = entry
    return out


@dataclass
class ChoiceRows:
    """One choice's rows as the result iterator delivered them.

    ``pending`` holds the ``{layer: [rows, hidden]}`` deltas not yet written
    to a chunk (streamed "all"), or everything (otherwise); ``start`` is the
    position of the first pending row.
    """

    pending: list[dict[int | str, Any]] = field(default_factory=list)
    start: int = 0
    finished: bool = False
    # SAE features, the same way (CompletionOutput.sae_features deltas).
    features: list[dict[str, Any]] = field(default_factory=list)
    feature_start: int = 0
    # Probe scores, the same way (CompletionOutput.probe_scores deltas).
    scores: list[dict[str, Any]] = field(default_factory=list)
    score_start: int = 0
    # For the activation store (only when the server has one).
    stored: StoredChoice | None = None
    # A multimodal prompt's {modality: positions} (CompletionOutput.mm_positions).
    mm_positions: dict[str, list[int]] | None = None
    # Probe action firings not yet written (CompletionOutput.op_results).
    firings: list[Any] = field(default_factory=list)

    @property
    def owed(self) -> bool:
        return bool(self.pending or self.features or self.scores or self.firings)

    def take_firings(self) -> list[dict[str, Any]]:
        """The pending firings as the ``probe_actions`` list, emptied."""
        taken, self.firings = firings_json(self.firings), []
        return taken

    def take(self, ask: HiddenStatesAsk) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
        """The pending rows as the ``hidden_states`` object (None where not
        asked) and the ``neurons`` / ``head_outputs`` objects (by name, those
        asked), emptied."""
        if not self.pending:
            return None, {}
        states = _concat(self.pending, ask)
        hidden = encode_choice_states(states, ask, self.start) if ask.keys else None
        if hidden is not None and self.mm_positions:
            hidden["mm_positions"] = self.mm_positions
        neurons = encode_choice_neurons(states, ask, self.start) if ask.neurons else {}
        self.start += states[(*ask.keys, *ask.neurons)[0]].shape[0]
        self.pending = []
        return hidden, neurons

    def take_patterns(self, ask: HiddenStatesAsk) -> dict[str, Any] | None:
        """The attention patterns (on the final output's states) as an
        ``attention_patterns`` object; the rows stay pending for :meth:`take`."""
        final = next((p for p in reversed(self.pending) if ask.patterns[0] in p), None)
        obj = encode_choice_patterns(final, ask, self.start)
        if not (ask.keys or ask.neurons):
            self.pending = []
        return obj

    def take_features(self, ask: HiddenStatesAsk) -> dict[str, Any] | None:
        """The pending SAE features as a ``sae_features`` object, emptied."""
        if not self.features:
            return None
        obj = encode_choice_features(self.features, ask, self.feature_start)
        self.feature_start += sum(p["ids"].shape[0] for p in self.features)
        self.features = []
        return obj

    def take_scores(self, ask: HiddenStatesAsk) -> dict[str, Any] | None:
        """The pending probe scores as a ``probe_scores`` object, emptied."""
        if not self.scores:
            return None
        obj = encode_choice_scores(self.scores, ask, self.score_start)
        self.score_start += sum(p[ask.probes[0]].shape[0] for p in self.scores)
        self.scores = []
        return obj


def _choice_rows(
    choices: dict[int, ChoiceRows], index: int, res: Any, ask: HiddenStatesAsk
) -> ChoiceRows:
    """Choice ``index``'s rows, made on its first output: its first row is at
    the window's start ("generated": after the prompt)."""
    rows = choices.get(index)
    if rows is None:
        first = ask.first_position(len(res.prompt_token_ids or ()))
        rows = choices[index] = ChoiceRows(start=first, feature_start=first, score_start=first)
    return rows


def _collect(
    source: AsyncIterator[Any],
    index_of: Callable[[Any], tuple[Any, int]],
    reply: "HiddenStatesReply",
) -> AsyncGenerator[Any, None]:
    """Pass ``source`` through, recording each choice's rows (and SAE
    features) in ``reply.choices``; with an activation store, finished
    choices are stored.

    ``index_of(item)`` returns ``(RequestOutput, choice index offset)``; the
    choice index of an output is ``offset + output.index``.
    """
    choices, ask, admitted = reply.choices, reply.ask, reply.admitted
    store, store_hidden = choice_writer.opened()
    if not (ask.sae_top_k or ask.probes or (store_hidden and ask.keys)):
        store = None

    async def gen():
        try:
            async for item in source:
                res, offset = index_of(item)
                for output in res.outputs:
                    if store is not None:
                        rows = _choice_rows(choices, offset + output.index, res, ask)
                        if rows.stored is None:
                            rows.stored = StoredChoice.first(
                                res, offset + output.index, admitted.sae_name
                            )
                        rows.stored.track(output)
                    elif (
                        output.hidden_states is None
                        and output.sae_features is None
                        and output.probe_scores is None
                        and output.op_results is None
                        and output.finish_reason is None
                    ):
                        continue
                    rows = _choice_rows(choices, offset + output.index, res, ask)
                    if output.hidden_states is not None:
                        rows.pending.append(output.hidden_states)
                        rows.mm_positions = output.mm_positions or rows.mm_positions
                    if output.sae_features is not None:
                        rows.features.append(output.sae_features)
                    if output.probe_scores is not None:
                        rows.scores.append(output.probe_scores)
                    if output.op_results is not None:
                        rows.firings.extend(output.op_results.firings)
                    if output.finish_reason is not None:
                        rows.finished = True
                        if store is not None and rows.stored is not None:
                            rows.stored.append_to(
                                store,
                                ask,
                                admitted.request.model,
                                admitted.num_layers,
                                store_hidden,
                            )
                yield item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    return gen()


def _attach_to_chunk(chunk: str, choices: dict[int, ChoiceRows], ask: HiddenStatesAsk) -> str:
    """Add ``hidden_states`` to the choices of one SSE event that are owed
    rows: finishing choices, and with ``ask.stream`` every choice with rows
    pending (not on chat's role-only first chunk, which carries no token)."""
    if not chunk.startswith("data: {"):
        return chunk
    event = orjson.loads(chunk[6:])
    changed = False
    for choice in event.get("choices") or ():
        rows = choices.get(choice.get("index"))
        if rows is None or not rows.owed:
            continue
        if choice.get("finish_reason") is None:
            if not ask.stream or "role" in (choice.get("delta") or {}):
                continue
        elif not rows.finished:
            continue
        if ask.patterns:
            choice["attention_patterns"] = rows.take_patterns(ask)
        if ask.keys or ask.neurons:
            hidden, neurons = rows.take(ask)
            if ask.keys:
                choice["hidden_states"] = hidden
            choice.update(neurons)
        if ask.sae_top_k:
            choice["sae_features"] = rows.take_features(ask)
        if ask.probes:
            choice["probe_scores"] = rows.take_scores(ask)
        if ask.probe_actions and (rows.firings or rows.finished):
            choice["probe_actions"] = rows.take_firings()
        changed = True
    if not changed:
        return chunk
    return "data: " + orjson.dumps(event, option=ORJSON_OPTIONS).decode() + "\n\n"


async def _inject(
    inner: AsyncGenerator[str, None],
    choices: dict[int, ChoiceRows],
    ask: HiddenStatesAsk,
) -> AsyncGenerator[str, None]:
    try:
        async for chunk in inner:
            # Events are parsed only while some choice is owed rows: with
            # hidden_states_stream every token's event, otherwise only the
            # finish events.
            if choices and any(r.owed and (ask.stream or r.finished) for r in choices.values()):
                chunk = _attach_to_chunk(chunk, choices, ask)
            yield chunk
    finally:
        # A client that disconnects closes us; close the vLLM generator now so
        # it aborts the request instead of waiting for garbage collection.
        await inner.aclose()


def _final_states(rows: ChoiceRows | None, ask: HiddenStatesAsk) -> dict[int | str, Any] | None:
    """A non-streamed choice's states: its one final output's."""
    if rows is None or not rows.pending:
        return None
    return _concat(rows.pending, ask)


def _attach_to_choices(
    choices: list,
    states: list,
    ask: HiddenStatesAsk,
    features: list | None = None,
    starts: list[int] | None = None,
    scores: list | None = None,
) -> None:
    features = features or [None] * len(choices)
    starts = starts or [0] * len(choices)
    scores = scores or [None] * len(choices)
    for choice, choice_states, choice_features, start, choice_scores in zip(
        choices, states, features, starts, scores
    ):
        missing = (
            ((ask.keys or ask.patterns or ask.neurons) and choice_states is None)
            or (ask.sae_top_k and not choice_features)
            or (ask.probes and not choice_scores)
        )
        if missing and choice.finish_reason != "abort":
            raise ApiError(
                "the engine returned no hidden states for this request (see the server log)",
                status=HTTPStatus.INTERNAL_SERVER_ERROR,
                type="internal_error",
            )
        if ask.keys:
            choice.hidden_states = encode_choice_states(choice_states, ask, start)
        if ask.neurons:
            wide = encode_choice_neurons(choice_states, ask, start)
            if "neurons" in wide:
                choice.neurons = wide["neurons"]
            if "head_outputs" in wide:
                choice.head_outputs = wide["head_outputs"]
            if "queries" in wide:
                choice.queries = wide["queries"]
            if "keys" in wide:
                choice.keys = wide["keys"]
            if "values" in wide:
                choice.values = wide["values"]
        if ask.patterns:
            choice.attention_patterns = encode_choice_patterns(choice_states, ask, start)
        if ask.sae_top_k:
            choice.sae_features = encode_choice_features(choice_features, ask, start)
        if ask.probes:
            choice.probe_scores = encode_choice_scores(choice_scores, ask, start)


# --------------------------------------------------------------------------
# Call-outs from vLLM's serving code (patch 0009-openai-serving)


@dataclass
class HiddenStatesReply:
    """The answer owed to one admitted request: the rows each choice is owed,
    recorded by :func:`observe`'s iterator and written by :func:`stream` or
    :func:`finish`."""

    admitted: AdmittedAsk
    choices: dict[int, ChoiceRows] = field(default_factory=dict)

    @property
    def ask(self) -> HiddenStatesAsk:
        return self.admitted.ask


def _single(res: Any) -> tuple[Any, int]:
    # chat yields RequestOutput; its choices are numbered by output index.
    return res, 0


def _completion_index(choices_per_prompt: int) -> Callable[[Any], tuple[Any, int]]:
    # completions yield (prompt_idx, RequestOutput); vLLM numbers the choices
    # prompt_idx * n + output index.
    return lambda item: (item[1], item[0] * choices_per_prompt)


def observe(
    results: AsyncIterator[Any],
) -> tuple[AsyncIterator[Any], HiddenStatesReply | None]:
    """The result iterator to hand vLLM's generators (the same one when the
    request did not ask), and the reply that records its choices' rows."""
    admitted = openai_request.admitted()
    if admitted is None:
        return results, None
    reply = HiddenStatesReply(admitted)
    chat = hasattr(admitted.request, "messages")
    index_of = _single if chat else _completion_index(admitted.choices_per_prompt)
    return _collect(results, index_of, reply), reply


def stream(
    reply: HiddenStatesReply | None, chunks: AsyncGenerator[str, None]
) -> AsyncGenerator[str, None]:
    """vLLM's SSE chunks with each choice's rows on the chunks they are owed to."""
    if reply is None:
        return chunks
    return _inject(chunks, reply.choices, reply.ask)


def finish(reply: HiddenStatesReply | None, response: Any) -> Any:
    """A non-streamed response with each choice's ``hidden_states`` (and
    ``sae_features``); error responses pass through."""
    choices = getattr(response, "choices", None)
    if reply is None or choices is None:
        return response
    rows = [reply.choices.get(c.index) for c in choices]
    _attach_to_choices(
        choices,
        [_final_states(r, reply.ask) for r in rows],
        reply.ask,
        [r.features if r is not None else None for r in rows],
        [r.start if r is not None else 0 for r in rows],
        [r.scores if r is not None else None for r in rows],
    )
    for choice, r in zip(choices, rows):
        if reply.ask.probe_actions:
            choice.probe_actions = [] if r is None else r.take_firings()
        marked = getattr(choice, "hidden_states", None)
        if r is not None and r.mm_positions and isinstance(marked, dict):
            marked["mm_positions"] = r.mm_positions
    return response


def firings_json(firings: list[Any]) -> list[dict[str, Any]]:
    """Probe action firings (``ProbeFiring``) as the response lists them:
    ``{"probe", "position", "score", "then"}`` each, in position order."""
    return [
        {"probe": f.label, "position": f.position, "score": f.score, "then": f.then}
        for f in firings
        if not f.monitor  # a server monitor's stay with the server
    ]


def json_response_class(default: type) -> type:
    """The response class for a non-streamed chat/completions body: one that
    writes hidden states with orjson (numpy arrays natively) when this request
    asked for them, else ``default`` (vLLM's ``JSONResponse``)."""
    if openai_request.admitted() is None:
        return default
    return CapturedJSONResponse


class CapturedJSONResponse(JSONResponse):
    """``JSONResponse`` rendered by orjson with :data:`ORJSON_OPTIONS` (FastAPI's
    ``ORJSONResponse`` does the same but is deprecated in the pinned FastAPI)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=ORJSON_OPTIONS)
