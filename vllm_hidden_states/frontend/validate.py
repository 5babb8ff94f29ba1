# SPDX-License-Identifier: Apache-2.0
"""Resolve a request's hidden-state fields into a :class:`HiddenStatesSpec`.

Called from ``InputProcessor.process_inputs`` (patch 0004) for every request
whose ``SamplingParams`` set any of the package's fields
(``SamplingParams.asks_hidden_states``: ``return_hidden_states``,
``hidden_states_layers``, ``hidden_states_points``, ``sae_features``; the
last implies the first),
before anything reaches the engine.

``sae_features={"top_k": k}`` (engine with ``--sae``) asks for the SAE's k
strongest features at the positions ``hidden_states_positions`` names; full
hidden states then come only for the layers ``hidden_states_layers`` names
(none by default), so a features-only request ships k ids + k values per
position and nothing else. A bad request
fails alone here with a ``VLLMValidationError`` (HTTP 400 on the server) that
names what is allowed; the engine never sees it.
"""

from typing import TYPE_CHECKING

from vllm_hidden_states.hidden_states_config import (
    HiddenStatesConfig,
    built_once,
    captures_all_inline,
)
from vllm_hidden_states.points import Window, is_neuron_id, is_pattern_id, window_of
from vllm_hidden_states.request_fields import (
    ENABLE_HINT,
    SAE_HINT,
    check_layers,
    check_points,
    check_positions,
    check_sae_features,
    window_problem,
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

    if not params.return_hidden_states and params.sae_features is None:
        for name in ("hidden_states_layers", "hidden_states_points"):
            if getattr(params, name) is not None:
                raise VLLMValidationError(
                    f"{name} was given but return_hidden_states is not set; pass "
                    "return_hidden_states=True",
                    parameter=name,
                )
        return None

    cfg = built_once(HiddenStatesConfig, vllm_config)
    if cfg is None and params.sae_features is not None:
        sae_top_k_of(HiddenStatesConfig(0, ()), params.sae_features)  # raises
    if cfg is None:
        raise VLLMValidationError(
            f"hidden states are not enabled on this engine; {ENABLE_HINT}",
            parameter="return_hidden_states",
        )
    if resumable:
        raise VLLMValidationError(
            "return_hidden_states is not supported on streaming-input (resumable) requests yet",
            parameter="return_hidden_states",
        )
    if has_mm or has_prompt_embeds:
        raise VLLMValidationError(
            "hidden states for multimodal or prompt-embeds prompts are not "
            "supported yet; send token or text prompts",
            parameter="return_hidden_states",
        )
    try:
        positions = check_positions(params.hidden_states_positions)
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter="hidden_states_positions") from None
    sae_top_k = 0
    if params.sae_features is not None:
        sae_top_k = sae_top_k_of(cfg, params.sae_features)
    try:
        asked = check_points(params.hidden_states_points)
        asked_ids = cfg.resolve_points(asked)
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter="hidden_states_points") from None
    # Attention patterns and MLP neurons travel apart from the residual rows.
    n = cfg.num_layers
    kinds = [
        "pattern" if is_pattern_id(k, n) else "neuron" if is_neuron_id(k, n) else "row"
        for k in asked_ids
    ]
    points = [a for a, kind in zip(asked, kinds) if kind == "row"]
    point_ids = [k for k, kind in zip(asked_ids, kinds) if kind == "row"]
    patterns = [a for a, kind in zip(asked, kinds) if kind == "pattern"]
    pattern_ids = [k for k, kind in zip(asked_ids, kinds) if kind == "pattern"]
    neurons = [a for a, kind in zip(asked, kinds) if kind == "neuron"]
    neuron_ids = [k for k, kind in zip(asked_ids, kinds) if kind == "neuron"]
    try:
        # With sae_features or points, full states only for the layers named.
        layers = check_layers(
            params.hidden_states_layers, features_only=bool(sae_top_k), points=bool(asked)
        )
        abs_layers = cfg.resolve_all(layers)
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter="hidden_states_layers") from None
    # "generated" and windows are "all" over part of the positions.
    window = window_of(positions, prompt_len)
    if patterns and positions == "prompt":
        window = Window(0, prompt_len)  # served by the recomputing extract
    kind = "all" if window is not None else positions
    # Patterns need every key: one extract recomputes every position.
    inline = kind == "all" and captures_all_inline(vllm_config) and not patterns
    spec = HiddenStatesSpec(
        layers=layers,
        abs_layers=abs_layers + point_ids,
        positions=kind,
        inline=inline,
        sae_top_k=sae_top_k,
        sae_layer=cfg.sae_layer if sae_top_k else 0,
        points=points,
        sae_point=(cfg.sae.get("point") or "") if sae_top_k and cfg.sae else "",
        start=0 if window is None else window.start,
        end=None if window is None else window.end,
        patterns=patterns,
        pattern_ids=pattern_ids,
        neurons=neurons,
        neuron_ids=neuron_ids,
    )

    if patterns:
        _check_pattern_budget(params, prompt_len)
    if kind == "prompt" or (inline and spec.start < prompt_len):
        # Captured during the request's own prefill, so every prompt position
        # asked must be computed there: cached blocks hold KV, not hidden states.
        params.skip_reading_prefix_cache = True
    if kind == "prompt":
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
    if window is not None:
        reach = prompt_len + (room if params.max_tokens is None else params.max_tokens)
        if (problem := window_problem(window, prompt_len, reach)) is not None:
            raise VLLMValidationError(problem, parameter="hidden_states_positions")
    return spec


def sae_top_k_of(cfg: HiddenStatesConfig, sae_features) -> int:
    """``k`` of ``sae_features={"top_k": k}``; ``VLLMValidationError`` naming
    what is allowed (an engine SAE, ``1 <= k <= d_sae``)."""
    from vllm.exceptions import VLLMValidationError

    if cfg.sae is None:
        raise VLLMValidationError(
            f"sae_features needs an SAE on this engine; {SAE_HINT}", parameter="sae_features"
        )
    try:
        return check_sae_features(sae_features, cfg.sae["d_sae"])
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter="sae_features") from None


def _check_pattern_budget(params, prompt_len: int) -> None:
    """Refuse a pattern request whose sequence could pass
    :data:`vllm_hidden_states.points.MAX_PATTERN_POSITIONS`: a pattern is
    ``[heads, positions, keys]``, square in the sequence length."""
    from vllm.exceptions import VLLMValidationError
    from vllm_hidden_states.points import MAX_PATTERN_POSITIONS

    reach = prompt_len + (params.max_tokens or 0) + 1
    if reach > MAX_PATTERN_POSITIONS:
        raise VLLMValidationError(
            f"attention patterns are at most {MAX_PATTERN_POSITIONS} positions long "
            f"([heads, positions, positions] per point); this request reaches "
            f"{reach} (prompt {prompt_len} + max_tokens); lower max_tokens or shorten "
            "the prompt",
            parameter="hidden_states_points",
        )
