# SPDX-License-Identifier: Apache-2.0
"""Hidden states on /v1/chat/completions and /v1/completions.

:func:`patch_serving` wraps vLLM's OpenAI serving classes once, when the app is
built (see :func:`vllm_hidden_states.server.install_server_hooks`).

Request fields (OpenAI extras; ``OpenAIBaseModel`` keeps unknown fields in
``model_extra``)::

    return_hidden_states: bool            # default false
    hidden_states_layers: list[int]       # default [-1]; HF convention
    hidden_states_positions: "last" | "all" | "prompt"   # default "last"
    hidden_states_format: "float" | "base64"   # default "float"
    hidden_states_stream: bool            # default false; "all" + stream only

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

What is wrapped (vLLM 0.32.0):

* ``ChatCompletionRequest.to_sampling_params``,
  ``CompletionRequest.to_sampling_params``: copy the fields onto SamplingParams;
* ``OpenAIServingChat.create_chat_completion``,
  ``OpenAIServingCompletion.create_completion``: validate the fields before
  anything is generated, so a bad request is a 400 even when streaming;
* ``OpenAIServingChat.chat_completion_full_generator``,
  ``OpenAIServingCompletion.request_output_to_completion_response``: attach to
  the non-streaming response;
* ``OpenAIServingChat.chat_completion_stream_generator``,
  ``OpenAIServingCompletion.completion_stream_generator``: attach to the
  finish chunk of each choice (or to every chunk, ``hidden_states_stream``);
* ``get_max_tokens`` as looked up by the two serving modules: called right
  after tokenization with the prompt length, it prices "all"/"prompt"
  responses exactly (:mod:`.admission`) before anything is generated;
* ``JSONResponse`` as looked up by the two api_router modules: a subclass that
  writes bodies carrying hidden states with orjson (numpy arrays natively), and
  every other body exactly as before.

Requests that do not ask pay one ``dict`` lookup per wrapper.
"""

import contextvars
import functools
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from vllm.logger import init_logger
from vllm_hidden_states.config import DEFAULT_LAYERS
from vllm_hidden_states.server.encoding import (
    ENCODING_FORMATS,
    ORJSON_OPTIONS,
    ApiError,
    dtype_name,
    encode_array,
    invalid_request,
)
from vllm_hidden_states.server.validation import validate_layers

logger = init_logger(__name__)

REQUEST_FIELDS: tuple[str, ...] = (
    "return_hidden_states",
    "hidden_states_layers",
    "hidden_states_format",
    "hidden_states_positions",
    "hidden_states_stream",
)
# Positions a chat/completions choice can carry.
CHOICE_POSITIONS: tuple[str, ...] = ("last", "all", "prompt")
# SamplingParams fields the engine validates; its errors name these params.
ENGINE_PARAMS = frozenset(
    ("return_hidden_states", "hidden_states_layers", "hidden_states_positions")
)
_serving_patched = False


@dataclass(frozen=True)
class HiddenStatesAsk:
    """What a chat/completions request asked for (already type-checked)."""

    layers: tuple[int, ...]
    encoding_format: str
    positions: str = "last"
    stream: bool = False  # rows on every SSE chunk ("all" only)


def _refuse_without_flag(extra: dict[str, Any]) -> None:
    for name in REQUEST_FIELDS[1:]:
        if extra.get(name) not in (None, False):
            raise invalid_request(
                f"{name} was given but return_hidden_states is not true; "
                "set return_hidden_states: true to receive hidden states",
                name,
            )


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
    if not flag:
        _refuse_without_flag(extra)
        return None
    layers = extra.get("hidden_states_layers")
    if layers is None:
        layers = list(DEFAULT_LAYERS)
    if (
        not isinstance(layers, list)
        or not layers
        or any(isinstance(k, bool) or not isinstance(k, int) for k in layers)
    ):
        raise invalid_request(
            "hidden_states_layers must be a non-empty list of integers (HF "
            "convention: 0 = embeddings, -1 = final post-norm state), got "
            f"{layers!r}",
            "hidden_states_layers",
        )
    fmt = extra.get("hidden_states_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODING_FORMATS:
        raise invalid_request(
            f"hidden_states_format must be one of {list(ENCODING_FORMATS)}, "
            f"got {fmt!r}",
            "hidden_states_format",
        )
    positions = extra.get("hidden_states_positions")
    positions = "last" if positions is None else positions
    if positions not in CHOICE_POSITIONS:
        raise invalid_request(
            f"hidden_states_positions must be one of {list(CHOICE_POSITIONS)}, "
            f"got {positions!r}",
            "hidden_states_positions",
        )
    stream = extra.get("hidden_states_stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise invalid_request(
            f"hidden_states_stream must be true or false, got {stream!r}",
            "hidden_states_stream",
        )
    if stream and positions != "all":
        raise invalid_request(
            "hidden_states_stream streams the rows of every position as they "
            "are computed, so it needs hidden_states_positions: 'all' (got "
            f"{positions!r})",
            "hidden_states_stream",
        )
    return HiddenStatesAsk(tuple(layers), fmt, positions, stream)


def ask_of(request: Any) -> HiddenStatesAsk | None:
    """:func:`parse_ask` on a vLLM OpenAI request model's extra fields."""
    return parse_ask(request.model_extra)


def validate_ask(
    serving: Any, request: Any, raw_request: Any = None
) -> HiddenStatesAsk | None:
    """Parse, check and price a chat/completions request against the engine,
    before anything is tokenized or generated (see :mod:`.admission`)."""
    ask = ask_of(request)
    if ask is None:
        return None
    engine_client = serving.engine_client
    validate_layers(engine_client, ask.layers, "hidden_states_layers")
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
    admission.check_input_chars(
        limits, admission.text_chars(value, limits.max_input_chars), source
    )
    results = prompts * n
    admission.check_batch(limits, results, "n", "choices (prompts x n)")
    # "last": one position per result, exact. "all"/"prompt": at least one
    # (a lower bound); the exact price follows tokenization (_priced_max_tokens).
    admission.check_response(
        limits, results, 1, len(ask.layers),
        engine_client.model_config.get_hidden_size(), ask.encoding_format,
        "hidden_states_layers",
        "ask for fewer layers or choices, or use hidden_states_format 'base64'",
    )  # fmt: skip
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


# Set by the create wrapper for the duration of one "all"/"prompt" request.
_pricing: contextvars.ContextVar[PositionPricing | None] = contextvars.ContextVar(
    "hidden_states_pricing", default=None
)


def price_positions(pricing: PositionPricing, prompt_len: int, max_tokens: int) -> None:
    """Add one prompt's positions (x n choices) to the request's price; 400 when
    the whole response would pass the cap."""
    from vllm_hidden_states.server import admission

    per_choice = prompt_len if pricing.ask.positions == "prompt" else prompt_len + max_tokens
    pricing.spent_positions += pricing.n * per_choice
    admission.check_response(
        pricing.limits, 1, pricing.spent_positions, len(pricing.ask.layers),
        pricing.hidden_size, pricing.ask.encoding_format, "max_tokens",
        f"positions are priced at prompt tokens + max_tokens ({prompt_len} + "
        f"{max_tokens} here) per choice; lower max_tokens, ask for fewer layers "
        "or choices, use hidden_states_format 'base64', or raise the cap",
    )  # fmt: skip


def _wrap_get_max_tokens(module: Any) -> None:
    """Price "all"/"prompt" requests where vLLM learns the prompt length."""
    original = getattr(module, "get_max_tokens", None)
    if original is None:
        raise RuntimeError(
            f"{module.__name__} has no get_max_tokens; vllm-hidden-states "
            "supports vLLM 0.32.0's serving modules only"
        )
    signature = inspect.signature(original)
    if "input_length" not in signature.parameters:
        raise RuntimeError(
            f"{module.__name__}.get_max_tokens has no 'input_length' parameter; "
            "vllm-hidden-states supports vLLM 0.32.0's signature only"
        )

    @functools.wraps(original)
    def get_max_tokens(*args, **kwargs):
        max_tokens = original(*args, **kwargs)
        pricing = _pricing.get()
        if pricing is not None:
            prompt_len = signature.bind(*args, **kwargs).arguments["input_length"]
            price_positions(pricing, prompt_len, max_tokens)
        return max_tokens

    module.get_max_tokens = get_max_tokens


def _concat(chunks: list[dict[int, Any]], ask: HiddenStatesAsk) -> dict[int, Any]:
    import torch

    if len(chunks) == 1:
        return chunks[0]
    return {k: torch.cat([c[k] for c in chunks]) for k in ask.layers}


def encode_choice_states(
    states: dict[int, Any] | None, ask: HiddenStatesAsk, start: int = 0
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
    import torch

    if ask.positions == "last":
        rows = torch.cat([states[k][-1:] for k in ask.layers])  # [layers, hidden]
        out: dict[str, Any] = {"layers": list(ask.layers), "positions": "last"}
    else:
        rows = torch.stack([states[k] for k in ask.layers])  # [layers, pos, hidden]
        out = {"layers": list(ask.layers), "positions": ask.positions, "start": start}
    out["shape"] = list(rows.shape)
    out["dtype"] = dtype_name(rows.dtype)
    out["encoding_format"] = ask.encoding_format
    out["data"] = encode_array(rows, ask.encoding_format)
    return out


# --------------------------------------------------------------------------
# Wrappers. Each looks at the request once and calls the original unchanged
# when the request did not ask.


def _wrap_to_sampling_params(cls: type) -> None:
    original = cls.to_sampling_params

    @functools.wraps(original)
    def to_sampling_params(self, *args, **kwargs):
        params = original(self, *args, **kwargs)
        extra = self.model_extra
        if extra and extra.get("return_hidden_states") is True:
            params.return_hidden_states = True
            params.hidden_states_layers = list(
                extra.get("hidden_states_layers") or DEFAULT_LAYERS
            )
            params.hidden_states_positions = (
                extra.get("hidden_states_positions") or "last"
            )
        return params

    cls.to_sampling_params = to_sampling_params


def _wrap_create(cls: type, name: str) -> None:
    """Validate before generating; engine-side 400s get our error type too."""
    original = getattr(cls, name)

    @functools.wraps(original)
    async def create(self, request, *args, **kwargs):
        extra = request.model_extra
        if not extra or not any(f in extra for f in REQUEST_FIELDS):
            return await original(self, request, *args, **kwargs)
        from vllm.exceptions import VLLMValidationError

        token = None
        try:
            raw_request = args[0] if args else kwargs.get("raw_request")
            ask = validate_ask(self, request, raw_request)
            if ask is not None and ask.positions != "last":
                from vllm_hidden_states.server import admission

                token = _pricing.set(
                    PositionPricing(
                        admission.limits_of(raw_request),
                        ask,
                        getattr(request, "n", None) or 1,
                        self.engine_client.model_config.get_hidden_size(),
                    )
                )
            return await original(self, request, *args, **kwargs)
        except ApiError as e:
            return e.to_error_response()
        except VLLMValidationError as e:
            # The engine's own checks (InputProcessor) on our fields, e.g. a
            # prompt that leaves no room for the final token's state.
            if e.parameter not in ENGINE_PARAMS:
                raise
            return invalid_request(str(e), e.parameter).to_error_response()
        finally:
            if token is not None:
                _pricing.reset(token)

    setattr(cls, name, create)


@dataclass
class ChoiceRows:
    """One choice's rows as the result iterator delivered them.

    ``pending`` holds the ``{layer: [rows, hidden]}`` deltas not yet written
    to a chunk (streamed "all"), or everything (otherwise); ``start`` is the
    position of the first pending row.
    """

    pending: list[dict[int, Any]] = field(default_factory=list)
    start: int = 0
    finished: bool = False

    def take(self, ask: HiddenStatesAsk) -> dict[str, Any] | None:
        """The pending rows as a ``hidden_states`` object, emptied."""
        if not self.pending:
            return None
        states = _concat(self.pending, ask)
        obj = encode_choice_states(states, ask, self.start)
        self.start += next(iter(states.values())).shape[0]
        self.pending = []
        return obj


def _collect(
    source: AsyncIterator[Any],
    choices: dict[int, ChoiceRows],
    index_of: Callable[[Any], tuple[Any, int]],
) -> AsyncGenerator[Any, None]:
    """Pass ``source`` through, recording each choice's rows.

    ``index_of(item)`` returns ``(RequestOutput, choice index offset)``; the
    choice index of an output is ``offset + output.index``.
    """

    async def gen():
        try:
            async for item in source:
                res, offset = index_of(item)
                for output in res.outputs:
                    if output.hidden_states is None and output.finish_reason is None:
                        continue
                    rows = choices.setdefault(offset + output.index, ChoiceRows())
                    if output.hidden_states is not None:
                        rows.pending.append(output.hidden_states)
                    if output.finish_reason is not None:
                        rows.finished = True
                yield item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    return gen()


def _single(res: Any) -> tuple[Any, int]:
    return res, 0


def _attach_to_chunk(
    chunk: str, choices: dict[int, ChoiceRows], ask: HiddenStatesAsk
) -> str:
    """Add ``hidden_states`` to the choices of one SSE event that are owed
    rows: finishing choices, and with ``ask.stream`` every choice with rows
    pending (not on chat's role-only first chunk, which carries no token)."""
    if not chunk.startswith("data: {"):
        return chunk
    event = orjson.loads(chunk[6:])
    changed = False
    for choice in event.get("choices") or ():
        rows = choices.get(choice.get("index"))
        if rows is None or not rows.pending:
            continue
        if choice.get("finish_reason") is None:
            if not ask.stream or "role" in (choice.get("delta") or {}):
                continue
        elif not rows.finished:
            continue
        choice["hidden_states"] = rows.take(ask)
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
            if choices and any(r.pending and (ask.stream or r.finished)
                               for r in choices.values()):  # fmt: skip
                chunk = _attach_to_chunk(chunk, choices, ask)
            yield chunk
    finally:
        # A client that disconnects closes us; close the vLLM generator now so
        # it aborts the request instead of waiting for garbage collection.
        await inner.aclose()


RESULTS_ARG = "result_generator"


def _wrap_stream(cls: type, name: str, index_of_factory) -> None:
    """Wrap a stream generator whose result iterator is its ``result_generator``
    argument (bound by name: a vLLM upgrade that renames it fails here, at
    server start, not per request)."""
    original = getattr(cls, name)
    signature = inspect.signature(original)
    if RESULTS_ARG not in signature.parameters:
        raise RuntimeError(
            f"{cls.__name__}.{name} has no {RESULTS_ARG!r} parameter; "
            "vllm-hidden-states supports vLLM 0.32.0's signature only"
        )

    @functools.wraps(original)
    def stream(self, request, *args, **kwargs):
        ask = ask_of(request)
        if ask is None:
            return original(self, request, *args, **kwargs)
        choices: dict[int, ChoiceRows] = {}
        bound = signature.bind(self, request, *args, **kwargs)
        bound.arguments[RESULTS_ARG] = _collect(
            bound.arguments[RESULTS_ARG], choices, index_of_factory(request)
        )
        return _inject(original(*bound.args, **bound.kwargs), choices, ask)

    setattr(cls, name, stream)


def _wrap_chat_full(cls: type) -> None:
    original = cls.chat_completion_full_generator

    @functools.wraps(original)
    async def full(self, request, result_generator, *args, **kwargs):
        ask = ask_of(request)
        if ask is None:
            return await original(self, request, result_generator, *args, **kwargs)
        rows: dict[int, ChoiceRows] = {}
        source = _collect(result_generator, rows, _single)
        response = await original(self, request, source, *args, **kwargs)
        choices = getattr(response, "choices", None)
        if choices is not None:
            _attach_to_choices(
                choices, [_final_states(rows.get(c.index), ask) for c in choices], ask
            )
        return response

    cls.chat_completion_full_generator = full


def _wrap_completion_response(cls: type) -> None:
    original = cls.request_output_to_completion_response

    @functools.wraps(original)
    def to_response(self, final_res_batch, request, *args, **kwargs):
        response = original(self, final_res_batch, request, *args, **kwargs)
        ask = ask_of(request)
        if ask is not None:
            # Choices are numbered in this same order (prompt, then output).
            states = [o.hidden_states for res in final_res_batch for o in res.outputs]
            _attach_to_choices(response.choices, states, ask)
        return response

    cls.request_output_to_completion_response = to_response


def _final_states(rows: ChoiceRows | None, ask: HiddenStatesAsk) -> dict[int, Any] | None:
    """A non-streamed choice's states: its one final output's."""
    if rows is None or not rows.pending:
        return None
    return _concat(rows.pending, ask)


def _attach_to_choices(choices: list, states: list, ask: HiddenStatesAsk) -> None:
    for choice, choice_states in zip(choices, states):
        if choice_states is None and choice.finish_reason != "abort":
            raise ApiError(
                "the engine returned no hidden states for this request "
                "(see the server log)",
                status=500,
                type="internal_error",
            )
        choice.hidden_states = encode_choice_states(choice_states, ask)


def _orjson_response_class(base: type) -> type:
    """``JSONResponse`` that writes bodies carrying hidden states with orjson."""

    class HiddenStatesAwareJSONResponse(base):
        def render(self, content: Any) -> bytes:
            if isinstance(content, dict):
                choices = content.get("choices")
                if choices and "hidden_states" in choices[0]:
                    return orjson.dumps(content, option=ORJSON_OPTIONS)
            return super().render(content)

    return HiddenStatesAwareJSONResponse


def patch_serving() -> None:
    """Patch the chat/completions protocol, serving and router modules (once)."""
    global _serving_patched
    if _serving_patched:
        return
    from vllm.entrypoints.openai.chat_completion import api_router as chat_router
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion import api_router as completion_router
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap_to_sampling_params(ChatCompletionRequest)
    _wrap_to_sampling_params(CompletionRequest)

    _wrap_create(OpenAIServingChat, "create_chat_completion")
    _wrap_create(OpenAIServingCompletion, "create_completion")
    # Routes that cannot return hidden states refuse the fields (400) rather
    # than ignoring them. (/invocations dispatches to the two above.)
    from vllm_hidden_states.server.hidden_states_route import refuse_hidden_states_on

    refuse_hidden_states_on()

    _wrap_chat_full(OpenAIServingChat)
    _wrap_completion_response(OpenAIServingCompletion)

    # chat: result_generator yields RequestOutput.
    _wrap_stream(OpenAIServingChat, "chat_completion_stream_generator", lambda _: _single)

    # completions: result_generator yields (prompt_idx, RequestOutput); the
    # choice index is prompt_idx * n + output index.
    def completion_index(request):
        n = request.n or 1
        return lambda item: (item[1], item[0] * n)

    _wrap_stream(OpenAIServingCompletion, "completion_stream_generator", completion_index)

    from vllm.entrypoints.openai.chat_completion import serving as chat_serving
    from vllm.entrypoints.openai.completion import serving as completion_serving

    _wrap_get_max_tokens(chat_serving)
    _wrap_get_max_tokens(completion_serving)

    for module in (chat_router, completion_router):
        module.JSONResponse = _orjson_response_class(module.JSONResponse)
    _serving_patched = True
