# SPDX-License-Identifier: Apache-2.0
"""HTTP request fields checked against the engine behind the server.

Shared by both routes (:mod:`.openai_request` and :mod:`.hidden_states_route`):
the route's own layer and point fields and steering, by the rules of the one
resolver (``request_fields``) and ``steering_fields``; the engine's
configs are built once per engine config (``hidden_states_config.built_once``).
"""

import sys
from typing import Any

from vllm_hidden_states.hidden_states_config import HiddenStatesConfig, built_once
from vllm_hidden_states.request_fields import FieldError, RequestFields, resolve_fields
from vllm_hidden_states.server.errors import invalid_request
from vllm_hidden_states.steering_config import STEERING_OFF, SteeringConfig
from vllm_hidden_states.steering_fields import check_steering


def engine_config(engine_client: Any) -> HiddenStatesConfig | None:
    """The engine's ``HiddenStatesConfig`` (None: not enabled), built once."""
    return built_once(HiddenStatesConfig, engine_client.vllm_config)


def engine_rules(engine_client: Any, param: str) -> HiddenStatesConfig:
    """The engine's config, for a route field named ``param``; 400 with the
    resolver's refusal when hidden states are not enabled."""
    cfg = engine_config(engine_client)
    if cfg is None:
        try:
            resolve_fields(None, RequestFields(return_hidden_states=True))
        except FieldError as e:
            raise invalid_request(str(e), param) from None
    assert cfg is not None
    return cfg


def check_layer_field(engine_client: Any, layer: Any, param: str) -> int:
    """A route's one layer (POST /v1/hidden_states ``layer``), resolved by
    the rule of ``hidden_states_layers``; 400 naming what is allowed."""
    try:
        return engine_rules(engine_client, param).resolve_all([layer], param)[0]
    except ValueError as e:
        raise invalid_request(str(e), param) from None


def check_point_field(engine_client: Any, point: Any, param: str) -> int:
    """A route's one point address (``point``), resolved by the rule of
    ``hidden_states_points``; 400 naming what is allowed."""
    try:
        return engine_rules(engine_client, param).resolve_points([point])[0]
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
        raise invalid_request(STEERING_OFF, STEERING_PARAM)
    hidden_size = engine_client.model_config.get_hidden_size()
    try:
        # No prompt yet: a reach past every window, so only their form is checked.
        check_steering(value, cfg, hidden_size, None, sys.maxsize)
    except ValueError as e:
        raise invalid_request(str(e), STEERING_PARAM) from None
