# SPDX-License-Identifier: Apache-2.0
"""OpenAI server hooks: hidden states on /v1/chat/completions and /v1/completions,
and the POST /v1/hidden_states route.

Installed by :func:`install_server_hooks` from the general plugin, in every
process vLLM starts; it only acts in a process that builds the OpenAI app
(``vllm.entrypoints.launchers.app`` already imported), and there it only wraps
``register_api_routers``. Everything else is patched when the app is built, so
engine and worker processes pay nothing.

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

* ``launchers.app.register_api_routers``: patch the rest, then add our route;
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
import sys
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from vllm.logger import init_logger
from vllm_hidden_states.encoding import (
    ENCODING_FORMATS,
    ORJSON_OPTIONS,
    ApiError,
    dtype_name,
    encode_array,
    invalid_request,
)

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
DEFAULT_LAYERS: tuple[int, ...] = (-1,)

_APP_MODULE = "vllm.entrypoints.launchers.app"
# engine client -> its HiddenStatesConfig (None when not enabled).
_engine_configs: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_installed = False
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


def engine_config(engine_client: Any):
    """The engine's ``HiddenStatesConfig`` (None: not enabled), computed once per client."""
    try:
        return _engine_configs[engine_client]
    except KeyError:
        from vllm_hidden_states.config import HiddenStatesConfig

        cfg = HiddenStatesConfig.from_vllm_config(engine_client.vllm_config)
        _engine_configs[engine_client] = cfg
        return cfg


def validate_layers(engine_client: Any, layers: tuple[int, ...], param: str) -> None:
    """400 unless hidden states are enabled and every layer is capturable."""
    from vllm_hidden_states.config import ENABLE_HINT

    cfg = engine_config(engine_client)
    if cfg is None:
        raise invalid_request(
            f"hidden states are not enabled on this server; {ENABLE_HINT}", param
        )
    for layer in layers:
        try:
            cfg.resolve(layer)
        except ValueError as e:
            raise invalid_request(str(e), param) from None


def validate_ask(serving: Any, request: Any) -> HiddenStatesAsk | None:
    """Parse and check a chat/completions request against the engine."""
    ask = ask_of(request)
    if ask is None:
        return None
    validate_layers(serving.engine_client, ask.layers, "hidden_states_layers")
    if getattr(request, "use_beam_search", False):
        raise invalid_request(
            "return_hidden_states is not supported with use_beam_search",
            "use_beam_search",
        )
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
            validate_ask(self, request)
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


def _wrap_stream(cls: type, name: str, source_pos: int, index_of_factory) -> None:
    """Wrap a stream generator whose result iterator is argument ``source_pos``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def stream(self, request, *args, **kwargs):
        ask = ask_of(request)
        if ask is None:
            return original(self, request, *args, **kwargs)
        finished: dict[int, Any] = {}
        args = list(args)
        args[source_pos] = _collect(
            args[source_pos], finished, index_of_factory(request)
        )
        return _inject(original(self, request, *args, **kwargs), finished, ask)

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


def _patch_serving() -> None:
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

    _wrap_chat_full(OpenAIServingChat)
    _wrap_completion_response(OpenAIServingCompletion)

    # chat_completion_stream_generator(request, result_generator, ...)
    _wrap_stream(
        OpenAIServingChat, "chat_completion_stream_generator", 0, lambda _: _single
    )

    # completion_stream_generator(request, engine_inputs, result_generator, ...)
    # yields (prompt_idx, RequestOutput); choice index = prompt_idx * n + index.
    def completion_index(request):
        n = request.n or 1
        return lambda item: (item[1], item[0] * n)

    _wrap_stream(
        OpenAIServingCompletion, "completion_stream_generator", 1, completion_index
    )

    for module in (chat_router, completion_router):
        module.JSONResponse = _orjson_response_class(module.JSONResponse)
    _serving_patched = True


def _wrap_register_api_routers(app_module: Any) -> None:
    original = app_module.register_api_routers

    @functools.wraps(original)
    def register_api_routers(args, app, supported_tasks, *rest, **kwargs):
        if "generate" in supported_tasks:
            _patch_serving()
        original(args, app, supported_tasks, *rest, **kwargs)
        if "generate" in supported_tasks:
            from vllm_hidden_states.endpoint import router

            app.include_router(router)

    app_module.register_api_routers = register_api_routers


def install_server_hooks() -> None:
    """Install the OpenAI-server hooks in this process; idempotent, cheap.

    A no-op in processes that do not build the OpenAI app (EngineCore, workers,
    offline ``LLM``): the app module is not imported there, and importing it
    just to patch it would cost seconds.
    """
    global _installed
    if _installed:
        return
    app_module = sys.modules.get(_APP_MODULE)
    if app_module is None:
        return
    _wrap_register_api_routers(app_module)
    _installed = True
    logger.debug("vllm-hidden-states: OpenAI server hooks installed")
