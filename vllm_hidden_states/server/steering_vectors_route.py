# SPDX-License-Identifier: Apache-2.0
"""GET /v1/steering_vectors: what the engine behind the server can steer.

Answers ``{"object": "list", "data": [{"object": "steering_vector", "name",
"length"}, ...], "matrices": [{"name", "shape"}, ...], "points": [...],
"max_interventions": k, "max_patch_rows": r}``: the named vectors of
``--steering-vectors DIR`` (sorted by name; empty without one), its matrices
of patch rows, the patch table's rows (``--max-patch-rows``) and every
address a request may write (``resid_post.i`` and ``resid_pre.(i+1)`` are
one point under two names, both listed; ``attn_z.i`` where heads are
writable). Without ``--enable-steering`` it is a 404 naming the flag: the
resource does not exist there, which a client can tell from an engine that
steers but has no named vectors.
"""

from http import HTTPStatus
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from vllm_hidden_states.points import point_id
from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.request_checks import steering_config
from vllm_hidden_states.steering_config import ENABLE_STEERING_HINT, WRITABLE_KINDS, SteeringConfig

router = APIRouter()


def writable_points(cfg: SteeringConfig) -> list[str]:
    """Every address a request may write, layer by layer: the steerable
    points in network order, then the layer's heads' outputs (attn_z:
    ``patch`` and ``ablate_heads`` only) where they are writable."""
    ids, n = set(cfg.ids), cfg.num_layers
    return [
        f"{kind}.{layer}"
        for layer in range(n)
        for kind in WRITABLE_KINDS
        if point_id(kind, layer, n) in ids  # type: ignore[arg-type]
    ]


def steering_vectors_body(cfg: SteeringConfig) -> dict[str, Any]:
    """The answer of GET /v1/steering_vectors (see the module docstring)."""
    return {
        "object": "list",
        "data": [
            {"object": "steering_vector", "name": name, "length": length}
            for name, length in sorted(cfg.vectors.items())
        ],
        "matrices": [
            {"name": name, "shape": shape} for name, shape in sorted(cfg.matrices.items())
        ],
        "points": writable_points(cfg),
        "max_interventions": cfg.max_interventions,
        "max_patch_rows": cfg.max_patch_rows,
    }


@router.get("/v1/steering_vectors")
async def list_steering_vectors(raw_request: Request):
    """GET /v1/steering_vectors (see the module docstring)."""
    cfg = steering_config(raw_request.app.state.engine_client)
    if cfg is None:
        return ApiError(
            f"steering is not enabled on this server, so it has no steering "
            f"vectors; {ENABLE_STEERING_HINT} (named vectors: --steering-vectors DIR)",
            HTTPStatus.NOT_FOUND,
            "invalid_request_error",
        ).json_response()
    return Response(orjson.dumps(steering_vectors_body(cfg)), media_type="application/json")
