# SPDX-License-Identifier: Apache-2.0
"""API-server process: the OpenAI HTTP surface of hidden states.

* :mod:`.openai_fields`: request fields and response ``hidden_states`` on
  /v1/chat/completions and /v1/completions (streamed or not);
* :mod:`.hidden_states_route`: POST /v1/hidden_states (every prompt position);
* :mod:`.validation`: field checks against the engine behind the server;
* :mod:`.encoding`: the wire format (float / base64) and OpenAI error bodies;
* :mod:`.bounds`: request bodies measured before anything parses them (size,
  JSON values, depth, list and object sizes), on every route of the app.

:func:`install_server_hooks` runs from the general plugin in every process vLLM
starts; it only acts where the OpenAI app module is already imported (the API
server), and there it only wraps ``register_api_routers``. The serving classes
are patched when the app is built, so engine and worker processes pay nothing.
"""

import functools
import sys
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

_APP_MODULE = "vllm.entrypoints.launchers.app"
_installed = False


def _wrap_register_api_routers(app_module: Any) -> None:
    original = app_module.register_api_routers

    @functools.wraps(original)
    def register_api_routers(args, app, supported_tasks, *rest, **kwargs):
        if "generate" in supported_tasks:
            from vllm_hidden_states.server.openai_fields import patch_serving

            patch_serving()
        original(args, app, supported_tasks, *rest, **kwargs)
        from vllm_hidden_states.server.bounds import install as install_bounds

        install_bounds(app, args, rest[0] if rest else kwargs.get("model_config"))
        if "generate" in supported_tasks:
            from vllm_hidden_states.server.hidden_states_route import router

            app.include_router(router)

    app_module.register_api_routers = register_api_routers


def install_server_hooks() -> None:
    """Install the OpenAI-server hooks in this process; idempotent, cheap.

    A no-op in processes that do not build the OpenAI app (EngineCore, workers,
    offline ``LLM``): the app module is not imported there, and importing it
    just to patch it would cost seconds.
    """
    global _installed
    if _installed:
        return
    app_module = sys.modules.get(_APP_MODULE)
    if app_module is None:
        return
    _wrap_register_api_routers(app_module)
    _installed = True
    logger.debug("vllm-hidden-states: OpenAI server hooks installed")
