# SPDX-License-Identifier: Apache-2.0
"""API-server process: the OpenAI HTTP surface of hidden states and steering.

:func:`register_routes` is called at the end of vLLM's
``register_api_routers`` (patch ``0009-openai-serving``), once per app; the
same patch calls :mod:`.openai_request` and :mod:`.openai_response` from
vLLM's chat/completions serving code.
"""

from typing import Any


def register_routes(
    args: Any, app: Any, supported_tasks: tuple[str, ...], model_config: Any = None
) -> None:
    """Add POST /v1/hidden_states, POST /v1/patch_sweep, GET /v1/steering_vectors and GET
    /v1/probes (servers that generate) and the request-body inspection middleware (every server) to
    ``app``.

    vLLM's endpoint-plugin entry point (``vllm.endpoint_plugins``) would add
    the route too, but it loads only when named in ``VLLM_PLUGINS``, which
    would also filter every other general plugin; and it cannot add middleware.
    """
    from vllm_hidden_states.server.body_inspection import install

    install(app, args, model_config)
    if "generate" in supported_tasks:
        from vllm_hidden_states.server.monitors import load_monitors

        load_monitors(args)
    if "generate" in supported_tasks:
        from vllm_hidden_states.server.hidden_states_route import router
        from vllm_hidden_states.server.patch_sweep_route import router as sweep_router
        from vllm_hidden_states.server.probes_route import router as probes_router
        from vllm_hidden_states.server.steering_vectors_route import router as vectors_router

        app.include_router(router)
        app.include_router(vectors_router)
        app.include_router(probes_router)
        app.include_router(sweep_router)
