# SPDX-License-Identifier: Apache-2.0
"""The API server's request errors, answered as OpenAI error bodies.

``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP
status and the OpenAI ``type`` names (``invalid_request_error``,
``model_not_found``, ``model_error``, ``internal_error``): vLLM's own shape.
"""

from dataclasses import dataclass
from http import HTTPStatus


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
