# SPDX-License-Identifier: Apache-2.0
"""HTTP request fields checked against the engine behind the server.

Shared by both routes (:mod:`.openai_request` and :mod:`.hidden_states_route`):
layers, points and steering, with the rules of the Python API; the engine's
configs are built once per engine config (``hidden_states_config.built_once``).
"""

import sys
from typing import Any

from vllm_hidden_states.hidden_states_config import HiddenStatesConfig, built_once
from vllm_hidden_states.request_fields import ENABLE_HINT
from vllm_hidden_states.server.errors import invalid_request
from vllm_hidden_states.server.limits import check_layers
from vllm_hidden_states.steering_config import ENABLE_STEERING_HINT, SteeringConfig
from vllm_hidden_states.steering_fields import check_steering


def engine_config(engine_client: Any) -> HiddenStatesConfig | None:
    """The engine's ``HiddenStatesConfig`` (None: not enabled), built once."""
    return built_once(HiddenStatesConfig, engine_client.vllm_config)


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


STEERING_PARAM = "steering"


def steering_config(engine_client: Any) -> SteeringConfig | None:
    """The engine's ``SteeringConfig`` (None: not enabled), built once."""
    return built_once(SteeringConfig, engine_client.vllm_config)


def validate_steering(engine_client: Any, value: Any) -> None:
    """400 (``param: "steering"``) unless the engine steers and ``value`` is
    a list of interventions it can apply: the rules of the Python API
    (:func:`vllm_hidden_states.steering_fields.check_steering`) but the positions
    windows, which need the prompt's length (checked once it is tokenized:
    by the engine front-end, and on chat/completions streams by
    :func:`vllm_hidden_states.server.openai_request.price`)."""
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
