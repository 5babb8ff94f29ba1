# SPDX-License-Identifier: Apache-2.0
"""Resolve a request's ``steering`` in the front-end.

Called from ``InputProcessor.process_inputs`` (patch 0004) for every request
whose ``SamplingParams.steering`` is set, before anything reaches the engine:
the interventions are checked (:func:`vllm_hidden_states.steering.
check_steering`, the rules HTTP applies too), written back in their wire form
on the request's own ``SamplingParams`` (the front-end's clone), and the
request's cache salt gains the steering digest. A bad request fails alone
with a ``VLLMValidationError`` (HTTP 400) naming what is allowed.
"""

from typing import TYPE_CHECKING

from vllm_hidden_states.hidden_states_config import HiddenStatesConfig, built_once
from vllm_hidden_states.steering import (
    ENABLE_STEERING_HINT,
    SteeringConfig,
    check_steering,
    read_after_steering,
    salted,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams


def resolve_steering(
    vllm_config: "VllmConfig",
    params: "SamplingParams",
    prompt_len: int,
    cache_salt: str | None,
) -> str:
    """Check ``params.steering``, replace it by its wire form; the request's
    cache salt (its own, if any, with the steering digest)."""
    from vllm.exceptions import VLLMValidationError

    cfg = built_once(SteeringConfig, vllm_config)
    if cfg is None:
        raise VLLMValidationError(
            f"steering is not enabled on this engine; {ENABLE_STEERING_HINT}",
            parameter="steering",
        )
    max_model_len = vllm_config.model_config.max_model_len
    max_tokens = params.max_tokens
    reach = max_model_len if max_tokens is None else min(max_model_len, prompt_len + max_tokens)
    try:
        wire = check_steering(
            params.steering, cfg, vllm_config.model_config.get_hidden_size(), prompt_len, reach
        )
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter="steering") from None
    hidden_states = built_once(HiddenStatesConfig, vllm_config)
    sae_hook = ((hidden_states and hidden_states.sae) or {}).get("hook_name")
    points = params.hidden_states_points if params.return_hidden_states else None
    problem = read_after_steering(
        wire, points, cfg.num_layers, sae_hook, sae_features=params.sae_features is not None
    )
    if problem is not None:
        raise VLLMValidationError(problem, parameter="steering")
    params.steering = wire
    return salted(cache_salt, wire)
