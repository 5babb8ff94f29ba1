# SPDX-License-Identifier: Apache-2.0
"""Resolve a request's hidden-state fields into a :class:`HiddenStatesSpec`.

Called from ``InputProcessor.process_inputs`` (patch 0004) for every request
whose ``SamplingParams`` set ``return_hidden_states`` or
``hidden_states_layers``, before anything reaches the engine. A bad request
fails alone here with a ``VLLMValidationError`` (HTTP 400 on the server) that
names what is allowed; the engine never sees it.
"""

from typing import TYPE_CHECKING

from vllm_hidden_states.config import (
    DEFAULT_LAYERS,
    ENABLE_HINT,
    POSITIONS,
    HiddenStatesConfig,
    captures_all_inline,
)
from vllm_hidden_states.wire import HiddenStatesSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams


def resolve_request(
    vllm_config: "VllmConfig",
    params: "SamplingParams",
    prompt_len: int,
    has_mm: bool,
    has_prompt_embeds: bool,
    resumable: bool = False,
) -> HiddenStatesSpec | None:
    """Validate a request's hidden-state fields; the spec, or None if not asked.

    Raises ``VLLMValidationError`` naming what is allowed. May lower
    ``params.max_tokens``: the final token's state needs one more position, so
    prompt + output must stay below max_model_len. For "prompt" it sets
    ``params.skip_reading_prefix_cache`` (every prompt position is computed).
    """
    from vllm.exceptions import VLLMValidationError

    if not params.return_hidden_states:
        if params.hidden_states_layers is not None:
            raise VLLMValidationError(
                "hidden_states_layers was given but return_hidden_states is not "
                "set; pass return_hidden_states=True",
                parameter="hidden_states_layers",
            )
        return None

    cfg = HiddenStatesConfig.from_vllm_config(vllm_config)
    if cfg is None:
        raise VLLMValidationError(
            f"hidden states are not enabled on this engine; {ENABLE_HINT}",
            parameter="return_hidden_states",
        )
    if resumable:
        raise VLLMValidationError(
            "return_hidden_states is not supported on streaming-input "
            "(resumable) requests yet",
            parameter="return_hidden_states",
        )
    if has_mm or has_prompt_embeds:
        raise VLLMValidationError(
            "hidden states for multimodal or prompt-embeds prompts are not "
            "supported yet; send token or text prompts",
            parameter="return_hidden_states",
        )
    positions = params.hidden_states_positions
    if positions not in POSITIONS:
        raise VLLMValidationError(
            f"hidden_states_positions must be one of {list(POSITIONS)}, "
            f"got {positions!r}",
            parameter="hidden_states_positions",
        )
    layers = params.hidden_states_layers
    if layers is None:
        layers = list(DEFAULT_LAYERS)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise VLLMValidationError(
            f"hidden_states_layers must be a non-empty list of integers, "
            f"got {layers!r}",
            parameter="hidden_states_layers",
        )
    try:
        abs_layers = [cfg.resolve(k) for k in layers]
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter="hidden_states_layers") from None
    inline = positions == "all" and captures_all_inline(vllm_config)
    spec = HiddenStatesSpec(
        layers=[int(k) for k in layers],
        abs_layers=abs_layers,
        positions=positions,
        inline=inline,
    )

    if positions == "prompt" or inline:
        # Captured during the request's own prefill, so every prompt position
        # must be computed there: cached blocks hold KV, not hidden states.
        params.skip_reading_prefix_cache = True
    if positions == "prompt":
        return spec

    max_model_len = vllm_config.model_config.max_model_len
    room = max_model_len - 1 - prompt_len
    if room < 1:
        raise VLLMValidationError(
            f"the prompt has {prompt_len} tokens; with return_hidden_states the "
            f"prompt plus at least one generated token must stay below "
            f"max_model_len={max_model_len}",
            parameter="return_hidden_states",
        )
    if params.max_tokens is not None and params.max_tokens > room:
        # The final token's state is computed by a prefill over prompt + output,
        # which needs that token's position to exist: cap output one short of
        # max_model_len rather than return a state for the wrong token.
        params.max_tokens = room
    return spec
