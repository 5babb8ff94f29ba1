# SPDX-License-Identifier: Apache-2.0
"""POST /v1/hidden_states: every prompt position's state at one layer.

The request and response follow the heylookitsanllm text-encoder contract (the
Z-Image backend), plus a batch form and a ``messages`` form::

    {"model": "m", "input": "<|im_start|>user\\n...", "layer": -2,
     "max_length": 512, "return_attention_mask": false,
     "encoding_format": "float" | "base64"}
    -> {"hidden_states": [[...], ...] | "<base64>", "shape": [seq_len, hidden],
        "model": "m", "layer": -2, "dtype": "bfloat16",
        "encoding_format": "base64",          # base64 only
        "attention_mask": [1, ...]}           # return_attention_mask only

* ``input`` is text with any chat template already applied; it is encoded as
  the tokenizer does by default (special tokens such as BOS added) and cut to
  its first ``max_length`` tokens.
* ``input`` as a list of strings gives ``{"object": "list", "data": [one
  object per input, in order], "model": "m"}``.
* ``messages`` (instead of ``input``) is a chat conversation; the server applies
  the model's chat template as /v1/chat/completions does (``add_generation_
  prompt`` default true, ``chat_template_kwargs`` passed through).

Each input runs as a ``max_tokens=1`` generation with ``positions="prompt"``:
the prompt's states are captured during its own prefill (which skips prefix-
cache reads, so every position is computed), one forward pass per input like
vLLM's pooling runner; no post-sampling extract is needed.
"""

import asyncio
import os
from http import HTTPStatus
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from vllm.logger import init_logger
from vllm_hidden_states.server.validation import validate_layers
from vllm_hidden_states.server.encoding import (
    ORJSON_OPTIONS,
    ApiError,
    dtype_name,
    encode_array,
    encoded_size_bytes,
    invalid_request,
)

logger = init_logger(__name__)

MAX_RESPONSE_ENV = "VLLM_HIDDEN_STATES_MAX_RESPONSE_MB"
DEFAULT_MAX_RESPONSE_MB = 256.0

def max_response_bytes() -> int:
    """The response size cap, from ``VLLM_HIDDEN_STATES_MAX_RESPONSE_MB`` (MB = 2**20 B).

    Read once, when the route is added to the app, so a bad value stops the
    server at start-up rather than failing requests.
    """
    raw = os.environ.get(MAX_RESPONSE_ENV)
    if raw is None or raw == "":
        return int(DEFAULT_MAX_RESPONSE_MB * 2**20)
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(
            f"{MAX_RESPONSE_ENV} must be a number of megabytes, got {raw!r}"
        ) from None
    if mb <= 0:
        raise ValueError(f"{MAX_RESPONSE_ENV} must be positive, got {raw!r}")
    return int(mb * 2**20)


class HiddenStatesRequest(BaseModel):
    """Body of POST /v1/hidden_states. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    input: StrictStr | list[StrictStr] | None = None
    messages: list[dict[str, Any]] | None = None
    layer: StrictInt = -2
    max_length: StrictInt = Field(512, ge=1)
    return_attention_mask: StrictBool = False
    encoding_format: Literal["float", "base64"] = "float"
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "HiddenStatesRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError(
                "give exactly one of 'input' (templated text or a list of them) "
                "and 'messages' (a chat conversation)"
            )
        if isinstance(self.input, list) and not self.input:
            raise ValueError("'input' must not be an empty list")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        return self


MAX_RESPONSE_BYTES = max_response_bytes()
router = APIRouter()

# What each field accepts, for error messages.
FIELD_HELP = {
    "model": "the served model name (string)",
    "input": "a string or a non-empty list of strings",
    "messages": "a list of chat messages ({'role': ..., 'content': ...})",
    "layer": "an integer layer index (0 = embeddings, -1 = final post-norm "
    "state, -2 = the one before; default -2)",
    "max_length": "an integer >= 1 (default 512)",
    "return_attention_mask": "true or false",
    "encoding_format": "'float' or 'base64'",
    "add_generation_prompt": "true or false (messages only)",
    "chat_template_kwargs": "an object (messages only)",
}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One readable sentence for the first problem, and the field at fault."""
    error = exc.errors()[0]
    loc = error.get("loc") or ()
    field = str(loc[0]) if loc else None
    if error["type"] == "missing":
        return f"missing required field {field!r}: {FIELD_HELP.get(field, '')}", field
    if error["type"] == "extra_forbidden":
        return (
            f"unknown field {field!r}; allowed fields: {', '.join(FIELD_HELP)}",
            field,
        )
    if field is None or field not in FIELD_HELP:
        # model-level check (_one_source): pydantic prefixes "Value error, ".
        return str(error["msg"]).removeprefix("Value error, "), None
    return (
        f"invalid {field!r}: {error['msg']}; expected {FIELD_HELP[field]}",
        field,
    )


def parse_request(body: bytes) -> HiddenStatesRequest:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise invalid_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise invalid_request("the request body must be a JSON object")
    try:
        return HiddenStatesRequest.model_validate(data)
    except ValidationError as e:
        message, field = _validation_message(e)
        raise invalid_request(message, field) from None


def _check_model(state: Any, name: str):
    """The LoRA request serving ``name`` (None for the base model); 404 if unknown."""
    models = state.openai_serving_models
    if models.is_base_model(name):
        return None
    if name in models.lora_requests:
        return models.lora_requests[name]
    served = ", ".join(p.name for p in models.base_model_paths)
    raise ApiError(
        f"the model {name!r} does not exist; served models: {served}",
        HTTPStatus.NOT_FOUND,
        "model_not_found",
        "model",
    )


async def _token_ids(state: Any, request: HiddenStatesRequest) -> list[list[int]]:
    """Token ids of each input, cut to ``max_length``."""
    if request.messages is not None:
        return [await _render_messages(state, request)]
    texts = [request.input] if isinstance(request.input, str) else request.input
    tokenizer = state.engine_client.renderer.get_tokenizer()
    out = []
    for i, text in enumerate(texts):
        # Cut here rather than with truncation=True: vLLM loads tokenizers
        # with truncation_side="left", and the contract keeps the *first* tokens.
        ids = tokenizer.encode(text)[: request.max_length]
        if not ids:
            raise invalid_request(
                f"input {i} encodes to no tokens; give non-empty text", "input"
            )
        out.append(list(ids))
    return out


async def _render_messages(state: Any, request: HiddenStatesRequest) -> list[int]:
    """Apply the chat template exactly as /v1/chat/completions would."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    serving_chat = state.openai_serving_chat
    if serving_chat is None:
        raise invalid_request("this server has no chat template support", "messages")
    try:
        chat = ChatCompletionRequest.model_validate(
            {
                "model": request.model,
                "messages": request.messages,
                "add_generation_prompt": request.add_generation_prompt,
                "chat_template_kwargs": request.chat_template_kwargs,
            }
        )
    except ValidationError as e:
        raise invalid_request(
            f"invalid 'messages': {e.errors()[0]['msg']}; expected "
            f"{FIELD_HELP['messages']}",
            "messages",
        ) from None
    rendered = await serving_chat.render_chat_request(chat)
    if isinstance(rendered, ErrorResponse):
        raise ApiError(
            rendered.error.message, HTTPStatus(rendered.error.code), param="messages"
        )
    _, engine_inputs = rendered
    ids = list(engine_inputs[0]["prompt_token_ids"])
    return ids[: request.max_length]


def _check_limits(
    engine_client: Any, request: HiddenStatesRequest, inputs: list[list[int]]
) -> None:
    """422 when the model cannot take an input; 400 when the answer is too big."""
    max_model_len = engine_client.model_config.max_model_len
    # vLLM generates one token after the prompt, so the prompt must leave one
    # position free: prompt_len <= max_model_len - 1.
    limit = max_model_len - 1
    for i, ids in enumerate(inputs):
        if len(ids) > limit:
            raise ApiError(
                f"input {i} has {len(ids)} tokens after truncation to "
                f"max_length={request.max_length}; this model (max_model_len="
                f"{max_model_len}) returns hidden states for at most {limit} "
                "positions; lower max_length",
                HTTPStatus.UNPROCESSABLE_ENTITY,
                "model_error",
                "max_length",
            )
    hidden = engine_client.model_config.get_hidden_size()
    rows = sum(len(ids) for ids in inputs)
    size = encoded_size_bytes(rows * hidden, request.encoding_format)
    cap = MAX_RESPONSE_BYTES
    if size > cap:
        raise invalid_request(
            f"the response would be about {size / 2**20:.1f} MB ({rows} positions "
            f"x {hidden} values, encoding_format={request.encoding_format!r}), "
            f"over this server's {cap / 2**20:g} MB cap ({MAX_RESPONSE_ENV}); "
            "lower max_length, split the batch, use encoding_format 'base64', "
            "or raise the cap",
            "max_length",
        )


async def _extract(
    engine_client: Any, ids: list[int], layer: int, request_id: str, lora_request
):
    """``[len(ids), hidden]`` states of every position of ``ids`` at ``layer``."""
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        return_hidden_states=True,
        hidden_states_layers=[layer],
        hidden_states_positions="prompt",
    )
    final = None
    async for output in engine_client.generate(
        tokens_input(ids), params, request_id, lora_request=lora_request
    ):
        final = output
    states = final.outputs[0].hidden_states if final is not None else None
    if states is None:
        raise ApiError(
            "the engine returned no hidden states for this request (see the "
            "server log)",
            HTTPStatus.INTERNAL_SERVER_ERROR,
            "internal_error",
        )
    return states[layer]


def _input_object(request: HiddenStatesRequest, rows) -> dict[str, Any]:
    out: dict[str, Any] = {
        "hidden_states": encode_array(rows, request.encoding_format),
        "shape": list(rows.shape),
        "model": request.model,
        "layer": request.layer,
        "dtype": dtype_name(rows.dtype),
    }
    if request.encoding_format == "base64":
        out["encoding_format"] = "base64"
    if request.return_attention_mask:
        # One sequence per object, never padded: every position is real.
        out["attention_mask"] = [1] * rows.shape[0]
    return out


async def _serve(body: bytes, raw_request: Request) -> Response:
    from vllm.exceptions import VLLMValidationError
    from vllm.utils import random_uuid

    state = raw_request.app.state
    try:
        request = parse_request(body)
        lora_request = _check_model(state, request.model)
        engine_client = state.engine_client
        validate_layers(engine_client, (request.layer,), "layer")
        inputs = await _token_ids(state, request)
        _check_limits(engine_client, request, inputs)

        base_id = f"hiddenstates-{random_uuid()}"
        tasks = [
            asyncio.ensure_future(
                _extract(engine_client, ids, request.layer, f"{base_id}-{i}", lora_request)
            )
            for i, ids in enumerate(inputs)
        ]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            # One input failed (or the client left): stop the others too.
            for task in tasks:
                task.cancel()
            raise
        objects = [_input_object(request, rows) for rows in results]
        if isinstance(request.input, list):
            payload: dict[str, Any] = {
                "object": "list",
                "data": objects,
                "model": request.model,
            }
        else:
            payload = objects[0]
        return Response(
            orjson.dumps(payload, option=ORJSON_OPTIONS), media_type="application/json"
        )
    except ApiError as e:
        return _error(e)
    except VLLMValidationError as e:
        return _error(invalid_request(str(e), e.parameter))
    except Exception as e:
        logger.exception("POST /v1/hidden_states failed")
        return _error(
            ApiError(
                f"internal error: {type(e).__name__}: {e}",
                HTTPStatus.INTERNAL_SERVER_ERROR,
                "internal_error",
            )
        )


def _error(e: ApiError) -> Response:
    return Response(
        orjson.dumps(e.body()), status_code=int(e.status), media_type="application/json"
    )


@router.post("/v1/hidden_states")
async def create_hidden_states(raw_request: Request):
    """POST /v1/hidden_states (see the module docstring)."""
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    body = await raw_request.body()
    # with_cancellation cancels _serve (and so aborts the engine requests) when
    # the client disconnects; it needs the body read first, as done above.
    return await with_cancellation(_serve)(body, raw_request)
