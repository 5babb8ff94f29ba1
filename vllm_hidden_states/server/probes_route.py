# SPDX-License-Identifier: Apache-2.0
"""GET /v1/probes: the linear probes the engine behind the server scores.

Answers ``{"object": "list", "data": [{"object": "probe", "name", "point",
"output", "k", "hidden_size", "normalised"}, ...]}``, sorted by name: the
probes of ``--probes DIR`` a request may name in ``probes``. Without
``--probes`` it is a 404 naming the flag: the resource does not exist there.
"""

from http import HTTPStatus
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.request_fields import PROBES_HINT
from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.request_checks import engine_config

router = APIRouter()


def probes_body(cfg: HiddenStatesConfig) -> dict[str, Any]:
    """The answer of GET /v1/probes (see the module docstring)."""
    return {
        "object": "list",
        "data": [
            {
                "object": "probe",
                "name": name,
                "point": probe["point"],
                "output": probe["output"],
                "k": probe["k"],
                "hidden_size": probe["width"],
                "normalised": probe["normalised"],
            }
            for name, probe in sorted(cfg.probes.items())
        ],
    }


@router.get("/v1/probes")
async def list_probes(raw_request: Request):
    """GET /v1/probes (see the module docstring)."""
    cfg = engine_config(raw_request.app.state.engine_client)
    if cfg is None or not cfg.probes:
        return ApiError(
            f"this server has no probes; {PROBES_HINT}",
            HTTPStatus.NOT_FOUND,
            "invalid_request_error",
        ).json_response()
    return Response(orjson.dumps(probes_body(cfg)), media_type="application/json")
