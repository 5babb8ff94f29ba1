# SPDX-License-Identifier: Apache-2.0
"""Checks of HTTP request fields against the engine behind the server.

Shared by both routes (:mod:`.openai_fields` and :mod:`.hidden_states_route`);
the engine's capturable set (and what it can steer) is computed once per
engine client.
"""

import sys
import weakref
from typing import Any

from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.request_fields import ENABLE_HINT
from vllm_hidden_states.server.admission import check_layers
from vllm_hidden_states.server.encoding import invalid_request
from vllm_hidden_states.steering_config import ENABLE_STEERING_HINT, SteeringConfig
from vllm_hidden_states.steering_fields import check_steering

# engine client -> its HiddenStatesConfig (None when not enabled).
_engine_configs: "weakref.WeakKeyDictionary[Any, HiddenStatesConfig | None]" = (
    weakref.WeakKeyDictionary()
)


def _once_per_client(cache: weakref.WeakKeyDictionary, engine_client: Any, build: Any) -> Any:
    """``build(engine_client.vllm_config)``, computed once per engine client."""
    try:
        return cache[engine_client]
    except KeyError:
        cache[engine_client] = value = build(engine_client.vllm_config)
        return value


def engine_config(engine_client: Any) -> HiddenStatesConfig | None:
    """The engine's ``HiddenStatesConfig`` (None: not enabled), computed once per client."""
    return _once_per_client(_engine_configs, engine_client, HiddenStatesConfig.from_vllm_config)


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


# engine client -> its SteeringConfig (None when steering is not enabled).
_steering_configs: "weakref.WeakKeyDictionary[Any, SteeringConfig | None]" = (
    weakref.WeakKeyDictionary()
)

STEERING_PARAM = "steering"


def steering_config(engine_client: Any) -> SteeringConfig | None:
    """The engine's ``SteeringConfig`` (None: not enabled), computed once per client."""
    return _once_per_client(_steering_configs, engine_client, SteeringConfig.from_vllm_config)


def validate_steering(engine_client: Any, value: Any) -> None:
    """400 (``param: "steering"``) unless the engine steers and ``value`` is
    a list of interventions it can apply: the rules of the Python API
    (:func:`vllm_hidden_states.steering_fields.check_steering`) but the positions
    windows, which need the prompt's length (checked once it is tokenized:
    by the engine front-end, and on chat/completions streams by
    :func:`vllm_hidden_states.server.openai_fields.price`)."""
    cfg = steering_config(engine_client)
    if cfg is None:
        raise invalid_request(
            f"steering is not enabled on this server; {ENABLE_STEERING_HINT}", STEERING_PARAM
        )
    hidden_size = engine_client.model_config.get_hidden_size()
    try:
        # No prompt yet: a reach past every window, so only their form is checked.
        check_steering(value, cfg, hidden_size, 0, sys.maxsize)
    except ValueError as e:
        raise invalid_request(str(e), STEERING_PARAM) from None
