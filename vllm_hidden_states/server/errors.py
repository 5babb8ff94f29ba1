# SPDX-License-Identifier: Apache-2.0
"""The API server's request errors, answered as OpenAI error bodies.

``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP
status and the OpenAI ``type`` names (``invalid_request_error``,
``model_not_found``, ``model_error``, ``internal_error``): vLLM's own shape.
"""

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ApiError(Exception):
    """A request error to answer with an OpenAI-shaped error body.

    Attributes:
        message: what was wrong and what is allowed.
        status: the HTTP status.
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: the request field at fault, when there is one.
    """

    message: str
    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    type: str = "invalid_request_error"
    param: str | None = None

    def __str__(self) -> str:
        return self.message

    def to_error_response(self):
        """vLLM's ``ErrorResponse`` model (what its routes return for errors)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=self.type,
                param=self.param,
                code=int(self.status),
            )
        )

    def json_response(self):
        """This error as a starlette ``Response`` (the routes this package adds)."""
        import orjson
        from starlette.responses import Response

        return Response(
            orjson.dumps(self.body()), status_code=int(self.status), media_type="application/json"
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": int(self.status),
            }
        }


def invalid_request(message: str, param: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(message, HTTPStatus.BAD_REQUEST, "invalid_request_error", param)


def too_large(message: str, param: str | None) -> ApiError:
    """A 413 ``invalid_request_error`` naming ``param``."""
    return ApiError(message, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "invalid_request_error", param)


def internal_error(message: str) -> ApiError:
    """A 500 ``internal_error``."""
    return ApiError(message, HTTPStatus.INTERNAL_SERVER_ERROR, "internal_error")


def caught(e: Exception, route: str) -> ApiError:
    """The error to answer for ``e``, caught by ``route`` ("POST /v1/..."):
    an :class:`ApiError` as itself, vLLM's ``VLLMValidationError`` as a 400
    on its parameter, anything else a 500 (logged with its traceback)."""
    from vllm.exceptions import VLLMValidationError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, VLLMValidationError):
        return invalid_request(str(e), e.parameter)
    logger.error("%s failed", route, exc_info=e)
    return internal_error(f"internal error: {type(e).__name__}: {e}")


async def read_json_body(raw_request: Any, route: str) -> Any:
    """The body of a JSON route's request, as bytes; or the response to send
    instead: a 400 naming ``Content-Type`` when it is not JSON (as vLLM's
    own routes answer), 499 when the client left while sending it (nobody to
    answer, nothing to abort: one log line)."""
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response

    content_type = raw_request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        return invalid_request(
            f"unsupported Content-Type {content_type or '(none)'!r}: {route} takes a "
            "JSON body (Content-Type: application/json)",
            "Content-Type",
        ).json_response()
    try:
        return await raw_request.body()
    except ClientDisconnect:
        logger.warning("%s: the client disconnected while sending its body", route)
        return Response(status_code=499)


def json_object(body: bytes, model: Any, message: Any) -> Any:
    """``body`` parsed and validated as pydantic ``model``; a 400 when it is
    not JSON, not an object, or not valid (``message(ValidationError)`` gives
    the text and the field)."""
    import orjson
    from pydantic import ValidationError

    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise invalid_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise invalid_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        text, field = message(e)
        raise invalid_request(text, field) from None
