# SPDX-License-Identifier: Apache-2.0
"""Request bounds: every request body is measured before anything parses it.

A pure ASGI middleware in front of every route of the OpenAI server (vLLM's
own and ours). For each POST/PUT/PATCH body it:

1. **caps the size**: a ``Content-Length`` over ``--request-max-body-mb`` is
   refused at once (413, the body never read); a body without one is counted
   as it arrives and refused as soon as it passes the cap;
2. **counts the JSON values and keys** before parsing
   (``--request-max-json-values``): parsing builds one Python object per
   value and per key (~100 bytes each, and seconds of GIL time for tens of
   millions), so a body that would build more is refused unparsed. The count
   is exact: what is inside strings does not count;
3. **parses it once** (orjson; the standard library's ``json`` for what
   orjson refuses but it accepts, as starlette would), in a worker thread when
   the body is 256 KiB or more, so the event loop keeps answering /health;
4. **walks the parsed value** with caps on nesting depth
   (``--request-max-json-depth``), keys per object
   (``--request-max-object-keys``), items per list
   (``--request-max-list-items``), and per-field caps where a field has a
   natural one: chat ``messages`` (``--request-max-messages``, summed over a
   batch's conversations), /v1/responses ``input`` items
   (``--request-max-input-items``), /v1/hidden_states ``input`` (the
   admission batch, ``--hidden-states-max-batch``), ``hidden_states_layers``
   (the model's ``L + 1`` layers);
5. **hands the body on unchanged**: the bytes it read are replayed to the app,
   so what the routes see (and answer) for an accepted request is exactly
   what they would have seen without it.

Why before parsing: vLLM validates request bodies with pydantic on the event
loop, and a malformed element costs far more than its bytes: an empty chat
message ``{}`` is checked against every message type and costs ~20 KB of
validation errors, so one 4 MB body of a million of them grew the API server
past 20 GB. Each cap bounds that work by a count the server chose.

Refusals are OpenAI error bodies (``{"error": {"message", "type", "param",
"code"}}``, ``type`` the HTTP status phrase, as vLLM's own request-validation
errors), naming what was over which limit, the limit's value and the flag that
sets it. Bodies that are not JSON (or not an object) pass through untouched:
the route answers them as it always did. ``multipart/*`` and form bodies
(uploads) are only size-capped.
"""

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from vllm.logger import init_logger

logger = init_logger(__name__)

MB = 2**20

DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_MAX_JSON_VALUES = 2_000_000
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_MAX_LIST_ITEMS = 65_536
DEFAULT_MAX_OBJECT_KEYS = 16_384
DEFAULT_MAX_MESSAGES = 8_192
DEFAULT_MAX_INPUT_ITEMS = 1_024

BODY_FLAG = "--request-max-body-mb"
VALUES_FLAG = "--request-max-json-values"
DEPTH_FLAG = "--request-max-json-depth"
LIST_FLAG = "--request-max-list-items"
KEYS_FLAG = "--request-max-object-keys"
MESSAGES_FLAG = "--request-max-messages"
INPUT_ITEMS_FLAG = "--request-max-input-items"

# Bodies at least this large are counted, parsed and walked in a worker
# thread; smaller ones (at most ~85k values) take milliseconds on the loop.
OFF_LOOP_BYTES = 256 * 1024
# Worker threads inspecting bodies at once: each holds its parsed value
# (bounded by the values cap) until it is walked.
MAX_CONCURRENT_INSPECTIONS = 2

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Content types whose bodies are only size-capped, never parsed here.
_NOT_JSON_PREFIXES = ("multipart/", "application/x-www-form-urlencoded", "application/octet-stream")


@dataclass(frozen=True)
class Bounds:
    """The server's request bounds (see the module docstring).

    Attributes:
        num_layers: the model's ``L`` (``hidden_states_layers`` may hold at
            most ``L + 1`` entries); None when unknown (no layer cap here).
        hidden_states_batch: inputs a /v1/hidden_states request may carry
            (``--hidden-states-max-batch``); None: no cap here.
    """

    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * MB)
    max_json_values: int = DEFAULT_MAX_JSON_VALUES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_list_items: int = DEFAULT_MAX_LIST_ITEMS
    max_object_keys: int = DEFAULT_MAX_OBJECT_KEYS
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_input_items: int = DEFAULT_MAX_INPUT_ITEMS
    num_layers: int | None = None
    hidden_states_batch: int | None = None
    off_loop_bytes: int = OFF_LOOP_BYTES

    @classmethod
    def from_args(cls, args: Any = None, model_config: Any = None) -> "Bounds":
        """From the parsed ``vllm serve`` arguments (None or a missing flag:
        its default) and the served model's config (None: unknown).

        The default list cap is ``max(65536, max_model_len)``: a token-id
        prompt may be as long as the model's context.
        """
        max_model_len = getattr(model_config, "max_model_len", None) or 0
        num_layers = None
        try:
            num_layers = int(model_config.hf_text_config.num_hidden_layers)
        except (AttributeError, TypeError, ValueError):
            pass
        from vllm_hidden_states.server.admission import DEFAULT_MAX_BATCH

        def flag(name: str, option: str, default, cast=int):
            value = getattr(args, name, None)
            return default if value is None else _positive(value, option, cast)

        body_mb = flag("request_max_body_mb", BODY_FLAG, DEFAULT_MAX_BODY_MB, float)
        # The admission batch (validated by admission on each request; a bad
        # value is left to it, not checked here).
        batch = getattr(args, "hidden_states_max_batch", None)
        if batch is None:
            batch = DEFAULT_MAX_BATCH
        elif isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            batch = None
        return cls(
            max_body_bytes=int(body_mb * MB),
            max_json_values=flag("request_max_json_values", VALUES_FLAG, DEFAULT_MAX_JSON_VALUES),
            max_json_depth=flag("request_max_json_depth", DEPTH_FLAG, DEFAULT_MAX_JSON_DEPTH),
            max_list_items=flag(
                "request_max_list_items", LIST_FLAG, max(DEFAULT_MAX_LIST_ITEMS, int(max_model_len))
            ),
            max_object_keys=flag("request_max_object_keys", KEYS_FLAG, DEFAULT_MAX_OBJECT_KEYS),
            max_messages=flag("request_max_messages", MESSAGES_FLAG, DEFAULT_MAX_MESSAGES),
            max_input_items=flag(
                "request_max_input_items", INPUT_ITEMS_FLAG, DEFAULT_MAX_INPUT_ITEMS
            ),
            num_layers=num_layers,
            hidden_states_batch=batch,
        )

    def describe(self) -> str:
        return (
            f"body <= {self.max_body_bytes / MB:g} MB, <= {self.max_json_values} "
            f"JSON values and keys, depth <= {self.max_json_depth}, <= {self.max_list_items} "
            f"items per list, <= {self.max_object_keys} keys per object, <= "
            f"{self.max_messages} messages, <= {self.max_input_items} /v1/responses "
            "input items"
        )


def _positive(value: Any, name: str, cast=int):
    try:
        number = cast(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if isinstance(value, bool) or number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


class BoundsError(Exception):
    """A request over one of the bounds; answered as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        param: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = HTTPStatus(status)
        self.param = param
        self.type = type or self.status.phrase

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": int(self.status),
                }
            }
        )


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


def check_fields(data: Any, bounds: Bounds, route: str) -> None:
    """Per-field caps on the top-level object (before the general walk, so
    the refusal names the field's own limit)."""
    if not isinstance(data, dict):
        return
    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > bounds.max_messages:
            count = len(messages)
        else:  # a batch (list of conversations): the messages of all of them
            count = sum(len(m) if isinstance(m, list) else 1 for m in messages)
        if count > bounds.max_messages:
            raise BoundsError(
                f"'messages' holds {count} messages, over this server's limit of "
                f"{bounds.max_messages} messages per request ({MESSAGES_FLAG}); "
                "send fewer messages",
                param="messages",
            )
    items = data.get("input")
    if isinstance(items, list) and route.endswith("/v1/responses"):
        if len(items) > bounds.max_input_items:
            raise BoundsError(
                f"'input' has {len(items)} items, over this server's limit of "
                f"{bounds.max_input_items} input items per /v1/responses request "
                f"({INPUT_ITEMS_FLAG}); send fewer items, or continue from "
                "previous_response_id",
                param="input",
            )
    if (
        isinstance(items, list)
        and route.endswith("/v1/hidden_states")
        and bounds.hidden_states_batch is not None
    ):
        from vllm_hidden_states.server import admission

        limits = admission.Limits(0, bounds.hidden_states_batch, 0)
        _as_bounds_error(admission.check_batch, limits, len(items), "input", "inputs")
    layers = data.get("hidden_states_layers")
    if (
        isinstance(layers, list)
        and bounds.num_layers is not None
        and len(layers) > bounds.num_layers + 1
    ):
        from vllm_hidden_states.server import admission

        # The admission check's own refusal (it refuses on the length before
        # resolving any entry, and runs again, in full, on the route).
        _as_bounds_error(
            admission.check_layers, tuple(layers), bounds.num_layers, None, "hidden_states_layers"
        )


def _as_bounds_error(check, *args) -> None:
    """Run an admission check; its refusal as a :class:`BoundsError` (same
    message, status, type and param as on the route)."""
    from vllm_hidden_states.server.encoding import ApiError

    try:
        check(*args)
    except ApiError as e:
        raise BoundsError(e.message, e.status, e.param, e.type) from None


def check_structure(data: Any, bounds: Bounds) -> None:
    """Depth, keys per object and items per list, over the whole value.

    Depth first with one iterator per level, so the walk holds O(depth)
    state whatever the value's size; an object or list is measured (``len``)
    before any of its children is visited."""
    if not isinstance(data, (dict, list)):
        return
    path: list = []
    _check_container(data, path, bounds)
    stack = [_children(data)]
    max_depth = bounds.max_json_depth
    while stack:
        for key, value in stack[-1]:
            kind = type(value)
            if kind is dict or kind is list:
                path.append(key)
                if len(stack) + 1 > max_depth:
                    raise BoundsError(
                        f"{_where(path)} is nested {len(stack) + 1} levels deep "
                        "(arrays and objects inside each other), over this "
                        f"server's limit of {max_depth} ({DEPTH_FLAG})",
                        HTTPStatus.BAD_REQUEST,
                        _param(path),
                    )
                _check_container(value, path, bounds)
                stack.append(_children(value))
                break
        else:
            stack.pop()
            if path:
                path.pop()


def _children(value):
    return iter(value.items()) if type(value) is dict else enumerate(value)


def _check_container(value, path: list, bounds: Bounds) -> None:
    if type(value) is dict:
        if len(value) > bounds.max_object_keys:
            raise BoundsError(
                f"{_where(path)} is an object with {len(value)} keys, over this "
                f"server's limit of {bounds.max_object_keys} keys per object "
                f"({KEYS_FLAG})",
                param=_param(path),
            )
    elif len(value) > bounds.max_list_items:
        raise BoundsError(
            f"{_where(path)} is a list of {len(value)} items, over this server's "
            f"limit of {bounds.max_list_items} items per list ({LIST_FLAG})",
            param=_param(path),
        )


def inspect_body(body: bytes, bounds: Bounds, route: str) -> None:
    """Raise :class:`BoundsError` when ``body`` (JSON, or not) is over a bound;
    return when the app may have it. Pure; thread-safe."""
    values = count_values(body, bounds.max_json_values)
    if values > bounds.max_json_values:
        raise BoundsError(
            f"the JSON body holds {values} values and keys (objects, arrays, "
            "strings, numbers, object keys), over this server's limit of "
            f"{bounds.max_json_values} "
            f"({VALUES_FLAG}); send a smaller request"
        )
    try:
        data = parse(body)
    except _NotJson:
        return
    except _TooDeep:
        raise BoundsError(
            "the JSON body is nested more than 1024 levels deep (arrays and "
            "objects inside each other), over this server's limit of "
            f"{bounds.max_json_depth} ({DEPTH_FLAG})",
            HTTPStatus.BAD_REQUEST,
        ) from None
    check_fields(data, bounds, route)
    check_structure(data, bounds)


# --------------------------------------------------------------------------
# The middleware


class RequestBoundsMiddleware:
    """Pure ASGI: reads the body (counting it), inspects it, then replays
    exactly the received messages to the app. No response is buffered and
    nothing is done for other requests (GET, websockets, lifespan)."""

    def __init__(self, app, bounds: Bounds | None = None):
        self.app = app
        self.bounds = bounds or Bounds()
        self._inspections: asyncio.Semaphore | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        bounds = self.bounds
        content_type, length = _headers(scope)
        if length is not None and length > bounds.max_body_bytes:
            await self._refuse(scope, send, _too_long(length, bounds), close=True)
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
                if size > bounds.max_body_bytes:
                    await self._refuse(
                        scope, send, _too_long(size, bounds, partial=True), close=True
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
            except BoundsError as e:
                await self._refuse(scope, send, e)
                return
        await self.app(scope, _replay(chunks, False, receive), send)

    async def _inspect(self, body: bytes, route: str) -> None:
        if len(body) < self.bounds.off_loop_bytes:
            inspect_body(body, self.bounds, route)
            return
        if self._inspections is None:
            self._inspections = asyncio.Semaphore(MAX_CONCURRENT_INSPECTIONS)
        async with self._inspections:
            await asyncio.to_thread(inspect_body, body, self.bounds, route)

    async def _refuse(self, scope, send, error: BoundsError, close: bool = False) -> None:
        logger.info(
            "refused %s %s (%d): %s",
            scope.get("method"),
            scope.get("path"),
            int(error.status),
            error.message,
        )
        body = error.body()
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


def _too_long(size: int, bounds: Bounds, partial: bool = False) -> BoundsError:
    what = f"more than {size}" if partial else f"{size}"
    return BoundsError(
        f"the request body is {what} bytes, over this server's limit of "
        f"{bounds.max_body_bytes} bytes ({BODY_FLAG} {bounds.max_body_bytes / MB:g}); "
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


def install(app: Any, args: Any, model_config: Any = None) -> Bounds:
    """Add the middleware to the app (called while vLLM registers its routes,
    so it sits inside vLLM's own middlewares: API-key checks and CORS come
    first, and nothing is read for a request they refuse)."""
    bounds = Bounds.from_args(args, model_config)
    app.add_middleware(RequestBoundsMiddleware, bounds=bounds)
    logger.info("vllm-hidden-states: request bounds on every route: %s", bounds.describe())
    return bounds


def add_cli_args(group) -> None:
    """The flags, on the ``Hidden states (vllm-hidden-states)`` group (the API
    server reads them; EngineArgs ignores them)."""
    group.add_argument(
        BODY_FLAG,
        type=float,
        default=None,
        help="Largest request body, in MB (2**20 bytes), on every route; "
        "larger ones are refused (413) before they are read or parsed. "
        f"Default: {DEFAULT_MAX_BODY_MB:g}.",
    )
    group.add_argument(
        VALUES_FLAG,
        type=int,
        default=None,
        help="Most JSON values and object keys (each a Python object once "
        "parsed) one request body may hold, counted before it is parsed. Default: "
        f"{DEFAULT_MAX_JSON_VALUES}.",
    )
    group.add_argument(
        DEPTH_FLAG,
        type=int,
        default=None,
        help="Deepest nesting of arrays and objects in a request body. "
        f"Default: {DEFAULT_MAX_JSON_DEPTH}.",
    )
    group.add_argument(
        LIST_FLAG,
        type=int,
        default=None,
        help="Most items in any one list of a request body. Default: "
        f"{DEFAULT_MAX_LIST_ITEMS}, or max_model_len if larger (token-id prompts).",
    )
    group.add_argument(
        KEYS_FLAG,
        type=int,
        default=None,
        help=f"Most keys in any one object of a request body. Default: {DEFAULT_MAX_OBJECT_KEYS}.",
    )
    group.add_argument(
        MESSAGES_FLAG,
        type=int,
        default=None,
        help="Most chat messages one request may carry (summed over a batch's "
        f"conversations). Default: {DEFAULT_MAX_MESSAGES}.",
    )
    group.add_argument(
        INPUT_ITEMS_FLAG,
        type=int,
        default=None,
        help="Most 'input' items one /v1/responses request may carry (vLLM "
        "validates each malformed one at ~1 MB). Default: "
        f"{DEFAULT_MAX_INPUT_ITEMS}.",
    )
