# SPDX-License-Identifier: Apache-2.0
"""POST /v1/hidden_states: every prompt position's state at one layer or point.

The request and response follow the heylookitsanllm text-encoder contract,
plus a batch form (``input`` a list), a ``messages`` form (the chat template
applied as /v1/chat/completions does), a binary answer (``encoding_format:
"bytes"`` or ``Accept: application/octet-stream``, layout in
:func:`.encoding.binary_body`) and ``steering`` (as on chat/completions; the
states returned are the steered ones). The contract is told in
docs/openai_server.md. Each input runs as a ``max_tokens=1`` generation with
``positions="prompt"``: its states are captured during its own prefill.
"""

import asyncio
from http import HTTPStatus
from typing import Any, Literal

import numpy as np
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
from vllm_hidden_states.points import address_kind, is_neuron_address, is_pattern_address
from vllm_hidden_states.server.encoding import (
    OCTET_STREAM,
    ORJSON_OPTIONS,
    binary_array,
    binary_body,
    dtype_name,
    encode_array,
)
from vllm_hidden_states.server.errors import (
    ApiError,
    caught,
    internal_error,
    invalid_request,
    json_object,
    read_json_body,
)
from vllm_hidden_states.server.limits import (
    Limits,
    ResponseSize,
    check_batch,
    check_input_chars,
    check_response,
    limits_of,
    text_chars,
)
from vllm_hidden_states.server.request_checks import (
    check_layer_field,
    check_point_field,
    steering_config,
    validate_steering,
)
from vllm_hidden_states.server.stored_rows import has_store_refs, resolve_store_refs
from vllm_hidden_states.steering_config import z_head_dim

logger = init_logger(__name__)
ROUTE = "POST /v1/hidden_states"

# Inputs of one request in the engine at once (tokenized, generated and
# encoded per slice), so other requests interleave with a large batch.
ADMISSION_SLICE = 8

# Bodies at least this large are validated in a worker thread, never on the
# event loop.
OFF_LOOP_BYTES = 1 << 20


class HiddenStatesRequest(BaseModel):
    """Body of POST /v1/hidden_states. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    input: StrictStr | list[StrictStr] | None = None
    messages: list[dict[str, Any]] | None = None
    layer: StrictInt = -2
    # A capture point instead of a layer, e.g. "attn_out.3" (engine started
    # with --hidden-states-points); the answer then names "point", not "layer".
    point: StrictStr | None = None
    max_length: StrictInt = Field(512, ge=1)
    return_attention_mask: StrictBool = False
    encoding_format: Literal["float", "base64", "bytes"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["little", "big", "native"] = "little"
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Interventions (engine started with --enable-steering); checked by
    # validate_steering, which names what is allowed.
    steering: Any = None

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
        if self.point is not None and "layer" in self.model_fields_set:
            raise ValueError(
                "give one of 'layer' (a residual-stream layer) and 'point' (a "
                "capture point such as 'attn_out.3'), not both"
            )
        binary_only = {"embed_dtype", "endianness"} & self.model_fields_set
        if binary_only and self.encoding_format != "bytes":
            name = sorted(binary_only)[0]
            raise ValueError(
                f"'{name}' applies to binary answers only; set encoding_format "
                "'bytes' (JSON answers are float32)"
            )
        return self


router = APIRouter()

# What each field accepts, for error messages.
FIELD_HELP = {
    "model": "the served model name (string)",
    "input": "a string or a non-empty list of strings",
    "messages": "a list of chat messages ({'role': ..., 'content': ...})",
    "layer": "an integer layer index (0 = embeddings, -1 = final post-norm "
    "state, -2 = the one before; default -2)",
    "point": "a capture point address such as 'attn_out.3' or "
    "'blocks.3.hook_mlp_out' (instead of layer)",
    "max_length": "an integer >= 1 (default 512)",
    "return_attention_mask": "true or false",
    "encoding_format": "'float', 'base64' or 'bytes'",
    "embed_dtype": "'float32', 'float16' or 'bfloat16' (encoding_format 'bytes')",
    "endianness": "'little', 'big' or 'native' (encoding_format 'bytes')",
    "add_generation_prompt": "true or false (messages only)",
    "chat_template_kwargs": "an object (messages only)",
    "steering": "a list of interventions such as [{'point': 'resid_pre.3', "
    "'op': 'add', 'vector': [...], 'strength': 4}] (--enable-steering)",
}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One readable sentence for the first problem, and the field at fault."""
    error = exc.errors()[0]
    loc = error.get("loc") or ()
    field = str(loc[0]) if loc else None
    if error["type"] == "missing":
        return f"missing required field {field!r}: {FIELD_HELP.get(field or '', '')}", field
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


def _quality(accept: str, media: str) -> float:
    """The q-value ``accept`` gives ``media`` (0 when no range matches).

    The most specific matching range decides (RFC 9110, 12.5.1), so in
    ``application/json;q=0, */*`` the explicit ``q=0`` rules JSON out although
    ``*/*`` would allow it. A q-value that is not a number counts as 1.
    """
    family = media.split("/", 1)[0]
    specificity, quality = -1, 0.0
    for part in accept.split(","):
        name, *params = (p.strip() for p in part.split(";"))
        name = name.lower()
        rank = {media: 2, f"{family}/*": 1, "*/*": 0}.get(name)
        if rank is None or rank <= specificity:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 1.0
        specificity, quality = rank, q
    return quality


def negotiate(request: HiddenStatesRequest, accept: str | None) -> HiddenStatesRequest:
    """The request with its answer format settled against ``Accept``.

    Without ``encoding_format``, binary is picked when ``Accept`` prefers
    octet-stream to JSON (``Accept: application/octet-stream``, or
    ``application/json;q=0, */*``). 406 when the header allows neither JSON
    nor octet-stream, or excludes the format the body names.
    """
    if not accept or not accept.strip():
        return request
    json_q = _quality(accept, "application/json")
    binary_q = _quality(accept, OCTET_STREAM)
    given = "encoding_format" in request.model_fields_set
    if not given and binary_q > json_q:
        return request.model_copy(update={"encoding_format": "bytes"})
    binary = request.encoding_format == "bytes"
    if (binary_q if binary else json_q) > 0:
        return request
    wanted = OCTET_STREAM if binary else "application/json"
    raise ApiError(
        f"Accept: {accept!r} does not allow {wanted}, which encoding_format="
        f"{request.encoding_format!r} answers with; accept {wanted} (or */*), "
        f"or send Accept: {OCTET_STREAM} with encoding_format 'bytes' (or none) "
        "for binary and Accept: application/json for 'float'/'base64'",
        HTTPStatus.NOT_ACCEPTABLE,
        "invalid_request_error",
        "Accept",
    )


def parse_request(body: bytes) -> HiddenStatesRequest:
    return json_object(body, HiddenStatesRequest, _validation_message)


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


def _texts(request: HiddenStatesRequest) -> list[str]:
    assert request.input is not None  # callers handle the messages form first
    return [request.input] if isinstance(request.input, str) else list(request.input)


def _admit(engine_client: Any, limits: Limits, request: HiddenStatesRequest):
    """Price the request before anything is tokenized: input characters, batch
    size, and the smallest response it can produce (one position per input)."""
    if request.messages is not None:
        _check_messages(request.messages)
        chars = text_chars(request.messages, limits.max_input_chars)
        check_input_chars(limits, chars, "messages")
        results = 1
    else:
        texts = _texts(request)
        check_batch(limits, len(texts), "input", "inputs")
        check_input_chars(limits, sum(map(len, texts)), "input")
        results = len(texts)
    check_response(
        limits,
        ResponseSize(
            results=results, positions=1, layers=1, hidden_size=_row_width(engine_client, request)
        ),
        request.encoding_format,
        "input",
        "split the batch, or use encoding_format 'base64' or 'bytes'",
        request.embed_dtype,
    )


def _check_messages(messages: list[dict[str, Any]]) -> None:
    """400 for a message without text to encode: no ``role``, no ``content``
    (vLLM's chat request accepts ``{"role": "user"}`` and renders it as an
    empty turn), or content this route cannot encode (images, audio, ...): it
    returns the states of text positions only. An assistant message may carry
    ``tool_calls`` instead of content."""
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid_request(
                f"messages[{i}] has no 'role'; each message is {{'role': ..., 'content': ...}}",
                "messages",
            )
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise invalid_request(
                f"messages[{i}] ({role!r}) has no 'content'; give a string or a "
                "list of {'type': 'text', 'text': ...} parts (only an assistant "
                "message with 'tool_calls' may omit it)",
                "messages",
            )
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(part, str) or kind == "text":
                continue
            raise invalid_request(
                f"messages[{i}].content has a {kind!r} part; /v1/hidden_states "
                "takes text only (string content or {'type': 'text', 'text': ...} "
                "parts)",
                "messages",
            )


def _run_in_tokenizer_pool(state: Any, fn, *args):
    """Run ``fn`` where vLLM runs its own tokenization (the renderer's thread
    pool), off the event loop."""
    executor = getattr(state.engine_client.renderer, "_executor", None)
    return asyncio.get_running_loop().run_in_executor(executor, fn, *args)


async def _token_ids(state: Any, request: HiddenStatesRequest) -> list[list[int]]:
    """Token ids of each input, cut to ``max_length``; tokenized off the event
    loop, ``ADMISSION_SLICE`` inputs at a time."""
    if request.messages is not None:
        return [await _render_messages(state, request)]
    texts = _texts(request)
    tokenizer = state.engine_client.renderer.get_tokenizer()
    max_length = request.max_length

    def encode(batch: list[str]) -> list[list[int]]:
        # Cut here rather than with truncation=True: vLLM loads tokenizers
        # with truncation_side="left", and the contract keeps the *first* tokens.
        return [list(tokenizer.encode(text)[:max_length]) for text in batch]

    out: list[list[int]] = []
    step = ADMISSION_SLICE
    for start in range(0, len(texts), step):
        out.extend(await _run_in_tokenizer_pool(state, encode, texts[start : start + step]))
    for i, ids in enumerate(out):
        if not ids:
            raise invalid_request(f"input {i} encodes to no tokens; give non-empty text", "input")
    return out


async def _render_messages(state: Any, request: HiddenStatesRequest) -> list[int]:
    """Apply the chat template exactly as /v1/chat/completions would, keeping
    the first ``max_length`` tokens (vLLM truncates them, from the right)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    serving_chat = state.openai_serving_chat
    if serving_chat is None:
        raise invalid_request("this server has no chat template support", "messages")
    max_model_len = state.engine_client.model_config.max_model_len
    try:
        chat = ChatCompletionRequest.model_validate(
            {
                "model": request.model,
                "messages": request.messages,
                "add_generation_prompt": request.add_generation_prompt,
                "chat_template_kwargs": request.chat_template_kwargs,
                # Keep the first max_length tokens. Past max_model_len the
                # model cannot take it anyway (422 below), so cut there.
                "truncate_prompt_tokens": min(request.max_length, max_model_len),
                "truncation_side": "right",
                "max_tokens": 1,
            }
        )
    except ValidationError as e:
        raise invalid_request(
            f"invalid 'messages': {e.errors()[0]['msg']}; expected {FIELD_HELP['messages']}",
            "messages",
        ) from None
    rendered = await serving_chat.render_chat_request(chat)
    if isinstance(rendered, ErrorResponse):
        raise ApiError(rendered.error.message, HTTPStatus(rendered.error.code), param="messages")
    _, engine_inputs = rendered
    ids = list(engine_inputs[0]["prompt_token_ids"])
    return ids[: request.max_length]


def _check_limits(
    engine_client: Any,
    limits: Limits,
    request: HiddenStatesRequest,
    inputs: list[list[int]],
) -> None:
    """422 when the model cannot take an input; 400 when the answer is too big
    (exact token counts, before any generation)."""
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
    check_response(
        limits,
        ResponseSize(
            results=1,
            positions=sum(len(ids) for ids in inputs),
            layers=1,
            hidden_size=_row_width(engine_client, request),
        ),
        request.encoding_format,
        "max_length",
        "lower max_length, split the batch, use encoding_format 'base64' or "
        "'bytes', or raise the cap",
        request.embed_dtype,
    )


def _row_width(engine_client: Any, request: HiddenStatesRequest) -> int:
    """Values per position of the answer: the hidden size, the MLP's
    intermediate size for an ``mlp_post`` point, heads x head_dim for an
    ``attn_z`` or ``q`` point, KV heads x head_dim for a ``k`` / ``v`` point."""
    model_config = engine_client.model_config
    if request.point is not None and is_neuron_address(request.point):
        return int(model_config.hf_text_config.intermediate_size)
    kind = None if request.point is None else address_kind(request.point)
    if kind in ("attn_z", "q", "k", "v"):
        heads = int(model_config.hf_text_config.num_attention_heads)
        if kind in ("k", "v"):  # one row per KV head (vLLM's count: Falcon's multi_query)
            heads = int(model_config.get_total_num_kv_heads())
        if kind == "attn_z":  # value heads' size where it differs (MiniCPM3)
            return heads * z_head_dim(model_config)
        return heads * int(model_config.get_head_size())
    return model_config.get_hidden_size()


def _address(request: HiddenStatesRequest) -> dict[str, Any]:
    """What the answer names: ``{"point": ...}`` or ``{"layer": ...}``."""
    return {"layer": request.layer} if request.point is None else {"point": request.point}


async def _extract(
    engine_client: Any, ids: list[int], request: HiddenStatesRequest, request_id: str, lora_request
):
    """``[len(ids), hidden]`` states of every position of ``ids`` at the
    request's layer or point."""
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        return_hidden_states=True,
        hidden_states_layers=None if request.point is not None else [request.layer],
        hidden_states_points=None if request.point is None else [request.point],
        hidden_states_positions="prompt",
        # Each input's own copy: the front-end writes its wire form back.
        steering=None if request.steering is None else [dict(x) for x in request.steering],
    )
    final = None
    async for output in engine_client.generate(
        tokens_input(ids), params, request_id, lora_request=lora_request
    ):
        final = output
    states = final.outputs[0].hidden_states if final is not None else None
    if states is None:
        raise internal_error(
            "the engine returned no hidden states for this request (see the server log)"
        )
    return states[request.layer if request.point is None else request.point]


def _input_binary(request: HiddenStatesRequest, rows) -> np.ndarray:
    """One input's array in its wire dtype and byte order (run off the loop)."""
    return binary_array(rows, request.embed_dtype, request.endianness)


def _input_object_bytes(request: HiddenStatesRequest, rows) -> bytes:
    """One input's JSON object, serialized (run off the event loop)."""
    out: dict[str, Any] = {
        "hidden_states": encode_array(rows, request.encoding_format),
        "shape": list(rows.shape),
        "model": request.model,
        **_address(request),
        "dtype": dtype_name(rows.dtype),
    }
    if request.encoding_format == "base64":
        out["encoding_format"] = "base64"
    if request.return_attention_mask:
        # One sequence per object, never padded: every position is real.
        out["attention_mask"] = [1] * rows.shape[0]
    return orjson.dumps(out, option=ORJSON_OPTIONS)


async def _run_inputs(
    engine_client: Any,
    request: HiddenStatesRequest,
    inputs: list[list[int]],
    lora_request,
) -> list[Any]:
    """Each input's serialized object (binary: its wire array), in order. At
    most ``ADMISSION_SLICE`` inputs of this request are in the engine at once, so requests arriving
    meanwhile are queued between its slices, not behind the whole batch; each
    result is encoded in a worker thread as soon as it is ready."""
    from vllm.utils import random_uuid

    base_id = f"hiddenstates-{random_uuid()}"
    window = asyncio.Semaphore(ADMISSION_SLICE)
    out: list[Any] = [None] * len(inputs)
    encode = _input_binary if request.encoding_format == "bytes" else _input_object_bytes

    async def one(i: int, ids: list[int]) -> None:
        async with window:
            rows = await _extract(engine_client, ids, request, f"{base_id}-{i}", lora_request)
        out[i] = await asyncio.to_thread(encode, request, rows)

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(inputs)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        # One input failed (or the client left): stop the others too.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return out


async def _parse(body: bytes) -> HiddenStatesRequest:
    if len(body) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_request, body)
    return parse_request(body)


async def _serve(body: bytes, raw_request: Request) -> Response:

    state = raw_request.app.state
    try:
        limits = limits_of(raw_request)
        request = negotiate(await _parse(body), raw_request.headers.get("accept"))
        lora_request = _check_model(state, request.model)
        engine_client = state.engine_client
        if request.point is None:
            check_layer_field(engine_client, request.layer, "layer")
        else:
            check_point_field(engine_client, request.point, "point")
            if is_pattern_address(request.point):
                raise invalid_request(
                    f"{request.point} is an attention pattern, not a state per "
                    "position; ask for it on /v1/completions or /v1/chat/completions "
                    "(hidden_states_points)",
                    "point",
                )
        if request.steering is not None:
            cfg = steering_config(engine_client)
            if cfg is not None and has_store_refs(request.steering):
                request.steering = await resolve_store_refs(request.steering, cfg.num_layers)
            validate_steering(engine_client, request.steering)
        _admit(engine_client, limits, request)
        inputs = await _token_ids(state, request)
        _check_limits(engine_client, limits, request, inputs)
        objects = await _run_inputs(engine_client, request, inputs, lora_request)
        if request.encoding_format == "bytes":
            return await asyncio.to_thread(
                _binary_response, request, objects, engine_client.model_config.dtype
            )
        if isinstance(request.input, list):
            content = b"".join(
                (
                    b'{"object":"list","data":[',
                    b",".join(objects),
                    b'],"model":',
                    orjson.dumps(request.model),
                    b"}",
                )
            )
        else:
            content = objects[0]
        return Response(content, media_type="application/json")
    except Exception as e:  # noqa: BLE001 - answered as OpenAI error JSON
        return caught(e, ROUTE).json_response()


def _binary_response(
    request: HiddenStatesRequest, arrays: list[np.ndarray], model_dtype
) -> Response:
    """The octet-stream answer: a JSON header locating each input's array,
    then the arrays (layout in :func:`.encoding.binary_body`)."""
    items: list[dict[str, Any]] = []
    for i, array in enumerate(arrays):
        items.append(
            {"index": i, "embed_dtype": request.embed_dtype, "endianness": request.endianness}
        )
        if request.return_attention_mask:
            items[-1]["attention_mask"] = [1] * array.shape[0]
    header: dict[str, Any] = {
        "model": request.model,
        **_address(request),
        "dtype": dtype_name(model_dtype),
    }
    if isinstance(request.input, list):
        header["object"] = "list"
    headers: dict[str, str] = {"X-Hidden-States-Dtype": request.embed_dtype}
    if len(arrays) == 1:
        headers["X-Hidden-States-Shape"] = ",".join(map(str, arrays[0].shape))
    body = binary_body(arrays, items, header)
    return Response(body, media_type=OCTET_STREAM, headers=headers)


@router.post("/v1/hidden_states")
async def create_hidden_states(raw_request: Request):
    """POST /v1/hidden_states (see the module docstring)."""
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    body = await read_json_body(raw_request, ROUTE)
    if not isinstance(body, bytes):
        return body
    # with_cancellation cancels _serve (and so aborts the engine requests) when
    # the client disconnects; it needs the body read first, as done above.
    return await with_cancellation(_serve)(body, raw_request)
