# SPDX-License-Identifier: Apache-2.0
"""API-server process: the OpenAI HTTP surface of hidden states and steering.

* :mod:`.openai_fields`: request fields (``steering`` among them) and
  response ``hidden_states`` on /v1/chat/completions and /v1/completions
  (streamed or not), through call-outs in vLLM's serving code (patch
  ``0009-openai-serving``);
* :mod:`.hidden_states_route`: POST /v1/hidden_states (every prompt position)
  and GET /v1/steering_vectors;
* :mod:`.validation`: field checks against the engine behind the server;
* :mod:`.encoding`: the wire format (float / base64 / binary) and OpenAI
  error bodies;
* :mod:`.bounds`: request bodies measured before anything parses them (size,
  JSON values, depth, list and object sizes), on every route of the app.

:func:`register_routes` is called at the end of vLLM's
``register_api_routers`` (the same patch), once per app.
"""

from typing import Any


def register_routes(
    args: Any, app: Any, supported_tasks: tuple[str, ...], model_config: Any = None
) -> None:
    """Add POST /v1/hidden_states and GET /v1/steering_vectors (servers that
    generate) and the request bounds middleware (every server) to ``app``.

    vLLM's endpoint-plugin entry point (``vllm.endpoint_plugins``) would add
    the route too, but it loads only when named in ``VLLM_PLUGINS``, which
    would also filter every other general plugin; and it cannot add middleware.
    """
    from vllm_hidden_states.server.bounds import install as install_bounds

    install_bounds(app, args, model_config)
    if "generate" in supported_tasks:
        from vllm_hidden_states.server.hidden_states_route import router

        app.include_router(router)
