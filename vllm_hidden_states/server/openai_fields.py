# SPDX-License-Identifier: Apache-2.0
"""Hidden states on /v1/chat/completions and /v1/completions.

:func:`patch_serving` wraps vLLM's OpenAI serving classes once, when the app is
built (see :func:`vllm_hidden_states.server.install_server_hooks`).

Request fields (OpenAI extras; ``OpenAIBaseModel`` keeps unknown fields in
``model_extra``)::

    return_hidden_states: bool            # default false
    hidden_states_layers: list[int]       # default [-1]; HF convention
    hidden_states_format: "float" | "base64"   # default "float"

Each choice of such a request then carries::

    "hidden_states": {"layers": [-1, 2], "shape": [2, hidden_size],
                      "dtype": "float32", "encoding_format": "float",
                      "data": [[...], [...]]}

one row per requested layer, in request order: the state of the last token of
prompt + that choice's ``token_ids``. When streaming, the object is on the chunk
that carries that choice's ``finish_reason``, once.

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
  finish chunk of each choice;
* ``JSONResponse`` as looked up by the two api_router modules: a subclass that
  writes bodies carrying hidden states with orjson (numpy arrays natively), and
  every other body exactly as before.

Requests that do not ask pay one ``dict`` lookup per wrapper.
"""

import functools
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
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
)
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


def parse_ask(extra: dict[str, Any] | None) -> HiddenStatesAsk | None:
    """The request's hidden-state fields; None when it did not ask.

    Raises :class:`ApiError` (400) for malformed fields. Whether the layers
    exist on this engine is checked by :func:`validate_ask`.
    """
    if not extra:
        return None
    flag = extra.get("return_hidden_states")
    layers = extra.get("hidden_states_layers")
    fmt = extra.get("hidden_states_format")
    if flag is None and layers is None and fmt is None:
        return None
    if flag is not None and not isinstance(flag, bool):
        raise invalid_request(
            f"return_hidden_states must be true or false, got {flag!r}",
            "return_hidden_states",
        )
    if not flag:
        if layers is not None or fmt is not None:
            given = "hidden_states_layers" if layers is not None else "hidden_states_format"
            raise invalid_request(
                f"{given} was given but return_hidden_states is not true; "
                "set return_hidden_states: true to receive hidden states",
                given,
            )
        return None
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
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODING_FORMATS:
        raise invalid_request(
            f"hidden_states_format must be one of {list(ENCODING_FORMATS)}, "
            f"got {fmt!r}",
            "hidden_states_format",
        )
    return HiddenStatesAsk(tuple(layers), fmt)


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
    admission.check_response(
        limits, results, 1, len(ask.layers),
        engine_client.model_config.get_hidden_size(), ask.encoding_format,
        "hidden_states_layers",
        "ask for fewer layers or choices, or use hidden_states_format 'base64'",
    )  # fmt: skip
    return ask


def encode_choice_states(
    states: dict[int, Any] | None, ask: HiddenStatesAsk
) -> dict[str, Any] | None:
    """The ``hidden_states`` object of one choice.

    Args:
        states: ``CompletionOutput.hidden_states``: ``{layer as requested:
            [num_positions, hidden] tensor}``; the last row is the last token.
        ask: the request's layers (row order) and encoding.
    """
    if states is None:
        return None
    import torch

    rows = torch.cat([states[k][-1:] for k in ask.layers])  # [len(layers), hidden]
    return {
        "layers": list(ask.layers),
        "shape": list(rows.shape),
        "dtype": dtype_name(rows.dtype),
        "encoding_format": ask.encoding_format,
        "data": encode_array(rows, ask.encoding_format),
    }


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

        try:
            raw_request = args[0] if args else kwargs.get("raw_request")
            validate_ask(self, request, raw_request)
            return await original(self, request, *args, **kwargs)
        except ApiError as e:
            return e.to_error_response()
        except VLLMValidationError as e:
            # The engine's own checks (InputProcessor) on our fields, e.g. a
            # prompt that leaves no room for the final token's state.
            if e.parameter not in ENGINE_PARAMS:
                raise
            return invalid_request(str(e), e.parameter).to_error_response()

    setattr(cls, name, create)


def _collect(
    source: AsyncIterator[Any],
    finished: dict[int, Any],
    index_of: Callable[[Any], tuple[Any, int]],
) -> AsyncGenerator[Any, None]:
    """Pass ``source`` through, recording each finished choice's states.

    ``index_of(item)`` returns ``(RequestOutput, choice index offset)``; the
    choice index of an output is ``offset + output.index``.
    """

    async def gen():
        try:
            async for item in source:
                res, offset = index_of(item)
                for output in res.outputs:
                    if output.finish_reason is not None:
                        finished[offset + output.index] = output.hidden_states
                yield item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    return gen()


def _single(res: Any) -> tuple[Any, int]:
    return res, 0


def _attach_to_chunk(chunk: str, finished: dict[int, Any], ask: HiddenStatesAsk) -> str:
    """Add ``hidden_states`` to the finishing choices of one SSE event."""
    if not chunk.startswith("data: {"):
        return chunk
    event = orjson.loads(chunk[6:])
    changed = False
    for choice in event.get("choices") or ():
        index = choice.get("index")
        if choice.get("finish_reason") is not None and index in finished:
            choice["hidden_states"] = encode_choice_states(finished.pop(index), ask)
            changed = True
    if not changed:
        return chunk
    return "data: " + orjson.dumps(event, option=ORJSON_OPTIONS).decode() + "\n\n"


async def _inject(
    inner: AsyncGenerator[str, None], finished: dict[int, Any], ask: HiddenStatesAsk
) -> AsyncGenerator[str, None]:
    try:
        async for chunk in inner:
            # Only events after a choice finished are parsed: typically one
            # per choice, never the per-token deltas before it.
            if finished:
                chunk = _attach_to_chunk(chunk, finished, ask)
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
        finished: dict[int, Any] = {}
        bound = signature.bind(self, request, *args, **kwargs)
        bound.arguments[RESULTS_ARG] = _collect(
            bound.arguments[RESULTS_ARG], finished, index_of_factory(request)
        )
        return _inject(original(*bound.args, **bound.kwargs), finished, ask)

    setattr(cls, name, stream)


def _wrap_chat_full(cls: type) -> None:
    original = cls.chat_completion_full_generator

    @functools.wraps(original)
    async def full(self, request, result_generator, *args, **kwargs):
        ask = ask_of(request)
        if ask is None:
            return await original(self, request, result_generator, *args, **kwargs)
        finished: dict[int, Any] = {}
        source = _collect(result_generator, finished, _single)
        response = await original(self, request, source, *args, **kwargs)
        choices = getattr(response, "choices", None)
        if choices is not None:
            _attach_to_choices(choices, [finished.get(c.index) for c in choices], ask)
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

    for module in (chat_router, completion_router):
        module.JSONResponse = _orjson_response_class(module.JSONResponse)
    _serving_patched = True
