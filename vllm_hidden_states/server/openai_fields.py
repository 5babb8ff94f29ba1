# SPDX-License-Identifier: Apache-2.0
"""Hidden states and steering on /v1/chat/completions and /v1/completions.

vLLM's serving code calls this module at named sites (patch
``0009-openai-serving``, one line each); nothing of vLLM's is replaced.

Request fields (OpenAI extras; ``OpenAIBaseModel`` keeps unknown fields in
``model_extra``)::

    return_hidden_states: bool            # default false
    hidden_states_layers: list[int]       # default [-1]; HF convention
    hidden_states_points: list[str]       # e.g. ["attn_out.3"]; default none
    hidden_states_positions: "last" | "all" | "prompt"   # default "last"
    hidden_states_format: "float" | "base64"   # default "float"
    hidden_states_stream: bool            # default false; "all" + stream only
    hidden_states_heads: list[int]        # attention patterns: these query heads only

Each choice of such a request then carries one ``hidden_states`` object:

* ``"last"``: the state of the last token of prompt + that choice's
  ``token_ids``, one row per requested layer, in request order::

      {"layers": [-1, 2], "positions": "last", "shape": [2, hidden_size],
       "dtype": "float32", "encoding_format": "float", "data": [[...], [...]]}

* ``"all"``: every position of prompt + output, ``"shape": [len(layers),
  num_positions, hidden_size]`` and ``"start": 0`` (the first position's
  index); ``"prompt"``: every prompt position, the same layout.

When streaming (``stream: true``), the object is on the chunk that carries
that choice's ``finish_reason``, once. With ``hidden_states_stream: true``
("all" only) it is on every chunk instead, carrying the rows of the positions
computed since the previous chunk: ``start`` says where they begin, and once
a chunk is out the client holds the rows of every position before that
chunk's last token; the chunk with ``finish_reason`` adds the rest, the final
token's row included. Concatenated over ``start``, the rows equal the
non-streamed "all" result bit for bit.

The call-outs, in the order a request meets them (vLLM 0.32.0):

* :func:`admit`, first in ``OpenAIServingChat.create_chat_completion`` and
  ``OpenAIServingCompletion.create_completion``: parse the fields once, check
  them against the engine and price the response (:mod:`.admission`) before
  anything is tokenized, so a bad request is a 400 even when streaming;
* :func:`price`, right after ``get_max_tokens`` sizes each prompt: prices
  "all"/"prompt" responses exactly, before anything is generated;
* :func:`ask_engine`, right after ``to_sampling_params``: the fields onto
  ``SamplingParams``;
* :func:`observe`, on the result iterator: records each choice's rows;
* :func:`stream` around the stream generator (rows on the finish chunk of
  each choice, or on every chunk with ``hidden_states_stream``), and
  :func:`finish` on the non-streamed response;
* :func:`json_response_class` in the two api_routers: orjson for bodies
  carrying hidden states (numpy arrays natively), vLLM's ``JSONResponse``
  for every other;
* :func:`refuse`, first in the handlers of /v1/responses, /v1/messages and
  /v1/chat/completions/batch: a 400 naming the field (``steering`` included).

**Steering** (server started with ``--enable-steering``): ``"steering": [
{"point": "resid_pre.3", "op": "add", "vector": [...] | "name": "honesty",
"strength": 4, "positions": "all"}, ...]`` writes interventions into the
residual stream of the request's forward passes (the contract:
:mod:`vllm_hidden_states.steering_fields`; the vectors of ``--steering-vectors``
are listed at GET /v1/steering_vectors). It needs no
``return_hidden_states``; with it, the states returned are the steered ones.
:func:`admit` checks the list against the engine with the rules of the
Python API (400, ``param: "steering"``; on an engine without steering, a
400 naming ``--enable-steering``), except the positions windows, which need
the prompt's length: the engine front-end checks them (its
``VLLMValidationError`` is a 400 through vLLM's exception handler) and,
for streamed requests, whose 200 is sent before the front-end runs,
:func:`price` checks them first. :func:`ask_engine` copies the list as given
onto ``SamplingParams.steering`` (the front-end resolves it). Inline
vectors are bounded by the request bounds (:mod:`.bounds`: the body size,
``--request-max-body-mb``, and the items per list) before the body is
parsed; admission has no request-size limit of its own.

**SAE features** (server started with ``--sae DIR``): ``"sae_features":
{"top_k": k}`` asks for the SAE's ``k`` strongest features at the positions
``hidden_states_positions`` names (``return_hidden_states`` is then
optional). Each choice carries ``"sae_features": {"layer", "top_k",
"positions", "start" (not for "last"), "shape": [positions, k], "ids",
"values"}`` (ids -1 / values 0 where fewer than k features are active), on
the same chunks as ``hidden_states`` would be. Full ``hidden_states`` come
with it only when ``hidden_states_layers`` is given.

**Activation store** (``--activation-store DIR``): each finished choice that
carried SAE features (and, with ``--activation-store-hidden-states``, hidden
states) is appended to the store off the serving path
(:class:`vllm_hidden_states.store.activation_store.ActivationStore`, one per
API-server process, closed at exit); a failing store is logged, never an
error for the request.

Requests that ask for neither pay two ``dict`` lookups in :func:`admit` and a
context-variable read (two in :func:`price` and :func:`ask_engine`) at each
other call-out.
"""

import contextvars
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import orjson
from fastapi.responses import JSONResponse

from vllm.logger import init_logger
from vllm_hidden_states.points import (
    Positions,
    Window,
    is_neuron_address,
    is_pattern_address,
    parse_point,
)
from vllm_hidden_states.request_fields import (
    REQUEST_FIELDS,
    SAE_HINT,
    check_layers,
    check_points,
    check_positions,
    check_sae_features,
    window_problem,
)
from vllm_hidden_states.server.encoding import (
    ENCODING_FORMATS,
    ORJSON_OPTIONS,
    ApiError,
    dtype_name,
    encode_array,
    invalid_request,
)
from vllm_hidden_states.server.validation import (
    STEERING_PARAM,
    validate_layers,
    validate_points,
    validate_steering,
)

logger = init_logger(__name__)


@dataclass(frozen=True)
class HiddenStatesAsk:
    """What a chat/completions request asked for (already type-checked)."""

    layers: tuple[int, ...]
    encoding_format: str
    positions: "Positions | Window" = "last"
    stream: bool = False  # rows on every SSE chunk ("all", "generated", windows)
    sae_top_k: int = 0  # sae_features: {"top_k": k}; 0 = not asked
    points: tuple[str, ...] = ()  # hidden_states_points, as given (rows)
    patterns: tuple[str, ...] = ()  # hidden_states_points of attention patterns
    neurons: tuple[str, ...] = ()  # hidden_states_points of MLP neurons (mlp_post)
    heads: tuple[int, ...] | None = None  # hidden_states_heads; None = every head

    @property
    def positions_json(self) -> Any:
        """``positions`` as the response names it."""
        return self.positions.as_json() if isinstance(self.positions, Window) else self.positions

    @property
    def every_position(self) -> bool:
        """Rows of every position asked ("all", "generated", a window), not
        one ("last") nor the prompt's only."""
        return self.positions not in ("last", "prompt")

    def first_position(self, prompt_len: int) -> int:
        """The position of a choice's first row."""
        if isinstance(self.positions, Window):
            return self.positions.start
        return prompt_len if self.positions == "generated" else 0

    @property
    def keys(self) -> tuple[int | str, ...]:
        """The rows of ``hidden_states``, in order: the layers, then the points."""
        return (*self.layers, *self.points)


def parse_sae_features(value: Any, d_sae: int | None = None) -> int:
    """``k`` of ``sae_features: {"top_k": k}``; 400 naming what is allowed.
    The engine SAE's ``d_sae`` bound is checked when given (by
    :func:`validate_ask`, which knows the engine)."""
    try:
        return check_sae_features(value, d_sae)
    except ValueError as e:
        raise invalid_request(str(e), "sae_features") from None


def _refuse_without_flag(extra: dict[str, Any]) -> None:
    for name in REQUEST_FIELDS[1:-1]:
        if extra.get(name) not in (None, False):
            raise invalid_request(
                f"{name} was given but return_hidden_states is not true; "
                "set return_hidden_states: true to receive hidden states",
                name,
            )


def _one_of(extra: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    """``extra[name]``, one of ``allowed`` (the first when absent or null)."""
    value = extra.get(name)
    if value is None:
        return allowed[0]
    if value not in allowed:
        raise invalid_request(f"{name} must be one of {list(allowed)}, got {value!r}", name)
    return value


def parse_ask(extra: dict[str, Any] | None) -> HiddenStatesAsk | None:
    """The request's hidden-state fields; None when it did not ask.

    Raises :class:`ApiError` (400) for malformed fields. Whether the layers
    exist on this engine is checked by :func:`validate_ask`.
    """
    if not extra or all(extra.get(f) is None for f in REQUEST_FIELDS):
        return None
    flag = extra.get("return_hidden_states")
    if flag is not None and not isinstance(flag, bool):
        raise invalid_request(
            f"return_hidden_states must be true or false, got {flag!r}",
            "return_hidden_states",
        )
    sae_top_k = 0
    if extra.get("sae_features") is not None:
        sae_top_k = parse_sae_features(extra["sae_features"])
        if flag is False:
            raise invalid_request(
                "sae_features needs hidden states captured; drop "
                "return_hidden_states: false (sae_features alone is enough)",
                "return_hidden_states",
            )
    elif not flag:
        _refuse_without_flag(extra)
        return None
    try:
        points = check_points(extra.get("hidden_states_points"))
    except ValueError as e:
        raise invalid_request(str(e), "hidden_states_points") from None
    try:
        # With sae_features or points, full states only for the layers named.
        layers = check_layers(
            extra.get("hidden_states_layers"), features_only=bool(sae_top_k), points=bool(points)
        )
    except ValueError as e:
        raise invalid_request(str(e), "hidden_states_layers") from None
    fmt = _one_of(extra, "hidden_states_format", ENCODING_FORMATS)
    try:
        positions = check_positions(
            "last"
            if extra.get("hidden_states_positions") is None
            else extra["hidden_states_positions"]
        )
    except ValueError as e:
        raise invalid_request(str(e), "hidden_states_positions") from None
    stream = extra.get("hidden_states_stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise invalid_request(
            f"hidden_states_stream must be true or false, got {stream!r}",
            "hidden_states_stream",
        )
    if stream and positions in ("last", "prompt"):
        raise invalid_request(
            "hidden_states_stream streams the rows of every position as they "
            "are computed, so it needs hidden_states_positions 'all', "
            f"'generated' or a window (got {positions!r})",
            "hidden_states_stream",
        )
    patterns = tuple(p for p in points if is_pattern_address(p))
    if patterns and stream:
        raise invalid_request(
            "attention patterns come once, on the finish chunk: drop "
            "hidden_states_stream, or ask for the patterns in a separate request",
            "hidden_states_stream",
        )
    heads = extra.get("hidden_states_heads")
    if heads is not None:
        if (
            not isinstance(heads, list)
            or not heads
            or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in heads)
            or len(set(heads)) != len(heads)
        ):
            raise invalid_request(
                "hidden_states_heads must be a non-empty list of distinct query-head "
                f"indices (integers >= 0), got {heads!r}",
                "hidden_states_heads",
            )
        if not patterns:
            raise invalid_request(
                "hidden_states_heads selects the query heads of attention patterns; "
                "ask for one in hidden_states_points (e.g. 'attn_pattern.3')",
                "hidden_states_heads",
            )
    neurons = tuple(p for p in points if is_neuron_address(p))
    return HiddenStatesAsk(
        tuple(layers),
        fmt,
        positions,
        stream,
        sae_top_k,
        points=tuple(p for p in points if p not in patterns and p not in neurons),
        patterns=patterns,
        neurons=neurons,
        heads=None if heads is None else tuple(heads),
    )


def ask_of(request: Any) -> HiddenStatesAsk | None:
    """:func:`parse_ask` on a vLLM OpenAI request model's extra fields."""
    return parse_ask(request.model_extra)


def validate_ask(serving: Any, request: Any, raw_request: Any = None) -> HiddenStatesAsk | None:
    """Parse, check and price a chat/completions request against the engine,
    before anything is tokenized or generated (see :mod:`.admission`)."""
    ask = ask_of(request)
    if ask is None:
        return None
    engine_client = serving.engine_client
    global _num_layers
    if not _num_layers:
        from vllm_hidden_states.server.validation import engine_config

        cfg = engine_config(engine_client)
        _num_layers = 0 if cfg is None else cfg.num_layers
    if ask.sae_top_k:
        from vllm_hidden_states.server.validation import engine_config

        cfg = engine_config(engine_client)
        if cfg is None or cfg.sae is None:
            raise invalid_request(
                f"sae_features needs an SAE on this server; {SAE_HINT}", "sae_features"
            )
        global _sae_name
        _sae_name = cfg.sae["name"]
        parse_sae_features(request.model_extra["sae_features"], cfg.sae["d_sae"])
    if ask.layers or not (ask.sae_top_k or ask.points):
        validate_layers(engine_client, ask.layers, "hidden_states_layers")
    if ask.points or ask.patterns or ask.neurons:
        validate_points(engine_client, (*ask.points, *ask.patterns, *ask.neurons))
    if ask.heads is not None:
        num_heads = int(engine_client.model_config.hf_text_config.num_attention_heads)
        if max(ask.heads) >= num_heads:
            raise invalid_request(
                f"hidden_states_heads {list(ask.heads)}: this model has {num_heads} "
                f"query heads (0..{num_heads - 1})",
                "hidden_states_heads",
            )
    if getattr(request, "use_beam_search", False):
        raise invalid_request(
            "return_hidden_states is not supported with use_beam_search",
            "use_beam_search",
        )
    if ask.stream and not getattr(request, "stream", False):
        raise invalid_request(
            "hidden_states_stream puts rows on the chunks of a streamed "
            "response; set stream: true, or drop hidden_states_stream to get "
            "every position on the response",
            "hidden_states_stream",
        )
    from vllm_hidden_states.server import admission

    limits = admission.limits_of(raw_request)
    n = getattr(request, "n", None) or 1
    if hasattr(request, "messages"):
        source, prompts = "messages", 1
    else:
        source = "prompt"
        prompt = getattr(request, "prompt", None)
        prompts = (
            len(prompt)
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            else 1
        )
    value = getattr(request, source, None)
    admission.check_input_chars(limits, admission.text_chars(value, limits.max_input_chars), source)
    results = prompts * n
    admission.check_batch(limits, results, "n", "choices (prompts x n)")
    # "last": one position per result, exact. "all"/"prompt": at least one
    # (a lower bound); the exact price follows tokenization (_priced_max_tokens).
    admission.check_response(
        limits,
        results,
        1,
        len(ask.keys),
        engine_client.model_config.get_hidden_size(),
        ask.encoding_format,
        "hidden_states_layers",
        "ask for fewer layers or choices or a smaller top_k, or use hidden_states_format 'base64'",
        sae_top_k=ask.sae_top_k,
    )
    return ask


@dataclass
class PositionPricing:
    """The response budget of one "all"/"prompt" request, spent per prompt as
    vLLM sizes each (``get_max_tokens``, right after tokenization)."""

    limits: Any  # admission.Limits
    ask: HiddenStatesAsk
    n: int
    hidden_size: int
    spent_positions: int = 0
    heads: int = 0  # query heads: an attention pattern is [heads, queries, keys]
    intermediate: int = 0  # an mlp_post row's width
    spent_extra_values: int = 0  # attention-pattern weights and MLP neurons


def price_positions(pricing: PositionPricing, prompt_len: int, max_tokens: int) -> None:
    """Add one prompt's positions (x n choices) to the request's price; 400 when
    the whole response would pass the cap."""
    from vllm_hidden_states.server import admission

    positions = pricing.ask.positions
    if isinstance(positions, Window):
        problem = window_problem(positions, prompt_len, prompt_len + max_tokens)
        if problem is not None:
            raise invalid_request(problem, "hidden_states_positions")
    if positions == "last":
        per_choice = 1
    elif positions == "prompt":
        per_choice = prompt_len
    elif positions == "generated":
        per_choice = max_tokens
    elif isinstance(positions, Window):
        reach = prompt_len + max_tokens
        per_choice = max(min(reach, positions.end or reach) - positions.start, 0)
    else:
        per_choice = prompt_len + max_tokens
    pricing.spent_positions += pricing.n * per_choice
    if pricing.ask.neurons:
        pricing.spent_extra_values += (
            pricing.n * per_choice * len(pricing.ask.neurons) * pricing.intermediate
        )
    if pricing.ask.patterns:
        # [heads, queries, keys] per pattern point, keys up to the whole sequence.
        keys = prompt_len + max_tokens
        pricing.spent_extra_values += (
            pricing.n
            * len(pricing.ask.patterns)
            * (pricing.heads if pricing.ask.heads is None else len(pricing.ask.heads))
            * per_choice
            * keys
        )
    admission.check_response(
        pricing.limits,
        1,
        pricing.spent_positions,
        len(pricing.ask.keys),
        pricing.hidden_size,
        pricing.ask.encoding_format,
        "max_tokens",
        f"positions are priced at prompt tokens + max_tokens ({prompt_len} + "
        f"{max_tokens} here) per choice; lower max_tokens, ask for fewer layers "
        "or choices or a smaller top_k, use hidden_states_format 'base64', or "
        "raise the cap",
        sae_top_k=pricing.ask.sae_top_k,
        pattern_values=pricing.spent_extra_values,
    )


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
) -> dict[str, Any] | None:
    """The ``neurons`` object of one choice (or streamed chunk): MLP neurons
    (``mlp_post``), laid out like ``hidden_states`` with ``intermediate_size``
    values per row."""
    if states is None:
        return None
    return _rows_object(states, ask.neurons, {"points": list(ask.neurons)}, ask, start)


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


# --------------------------------------------------------------------------
# Activation store (--activation-store): one per API-server process.

_store: Any = None  # ActivationStore, or False when the server has none
_store_hidden = False
_sae_name = ""  # the engine's SAE (its directory name), the store's sae_release
_num_layers = 0  # the engine's L, to name points canonically in the store


def store_of(raw_request: Any) -> Any:
    """The process's activation store (built on first use from the app's
    ``--activation-store*`` args), or None. Never raises."""
    global _store, _store_hidden
    if _store is None and raw_request is not None:
        args = getattr(getattr(getattr(raw_request, "app", None), "state", None), "args", None)
        root = getattr(args, "activation_store", None)
        if not root:
            _store = False
        else:
            try:
                import atexit

                from vllm_hidden_states.store.activation_store import ActivationStore

                _store = ActivationStore(
                    root,
                    retention_days=getattr(args, "activation_store_retention_days", None),
                )
                _store_hidden = bool(getattr(args, "activation_store_hidden_states", False))
                atexit.register(_store.close, 10.0)
                logger.info(
                    "vllm-hidden-states: activation store at %s (hidden states: %s)",
                    root,
                    _store_hidden,
                )
            except Exception as e:  # noqa: BLE001 - serve without a store
                logger.warning("vllm-hidden-states: activation store %s unavailable: %s", root, e)
                _store = False
    return _store or None


def point_layer(address: str) -> int:
    """The decoder layer of a point address the engine accepted (absolute;
    the SAE's point comes from its hook name)."""
    assert _num_layers, "points are stored only after validate_ask saw the engine"
    return parse_point(address, _num_layers)[1]


def _canonical(states: dict[int | str, Any]) -> dict[int | str, Any]:
    """Point addresses as ``"kind.i"`` with ``i`` absolute, for the store."""
    out: dict[int | str, Any] = {}
    for key, rows in states.items():
        if isinstance(key, str):
            kind, layer = parse_point(key, _num_layers)
            key = f"{kind}.{layer}"
        out[key] = rows
    return out


def _store_choice(store: Any, rows: "ChoiceRows", ask: HiddenStatesAsk, model: str) -> None:
    """Append one finished choice's features (and opted-in states). Never raises."""
    try:
        import numpy as np
        import torch

        tokens = np.asarray(rows.prompt_ids + rows.output_ids, dtype=np.int64)
        n_prompt = len(rows.prompt_ids)
        if ask.positions == "last":
            positions = np.arange(len(tokens) - 1, len(tokens))
        elif ask.positions == "prompt":
            positions = np.arange(n_prompt)
        else:
            end = ask.positions.end if isinstance(ask.positions, Window) else None
            stop = len(tokens) if end is None else min(end, len(tokens))
            positions = np.arange(min(ask.first_position(n_prompt), stop), stop)
        if rows.stored_features:
            parts = rows.stored_features
            ids = torch.cat([p["ids"] for p in parts])[-len(positions) :]
            values = torch.cat([p["values"] for p in parts])[-len(positions) :]
            if ids.shape[0] == len(positions):
                point = parts[0].get("point")
                store.append_sae_features(
                    rows.request_id,
                    model_id=model,
                    sae_release=rows.sae_name,
                    sae_layer=parts[0]["layer"] if point is None else point_layer(point),
                    sae_point=point,
                    token_ids=tokens[positions],
                    feature_ids=ids.numpy(),
                    values=values.numpy(),
                    prompt_len=n_prompt,
                    positions=positions,
                    choice_index=rows.choice_index,
                )
        if _store_hidden and rows.stored_states and ask.keys:
            states = _canonical(_concat(rows.stored_states, ask))
            n = next(iter(states.values())).shape[0]
            store.append_hidden_states(
                rows.request_id,
                model_id=model,
                token_ids=tokens[positions[-n:]],
                states={k: v[-n:] for k, v in states.items()},
                prompt_len=n_prompt,
                positions=positions[-n:],
                choice_index=rows.choice_index,
            )
    except Exception as e:  # noqa: BLE001 - never fail the request
        logger.warning("activation store: request %s not stored: %s", rows.request_id, e)


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
    # For the activation store (only filled when the server has one).
    request_id: str = ""  # the response's id
    choice_index: int = 0  # the choice's index in the response
    sae_name: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stored_features: list[dict[str, Any]] = field(default_factory=list)
    stored_states: list[dict[int | str, Any]] = field(default_factory=list)

    @property
    def owed(self) -> bool:
        return bool(self.pending or self.features)

    def take(self, ask: HiddenStatesAsk) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The pending rows as the ``hidden_states`` and ``neurons`` objects
        (None where not asked), emptied."""
        if not self.pending:
            return None, None
        states = _concat(self.pending, ask)
        hidden = encode_choice_states(states, ask, self.start) if ask.keys else None
        neurons = encode_choice_neurons(states, ask, self.start) if ask.neurons else None
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


def _choice_rows(
    choices: dict[int, ChoiceRows], index: int, res: Any, ask: HiddenStatesAsk
) -> ChoiceRows:
    """Choice ``index``'s rows, made on its first output: its first row is at
    the window's start ("generated": after the prompt)."""
    rows = choices.get(index)
    if rows is None:
        first = ask.first_position(len(res.prompt_token_ids or ()))
        rows = choices[index] = ChoiceRows(start=first, feature_start=first)
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
    choices, ask = reply.choices, reply.ask
    store = _store or None
    if not (ask.sae_top_k or (_store_hidden and ask.keys)):
        store = None

    async def gen():
        try:
            async for item in source:
                res, offset = index_of(item)
                for output in res.outputs:
                    if store is not None:
                        rows = _choice_rows(choices, offset + output.index, res, ask)
                        _track_for_store(rows, res, output, offset + output.index)
                    elif (
                        output.hidden_states is None
                        and output.sae_features is None
                        and output.finish_reason is None
                    ):
                        continue
                    rows = _choice_rows(choices, offset + output.index, res, ask)
                    if output.hidden_states is not None:
                        rows.pending.append(output.hidden_states)
                    if output.sae_features is not None:
                        rows.features.append(output.sae_features)
                    if output.finish_reason is not None:
                        rows.finished = True
                        if store is not None:
                            _store_choice(store, rows, ask, reply.request.model)
                yield item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    return gen()


def _response_id(engine_request_id: str) -> str:
    """The response's ``id`` from the engine request id of one of its
    prompts: vLLM 0.32's completions serving runs prompt ``i`` of response
    ``cmpl-<id>`` as ``cmpl-<id>-<i>``; chat runs its one prompt under the
    response's own ``chatcmpl-<id>``."""
    if engine_request_id.startswith("cmpl-"):
        return engine_request_id.rsplit("-", 1)[0]
    return engine_request_id


def _track_for_store(rows: ChoiceRows, res: Any, output: Any, choice_index: int) -> None:
    """Token ids, features and states of a choice, for the store (the result
    iterator yields deltas when streaming, cumulative outputs otherwise).
    Stored under the response's id and the choice's index in it."""
    if not rows.request_id:
        rows.request_id = _response_id(res.request_id)
        rows.choice_index = choice_index
        rows.prompt_ids = list(res.prompt_token_ids or ())
        rows.sae_name = _sae_name
    # The server streams DELTA outputs and otherwise yields one final output
    # (FINAL_ONLY): appending is right for both.
    rows.output_ids += output.token_ids
    if output.sae_features is not None:
        rows.stored_features.append(output.sae_features)
    if output.hidden_states is not None:
        rows.stored_states.append(output.hidden_states)


def _single(res: Any) -> tuple[Any, int]:
    return res, 0


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
            if ask.neurons:
                choice["neurons"] = neurons
        if ask.sae_top_k:
            choice["sae_features"] = rows.take_features(ask)
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
) -> None:
    features = features or [None] * len(choices)
    starts = starts or [0] * len(choices)
    for choice, choice_states, choice_features, start in zip(choices, states, features, starts):
        missing = ((ask.keys or ask.patterns or ask.neurons) and choice_states is None) or (
            ask.sae_top_k and not choice_features
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
            choice.neurons = encode_choice_neurons(choice_states, ask, start)
        if ask.patterns:
            choice.attention_patterns = encode_choice_patterns(choice_states, ask, start)
        if ask.sae_top_k:
            choice.sae_features = encode_choice_features(choice_features, ask, start)


# --------------------------------------------------------------------------
# Steering (the ``steering`` field; no hidden states needed)

# What the routes that cannot serve them refuse (:func:`refuse`): the
# captured-data fields and steering (which asks for no captured data).
REFUSED_FIELDS: tuple[str, ...] = (*REQUEST_FIELDS, STEERING_PARAM)


@dataclass(frozen=True)
class SteeringAsk:
    """A chat/completions request's ``steering``, checked by :func:`admit`."""

    interventions: list[dict[str, Any]]  # as the request gave them
    stream: bool  # the request streams (its windows are checked in price)
    windows: tuple[tuple[int, Window], ...] = ()  # (intervention, its window)


def admit_steering(serving: Any, request: Any) -> SteeringAsk | None:
    """The request's ``steering`` checked against the engine (None when not
    given); :class:`ApiError` (400) naming what is allowed."""
    value = request.model_extra.get(STEERING_PARAM)
    if value is None:
        return None
    validate_steering(serving.engine_client, value)
    if getattr(request, "use_beam_search", False):
        raise invalid_request(
            "steering is not supported with use_beam_search; drop one of them",
            "use_beam_search",
        )
    windows: list[tuple[int, Window]] = []
    for i, item in enumerate(value):
        if isinstance(item.get("positions"), dict):
            window = check_positions(item["positions"])  # well-formed: checked above
            assert isinstance(window, Window)
            windows.append((i, window))
    return SteeringAsk(list(value), bool(getattr(request, "stream", False)), tuple(windows))


def steering_window_problem(
    steering: SteeringAsk, prompt_len: int, max_tokens: int
) -> ApiError | None:
    """The 400 for the first steering window that does not fit a prompt of
    ``prompt_len`` tokens and ``max_tokens`` (the message the engine front-end
    would give), or None."""
    for i, window in steering.windows:
        problem = window_problem(window, prompt_len, prompt_len + max_tokens)
        if problem is not None:
            return invalid_request(f"steering[{i}].positions: {problem}", STEERING_PARAM)
    return None


_steering: contextvars.ContextVar[SteeringAsk | None] = contextvars.ContextVar(
    "steering_ask", default=None
)


# --------------------------------------------------------------------------
# Call-outs from vLLM's serving code (patch 0009-openai-serving). Each is one
# line at its site; requests that asked for neither captured data nor
# steering pay two dict lookups in ``admit`` and context-variable reads at
# the others.


@dataclass
class HiddenStatesReply:
    """One chat/completions request that asked for captured data: what it
    asked, parsed once by :func:`admit`, and the rows its choices are owed.

    Lives in a context variable from :func:`admit` (the first line of
    ``create_chat_completion`` / ``create_completion``) through the rest of
    that handler; :func:`observe` hands it to the two sites that write the
    answer (:func:`stream`, :func:`finish`).
    """

    ask: HiddenStatesAsk
    request: Any  # vLLM's ChatCompletionRequest / CompletionRequest
    choices_per_prompt: int  # the request's n
    pricing: PositionPricing | None  # "all"/"prompt": the response budget
    choices: dict[int, ChoiceRows] = field(default_factory=dict)


_reply: contextvars.ContextVar[HiddenStatesReply | None] = contextvars.ContextVar(
    "hidden_states_reply", default=None
)


def admit(serving: Any, request: Any, raw_request: Any) -> Any:
    """Parse, check and price the request's fields before anything is
    tokenized or generated; vLLM's ``ErrorResponse`` (400/413) to return, or
    None to go on. Called first in ``create_chat_completion`` and
    ``create_completion``."""
    extra = request.model_extra
    if not extra or not (STEERING_PARAM in extra or any(f in extra for f in REQUEST_FIELDS)):
        if _reply.get() is not None:
            _reply.set(None)
        if _steering.get() is not None:
            _steering.set(None)
        return None
    try:
        steering = admit_steering(serving, request)
        ask = validate_ask(serving, request, raw_request)
    except ApiError as e:
        return e.to_error_response()
    _steering.set(steering)
    if ask is None:
        _reply.set(None)
        return None
    if _store is None:
        store_of(raw_request)
    n = getattr(request, "n", None) or 1
    pricing = None
    if ask.positions != "last" or ask.patterns or ask.neurons:
        from vllm_hidden_states.server import admission

        model_config = serving.engine_client.model_config
        pricing = PositionPricing(
            admission.limits_of(raw_request),
            ask,
            n,
            model_config.get_hidden_size(),
            heads=int(model_config.hf_text_config.num_attention_heads),
            intermediate=int(getattr(model_config.hf_text_config, "intermediate_size", 0) or 0),
        )
    _reply.set(HiddenStatesReply(ask, request, n, pricing))
    return None


def price(prompt_len: int, max_tokens: int) -> Any:
    """Add one prompt's positions to an "all"/"prompt" request's price, where
    vLLM has just sized it (``get_max_tokens``); ``ErrorResponse`` (400) when
    the whole response would pass the cap, or when a streamed request's
    steering window does not fit this prompt, else None."""
    steering = _steering.get()
    if steering is not None and steering.stream and steering.windows:
        problem = steering_window_problem(steering, prompt_len, max_tokens)
        if problem is not None:
            return problem.to_error_response()
    reply = _reply.get()
    if reply is None or reply.pricing is None:
        return None
    try:
        price_positions(reply.pricing, prompt_len, max_tokens)
    except ApiError as e:
        return e.to_error_response()
    return None


def ask_engine(params: Any) -> None:
    """Copy what the request asked onto its ``SamplingParams`` (right after
    ``to_sampling_params``), in the engine's terms: steering (asked with or
    without hidden states) and the hidden-state fields."""
    steering = _steering.get()
    if steering is not None:
        # As given (the front-end resolves it into the wire form on its own
        # clone); one list per SamplingParams (completions: one per prompt).
        params.steering = [dict(item) for item in steering.interventions]
    reply = _reply.get()
    if reply is None:
        return
    ask, extra = reply.ask, reply.request.model_extra
    params.return_hidden_states = True
    params.sae_features = extra.get("sae_features")
    # With sae_features alone, no full states (None: the engine's "no layers").
    params.hidden_states_layers = list(ask.layers) or None
    params.hidden_states_points = [*ask.points, *ask.neurons, *ask.patterns] or None
    params.hidden_states_positions = ask.positions_json


def _completion_index(choices_per_prompt: int) -> Callable[[Any], tuple[Any, int]]:
    # completions yield (prompt_idx, RequestOutput); vLLM numbers the choices
    # prompt_idx * n + output index.
    return lambda item: (item[1], item[0] * choices_per_prompt)


def observe(
    results: AsyncIterator[Any],
) -> tuple[AsyncIterator[Any], HiddenStatesReply | None]:
    """The result iterator to hand vLLM's generators (the same one when the
    request did not ask), and the reply that records its choices' rows."""
    reply = _reply.get()
    if reply is None:
        return results, None
    chat = hasattr(reply.request, "messages")
    index_of = _single if chat else _completion_index(reply.choices_per_prompt)
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
    )
    return response


def json_response_class(default: type) -> type:
    """The response class for a non-streamed chat/completions body: one that
    writes hidden states with orjson (numpy arrays natively) when this request
    asked for them, else ``default`` (vLLM's ``JSONResponse``)."""
    if _reply.get() is None:
        return default
    return CapturedJSONResponse


class CapturedJSONResponse(JSONResponse):
    """``JSONResponse`` rendered by orjson with :data:`ORJSON_OPTIONS` (FastAPI's
    ``ORJSONResponse`` does the same but is deprecated in the pinned FastAPI)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=ORJSON_OPTIONS)


def refuse(request: Any, raw_request: Any, route: str) -> Any:
    """``ErrorResponse`` (400) when a route that cannot carry captured data
    or steering (/v1/responses, /v1/messages, /v1/chat/completions/batch) is
    sent any of :data:`REFUSED_FIELDS`; else None. Called first in those
    handlers."""
    field_name = _captured_field_asked(request, raw_request)
    if field_name is None:
        return None
    if field_name == STEERING_PARAM:
        return invalid_request(
            f"'steering' is not supported on this route ({route}); steering works "
            "on /v1/chat/completions, /v1/completions and POST /v1/hidden_states "
            "(server started with --enable-steering)",
            STEERING_PARAM,
        ).to_error_response()
    return invalid_request(
        f"'{field_name}' is not supported on this route ({route}): hidden states "
        "are not supported here; return_hidden_states, hidden_states_* and "
        "sae_features work on /v1/chat/completions and /v1/completions (and "
        "POST /v1/hidden_states)",
        field_name,
    ).to_error_response()


def _field_asked(data: Any) -> str | None:
    """The first of :data:`REFUSED_FIELDS` set (not null, not false) in ``data``."""
    if not isinstance(data, dict):
        return None
    return next((f for f in REFUSED_FIELDS if data.get(f) not in (None, False)), None)


def _captured_field_asked(request: Any, raw_request: Any) -> str | None:
    extra = getattr(request, "model_extra", None)
    if extra is not None:
        return _field_asked(extra)
    # Models that drop unknown fields (Anthropic's): look at the body read
    # for them (starlette caches it on the request).
    body = getattr(raw_request, "_body", None)
    if not body:
        return None
    try:
        return _field_asked(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None
