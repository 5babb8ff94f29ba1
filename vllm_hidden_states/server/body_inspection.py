# SPDX-License-Identifier: Apache-2.0
"""Request bodies inspected before anything parses them, on every route.

A pure ASGI middleware in front of every route of the OpenAI server (vLLM's
and ours). Each POST/PUT/PATCH body is size-capped as it arrives, its JSON
values and keys counted before parsing (parsing builds one Python object
each), parsed once, and walked with caps on depth, keys per object, items per
list and the per-field counts (chat ``messages``, /v1/responses ``input``,
/v1/hidden_states ``input``, ``hidden_states_layers``); the limits are
:class:`.limits.Limits`. An accepted body is replayed to the app unchanged.
Refusals are OpenAI error bodies naming the limit, its value and its flag.
Why before parsing: vLLM validates bodies with pydantic on the event loop,
where a malformed element costs far more than its bytes.
"""

import asyncio
import json
from http import HTTPStatus
from typing import Any

import orjson

from vllm.logger import init_logger
from vllm_hidden_states.hidden_states_config import layer_count_problem
from vllm_hidden_states.server.errors import ApiError, invalid_request
from vllm_hidden_states.server.limits import (
    BODY_FLAG,
    DEPTH_FLAG,
    INPUT_ITEMS_FLAG,
    KEYS_FLAG,
    LIST_FLAG,
    MB,
    MESSAGES_FLAG,
    VALUES_FLAG,
    Limits,
    check_batch,
    limits_for_app,
)

logger = init_logger(__name__)

# Worker threads inspecting bodies at once: each holds its parsed value
# (bounded by the values cap) until it is walked.
MAX_CONCURRENT_INSPECTIONS = 2

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Content types whose bodies are only size-capped, never parsed here.
_NOT_JSON_PREFIXES = ("multipart/", "application/x-www-form-urlencoded", "application/octet-stream")


def over_limit(
    message: str,
    status: HTTPStatus = HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    param: str | None = None,
) -> ApiError:
    """A body over one of the limits: ``type`` is the status phrase, as in
    vLLM's own request-validation errors."""
    return ApiError(message, HTTPStatus(status), HTTPStatus(status).phrase, param)


# --------------------------------------------------------------------------
# Counting values before parsing


def count_values(body: bytes, cap: int) -> int:
    """The number of JSON values (containers and scalars) and object keys in
    ``body``: each becomes a Python object when it is parsed. Exact when it
    matters: an upper bound from four byte counts (``,`` ``:`` ``[`` ``{``),
    at C speed, when that is within ``cap``; otherwise the exact count, with
    what is inside strings left out.

    Both assume the body is JSON; for other bodies the number is meaningless
    but finite (the parse that follows fails)."""
    upper = body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{") + 1
    if upper <= cap:
        return upper
    return _count_outside_strings(_as_utf8(body)) + 1


def _as_utf8(body: bytes) -> bytes:
    """``body`` in UTF-8 (json.loads also reads UTF-16 and UTF-32)."""
    encoding = json.detect_encoding(body)
    if encoding in ("utf-8", "utf-8-sig"):
        return body
    try:
        return body.decode(encoding).encode("utf-8", "surrogatepass")
    except (UnicodeError, LookupError):
        return body


_CHUNK = 4 * MB


def _count_outside_strings(body: bytes) -> int:
    """Commas, colons and opening brackets outside JSON strings.

    Escapes are dropped first (``\\\\`` pairs, then any escaped character,
    which leaves ``\\"`` out), so every remaining quote opens or closes a
    string; a byte is inside a string when an odd number of quotes precede
    it. numpy, in 4 MiB chunks: bounded memory, no Python loop per byte."""
    import numpy as np

    cleaned = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(cleaned, dtype=np.uint8)
    total = 0
    parity = 0
    for start in range(0, len(data), _CHUNK):
        chunk = data[start : start + _CHUNK]
        # uint8 wraps at 256, which keeps the parity.
        quotes = np.cumsum(chunk == 34, dtype=np.uint8)
        outside = ((quotes + np.uint8(parity)) & 1) == 0
        structural = (chunk == 44) | (chunk == 58) | (chunk == 91) | (chunk == 123)
        total += int(np.count_nonzero(structural & outside))
        parity = (parity + int(quotes[-1])) & 1
    return total


# --------------------------------------------------------------------------
# Parsing


class _NotJson(Exception):
    """The body is not JSON: the app answers it as it always did."""


class _TooDeep(Exception):
    """The body nests past orjson's 1024 levels."""


def parse(body: bytes) -> Any:
    """The body's JSON value: orjson, else what ``json.loads`` (starlette's
    ``Request.json``) accepts and orjson refuses (NaN, integers past 64 bits,
    lone surrogates, UTF-16/32, a BOM). Raises :class:`_NotJson` when neither
    reads it, :class:`_TooDeep` when it nests past orjson's 1024 levels."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):
            raise _TooDeep() from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError, UnicodeError):
        raise _NotJson() from None


# --------------------------------------------------------------------------
# Walking


_WHERE_KEYS = 8


def _where(path: list) -> str:
    """``'messages'[3].content`` for ``["messages", 3, "content"]`` (the
    first few keys of a deep path, then ``...``)."""
    out = "the body"
    for i, key in enumerate(path[:_WHERE_KEYS]):
        if isinstance(key, int):
            out = (out if i else "") + f"[{key}]"
        else:
            out = f"'{key}'" if i == 0 else f"{out}.{key}"
    return out + ("..." if len(path) > _WHERE_KEYS else "")


def _param(path: list) -> str | None:
    return str(path[0]) if path and isinstance(path[0], str) else None


def check_fields(data: Any, limits: Limits, route: str) -> None:
    """Per-field caps on the top-level object (before the general walk, so
    the refusal names the field's own limit)."""
    if not isinstance(data, dict):
        return
    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > limits.max_messages:
            count = len(messages)
        else:  # a batch (list of conversations): the messages of all of them
            count = sum(len(m) if isinstance(m, list) else 1 for m in messages)
        if count > limits.max_messages:
            raise over_limit(
                f"'messages' holds {count} messages, over this server's limit of "
                f"{limits.max_messages} messages per request ({MESSAGES_FLAG}); "
                "send fewer messages",
                param="messages",
            )
    items = data.get("input")
    if isinstance(items, list) and route.endswith("/v1/responses"):
        if len(items) > limits.max_input_items:
            raise over_limit(
                f"'input' has {len(items)} items, over this server's limit of "
                f"{limits.max_input_items} input items per /v1/responses request "
                f"({INPUT_ITEMS_FLAG}); send fewer items, or continue from "
                "previous_response_id",
                param="input",
            )
    if isinstance(items, list) and route.endswith("/v1/hidden_states"):
        # The admission check's own refusal (413, the route's message).
        check_batch(limits, len(items), "input", "inputs")
    layers = data.get("hidden_states_layers")
    if isinstance(layers, list) and limits.num_layers is not None:
        # The resolver's own refusal, before any entry is resolved (it runs
        # again, in full, on the route).
        problem = layer_count_problem(len(layers), limits.num_layers, "hidden_states_layers")
        if problem is not None:
            raise invalid_request(problem, "hidden_states_layers")


def check_structure(data: Any, limits: Limits) -> None:
    """Depth, keys per object and items per list, over the whole value.

    Depth first with one iterator per level, so the walk holds O(depth)
    state whatever the value's size; an object or list is measured (``len``)
    before any of its children is visited."""
    if not isinstance(data, (dict, list)):
        return
    path: list = []
    _check_container(data, path, limits)
    stack = [_children(data)]
    max_depth = limits.max_json_depth
    while stack:
        for key, value in stack[-1]:
            kind = type(value)
            if kind is dict or kind is list:
                path.append(key)
                if len(stack) + 1 > max_depth:
                    raise over_limit(
                        f"{_where(path)} is nested {len(stack) + 1} levels deep "
                        "(arrays and objects inside each other), over this "
                        f"server's limit of {max_depth} ({DEPTH_FLAG})",
                        HTTPStatus.BAD_REQUEST,
                        _param(path),
                    )
                _check_container(value, path, limits)
                stack.append(_children(value))
                break
        else:
            stack.pop()
            if path:
                path.pop()


def _children(value):
    return iter(value.items()) if type(value) is dict else enumerate(value)


def _check_container(value, path: list, limits: Limits) -> None:
    if type(value) is dict:
        if len(value) > limits.max_object_keys:
            raise over_limit(
                f"{_where(path)} is an object with {len(value)} keys, over this "
                f"server's limit of {limits.max_object_keys} keys per object "
                f"({KEYS_FLAG})",
                param=_param(path),
            )
    elif len(value) > limits.max_list_items:
        raise over_limit(
            f"{_where(path)} is a list of {len(value)} items, over this server's "
            f"limit of {limits.max_list_items} items per list ({LIST_FLAG})",
            param=_param(path),
        )


def inspect_body(body: bytes, limits: Limits, route: str) -> None:
    """Raise :class:`ApiError` when ``body`` (JSON, or not) is over a bound;
    return when the app may have it. Pure; thread-safe."""
    values = count_values(body, limits.max_json_values)
    if values > limits.max_json_values:
        raise over_limit(
            f"the JSON body holds {values} values and keys (objects, arrays, "
            "strings, numbers, object keys), over this server's limit of "
            f"{limits.max_json_values} "
            f"({VALUES_FLAG}); send a smaller request"
        )
    try:
        data = parse(body)
    except _NotJson:
        return
    except _TooDeep:
        raise over_limit(
            "the JSON body is nested more than 1024 levels deep (arrays and "
            "objects inside each other), over this server's limit of "
            f"{limits.max_json_depth} ({DEPTH_FLAG})",
            HTTPStatus.BAD_REQUEST,
        ) from None
    check_fields(data, limits, route)
    check_structure(data, limits)


# --------------------------------------------------------------------------
# The middleware


class RequestBoundsMiddleware:
    """Pure ASGI: reads the body (counting it), inspects it, then replays
    exactly the received messages to the app. No response is buffered and
    nothing is done for other requests (GET, websockets, lifespan)."""

    def __init__(self, app, limits: Limits | None = None):
        self.app = app
        self.limits = limits or Limits()
        self._inspections: asyncio.Semaphore | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limits = self.limits
        content_type, length = _headers(scope)
        if length is not None and length > limits.max_body_bytes:
            await self._refuse(scope, send, _too_long(length, limits), close=True)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                await self.app(scope, _replay(chunks, True, receive, message), send)
                return
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limits.max_body_bytes:
                    await self._refuse(
                        scope, send, _too_long(size, limits, partial=True), close=True
                    )
                    return
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks) if len(chunks) != 1 else chunks[0]
        chunks = [body]
        if body and not content_type.startswith(_NOT_JSON_PREFIXES):
            try:
                await self._inspect(body, scope.get("path", ""))
            except ApiError as e:
                await self._refuse(scope, send, e)
                return
        await self.app(scope, _replay(chunks, False, receive), send)

    async def _inspect(self, body: bytes, route: str) -> None:
        if len(body) < self.limits.off_loop_bytes:
            inspect_body(body, self.limits, route)
            return
        if self._inspections is None:
            self._inspections = asyncio.Semaphore(MAX_CONCURRENT_INSPECTIONS)
        async with self._inspections:
            await asyncio.to_thread(inspect_body, body, self.limits, route)

    async def _refuse(self, scope, send, error: ApiError, close: bool = False) -> None:
        logger.info(
            "refused %s %s (%d): %s",
            scope.get("method"),
            scope.get("path"),
            int(error.status),
            error.message,
        )
        body = orjson.dumps(error.body())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if close:  # the rest of the body is never read
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": int(error.status), "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _headers(scope) -> tuple[str, int | None]:
    content_type, length = "", None
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            content_type = value.decode("latin-1").strip().lower()
        elif name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                pass
    return content_type, length


def _too_long(size: int, limits: Limits, partial: bool = False) -> ApiError:
    what = f"more than {size}" if partial else f"{size}"
    return over_limit(
        f"the request body is {what} bytes, over this server's limit of "
        f"{limits.max_body_bytes} bytes ({BODY_FLAG} {limits.max_body_bytes / MB:g}); "
        "send a smaller request"
    )


def _replay(chunks: list[bytes], more_body: bool, receive, last: dict | None = None):
    """A ``receive`` that gives the app the body read so far as one message
    (then ``last``, if any), then defers to the server's ``receive``."""
    pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": more_body}]
    if last is not None:
        pending.append(last)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


# --------------------------------------------------------------------------
# Wiring


def install(app: Any, args: Any, model_config: Any = None) -> Limits:
    """Add the middleware to the app (called while vLLM registers its routes,
    so it sits inside vLLM's own middlewares: API-key checks and CORS come
    first, and nothing is read for a request they refuse)."""
    limits = limits_for_app(app, args, model_config)
    app.add_middleware(RequestBoundsMiddleware, limits=limits)
    logger.info("vllm-hidden-states: request bounds on every route: %s", limits.describe_bodies())
    return limits
