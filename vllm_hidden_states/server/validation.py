# SPDX-License-Identifier: Apache-2.0
"""Checks of HTTP request fields against the engine behind the server.

Shared by both routes (:mod:`.openai_fields` and :mod:`.hidden_states_route`);
the engine's capturable set is computed once per engine client.
"""

import weakref
from typing import Any

from vllm_hidden_states.config import ENABLE_HINT, HiddenStatesConfig
from vllm_hidden_states.server.admission import check_layers
from vllm_hidden_states.server.encoding import invalid_request

# engine client -> its HiddenStatesConfig (None when not enabled).
_engine_configs: "weakref.WeakKeyDictionary[Any, HiddenStatesConfig | None]" = (
    weakref.WeakKeyDictionary()
)


def engine_config(engine_client: Any) -> HiddenStatesConfig | None:
    """The engine's ``HiddenStatesConfig`` (None: not enabled), computed once per client."""
    try:
        return _engine_configs[engine_client]
    except KeyError:
        cfg = HiddenStatesConfig.from_vllm_config(engine_client.vllm_config)
        _engine_configs[engine_client] = cfg
        return cfg


def validate_layers(engine_client: Any, layers: tuple[int, ...], param: str) -> None:
    """400 unless hidden states are enabled, every layer is capturable, no
    layer is named twice (``-1`` and ``L`` are one layer) and there are at
    most ``L + 1`` of them."""
    cfg = engine_config(engine_client)
    if cfg is None:
        raise invalid_request(f"hidden states are not enabled on this server; {ENABLE_HINT}", param)
    check_layers(tuple(layers), cfg.num_layers, cfg.resolve, param)


def validate_points(
    engine_client: Any, points: tuple[str, ...], param: str = "hidden_states_points"
) -> None:
    """400 unless hidden states are enabled and every point address is
    capturable on this engine, each named once (the rule of the Python API:
    :meth:`HiddenStatesConfig.resolve_points`)."""
    cfg = engine_config(engine_client)
    if cfg is None:
        raise invalid_request(f"hidden states are not enabled on this server; {ENABLE_HINT}", param)
    try:
        cfg.resolve_points(list(points))
    except ValueError as e:
        raise invalid_request(str(e), param) from None
