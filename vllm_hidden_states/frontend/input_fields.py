# SPDX-License-Identifier: Apache-2.0
"""The InputProcessor's call-outs: a request's hidden-state and steering fields.

Called from ``InputProcessor.process_inputs`` (patch 0004) before anything
reaches the engine. :func:`resolve_request` applies the one resolver
(``request_fields.py``, which HTTP applies too) and the rules that need the
tokenized prompt, and builds the request's :class:`HiddenStatesSpec`;
:func:`resolve_steering` checks ``steering`` (``steering.check_steering``) and
writes its wire form back. A bad request fails alone with a
``VLLMValidationError`` (HTTP 400 on the server) naming the field and what is
allowed; the engine never sees it.
"""

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from vllm_hidden_states.contract import Intervention, SteerGate
from vllm_hidden_states.hidden_states_config import (
    HiddenStatesConfig,
    built_once,
    captures_all_inline,
    num_hidden_layers,
)
from vllm_hidden_states.layers import deepstack_layers, multimodal_prompt_problem
from vllm_hidden_states.points import (
    MAX_PATTERN_POSITIONS,
    Window,
    address_kind,
    is_head_address,
    parse_point,
    window_of,
)
from vllm_hidden_states.probe_actions import STEER
from vllm_hidden_states.request_fields import (
    AskedStates,
    FieldError,
    RequestFields,
    asks_states,
    resolve_fields,
    window_problem,
)
from vllm_hidden_states.steering_config import STEERING_OFF, SteeringConfig
from vllm_hidden_states.steering_fields import check_steering, read_after_steering, salted
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
    """The request's :class:`HiddenStatesSpec`, or None if it asks for none.

    Raises ``VLLMValidationError`` naming the field and what is allowed. May
    lower ``params.max_tokens``: the final token's state needs one more
    position, so prompt + output must stay below max_model_len. For prompt
    positions captured in the request's own prefill it sets
    ``params.skip_reading_prefix_cache`` (cached blocks hold KV, not states).
    """
    from vllm.exceptions import VLLMValidationError

    fields = RequestFields.of(params)
    try:
        if not asks_states(fields):
            return None
        asked = resolve_fields(built_once(HiddenStatesConfig, vllm_config), fields)
    except FieldError as e:
        raise VLLMValidationError(str(e), parameter=e.parameter) from None
    if resumable:
        raise VLLMValidationError(
            "return_hidden_states is not supported on streaming-input (resumable) requests yet",
            parameter="return_hidden_states",
        )
    if has_prompt_embeds:
        raise VLLMValidationError(
            "hidden states for prompt-embeds prompts are not supported yet; send token, "
            "text or image prompts",
            parameter="return_hidden_states",
        )
    if has_mm:
        _check_multimodal_prompt(vllm_config, asked)
    cfg = built_once(HiddenStatesConfig, vllm_config)
    assert cfg is not None  # resolve_fields refuses an engine without hidden states
    positions = asked.positions
    # "generated" and windows are "all" over part of the positions.
    window = window_of(positions, prompt_len)
    if asked.patterns and positions == "prompt":
        window = Window(0, prompt_len)  # served by the recomputing extract
    kind = "all" if window is not None else positions
    assert isinstance(kind, str)  # every window is "all" over part of the positions
    # Patterns need every key: one extract recomputes every position.
    inline = kind == "all" and captures_all_inline(vllm_config) and not asked.patterns
    spec = HiddenStatesSpec(
        layers=list(asked.layers),
        abs_layers=[*asked.abs_layers, *asked.point_ids],
        positions=kind,
        inline=inline,
        sae_top_k=asked.sae_top_k,
        sae_layer=(cfg.sae_layer or 0) if asked.sae_top_k else 0,
        points=list(asked.points),
        sae_point=(cfg.sae.get("point") or "") if asked.sae_top_k and cfg.sae else "",
        start=0 if window is None else window.start,
        end=None if window is None else window.end,
        patterns=list(asked.patterns),
        pattern_ids=list(asked.pattern_ids),
        neurons=list(asked.neurons),
        neuron_ids=list(asked.neuron_ids),
        probes=list(asked.probes),
        probe_widths=[cfg.probes[name]["k"] for name in asked.probes],
        probe_actions=list(asked.probe_actions),
        probes_returned=asked.probes_returned,
        returns=asked.returns,
        neuron_heads=_neuron_heads(vllm_config, asked.neurons),
    )
    gated: list[Intervention] = []
    if asked.probe_actions:
        _check_probe_actions(vllm_config, spec)
        if any(a.then == STEER for a in spec.probe_actions):
            gated = _gate_steering(vllm_config, spec, prompt_len)

    if asked.patterns:
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
    if gated:
        # Every check passed: resolve_steering, called next, takes them in.
        if params.steering is None:
            params.steering = []
        _GATED[id(params)] = (params, gated)
    return spec


def _check_multimodal_prompt(vllm_config: "VllmConfig", asked: AskedStates) -> None:
    """Refuse hidden states of a prompt with images on a model whose image
    path is not verified; on Qwen3-VL, the layers where HF's hidden_states
    and the stream a layer reads differ at image positions (deepstack); and
    (its extract replays the images from the engine's request, which a KV
    connector frees elsewhere) positions that need an extract beside a KV
    connector."""
    from vllm.exceptions import VLLMValidationError

    model_config = vllm_config.model_config
    problem = multimodal_prompt_problem(model_config)
    if problem is not None:
        raise VLLMValidationError(problem, parameter="return_hidden_states")
    deepstack = deepstack_layers(model_config)
    if deepstack:
        n = num_hidden_layers(vllm_config)
        mixed = [f"layer {k}" for k in asked.abs_layers if 1 <= k <= deepstack]
        mixed += [a for a in asked.points if _is_post(a, n) and parse_point(a, n)[1] < deepstack]
        if mixed:
            raise VLLMValidationError(
                f"{mixed[0]} of a prompt with images: this model adds visual features "
                f"(deepstack) to the stream after decoder layers 0..{deepstack - 1}, at "
                "image positions; HF's hidden_states[k] and resid_post.(k-1) there are "
                "before the add, which this engine does not read; resid_pre.k (what "
                "layer k reads, the features added) is served for every k, and layers "
                f"0 and {deepstack + 1}..{n} as HF's",
                parameter="hidden_states_layers"
                if mixed[0].startswith("layer")
                else ("hidden_states_points"),
            )
    if vllm_config.kv_transfer_config is not None and asked.positions != "prompt":
        raise VLLMValidationError(
            "with a KV connector, hidden states of a prompt with images are served "
            "for positions 'prompt' only",
            parameter="hidden_states_positions",
        )


def _check_probe_actions(vllm_config: "VllmConfig", spec: HiddenStatesSpec) -> None:
    """Refuse probe actions where the engine cannot decide them in the step
    that computes each position: positions not captured as they are computed
    (this engine's mode, or attention patterns asked beside), and speculative
    decoding (untested, as for steering)."""
    from vllm.exceptions import VLLMValidationError

    if vllm_config.speculative_config is not None:
        raise VLLMValidationError(
            "probe_actions are not supported with speculative decoding yet; start "
            "the engine without a speculative config to use them",
            parameter="probe_actions",
        )
    if not spec.inline:
        why = (
            "attention patterns, asked beside them, are computed after the request"
            if spec.pattern_ids
            else "this engine captures them after the request finishes"
        )
        raise VLLMValidationError(
            "probe_actions need the request's positions scored in the step that "
            f"computes them; {why}: ask for them in a request of their own",
            parameter="probe_actions",
        )


# The gated steering of a request being processed, from resolve_request to
# resolve_steering (called right after it on the same SamplingParams, patch
# 0004, when steering is not None, which resolve_request makes it), by
# id(params) with the params themselves (no id reuse while held): wire
# entries no client can write itself.
_GATED: dict[int, tuple["SamplingParams", list[Intervention]]] = {}


def _gate_steering(
    vllm_config: "VllmConfig", spec: HiddenStatesSpec, prompt_len: int
) -> list[Intervention]:
    """The interventions of the request's steer actions in wire form, each
    entry gated (``gate``: its action's condition) and on from the first
    generated position; they join the
    request's ``steering`` in :func:`resolve_steering` (which salts the
    cache with them). Refused without steering on this engine, or where
    check_steering refuses an intervention."""
    from vllm.exceptions import VLLMValidationError

    cfg = built_once(SteeringConfig, vllm_config)
    steers = [(i, a) for i, a in enumerate(spec.probe_actions) if a.then == STEER]
    if cfg is None:
        raise VLLMValidationError(
            f"probe_actions[{steers[0][0]}]: 'then': {{'steer': ...}} needs steering; "
            f"{STEERING_OFF}; or use 'then': 'stop' or 'flag'",
            parameter="probe_actions",
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        # The gate is moved where the probes are scored (the last stage); the
        # steered points of the other stages would never see it.
        raise VLLMValidationError(
            f"probe_actions[{steers[0][0]}]: 'then': {{'steer': ...}} is not supported with "
            "pipeline parallelism yet; use 'then': 'stop' or 'flag', or one pipeline stage",
            parameter="probe_actions",
        )
    hidden_size = vllm_config.model_config.get_hidden_size()
    starts = [0]
    for width in spec.probe_widths:
        starts.append(starts[-1] + width)
    gated: list[Intervention] = []
    for i, action in steers:
        try:
            wire = check_steering(action.steer, cfg, hidden_size, prompt_len, sys.maxsize)
        except ValueError as e:
            message = str(e).replace("steering[", "then.steer[")
            raise VLLMValidationError(
                f"probe_actions[{i}]: {message}", parameter="probe_actions"
            ) from None
        column = starts[spec.probes.index(action.probe)] + action.column
        gate = SteerGate(i, column, action.threshold, action.above, action.consecutive)
        for item in wire:
            gated.append(msgspec.structs.replace(item, start=prompt_len, end=None, gate=gate))
    return gated


def _is_post(address: str, num_layers: int) -> bool:
    try:
        return parse_point(address, num_layers)[0] == "resid_post"
    except ValueError:
        return False


def _check_pattern_budget(params: "SamplingParams", prompt_len: int) -> None:
    """Refuse a pattern request whose sequence could pass
    :data:`~vllm_hidden_states.points.MAX_PATTERN_POSITIONS`: a pattern is
    ``[heads, positions, keys]``, square in the sequence length."""
    from vllm.exceptions import VLLMValidationError

    reach = prompt_len + (params.max_tokens or 0) + 1
    if reach > MAX_PATTERN_POSITIONS:
        raise VLLMValidationError(
            f"attention patterns are at most {MAX_PATTERN_POSITIONS} positions long "
            f"([heads, positions, positions] per point); this request reaches "
            f"{reach} (prompt {prompt_len} + max_tokens); lower max_tokens or shorten "
            "the prompt",
            parameter="hidden_states_points",
        )


def resolve_steering(
    vllm_config: "VllmConfig",
    params: "SamplingParams",
    prompt_len: int,
    cache_salt: str | None,
) -> str:
    """Check ``params.steering`` and replace it by its wire form, on the
    request's own ``SamplingParams`` (the front-end's clone); the request's
    cache salt (its own, if any, with the steering digest), so a steered
    request never shares KV blocks with one steered otherwise."""
    from vllm.exceptions import VLLMValidationError

    held = _GATED.pop(id(params), None)
    gated = held[1] if held is not None and held[0] is params else []
    cfg = built_once(SteeringConfig, vllm_config)
    if cfg is None:
        raise VLLMValidationError(STEERING_OFF, parameter="steering")
    max_model_len = vllm_config.model_config.max_model_len
    max_tokens = params.max_tokens
    reach = max_model_len if max_tokens is None else min(max_model_len, prompt_len + max_tokens)
    wire: list[Intervention] = []
    if params.steering or not gated:
        try:
            wire = check_steering(
                params.steering, cfg, vllm_config.model_config.get_hidden_size(), prompt_len, reach
            )
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter="steering") from None
    if gated:
        _check_gated(wire, gated, cfg)
        wire = [*wire, *gated]
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


def _check_gated(wire: list[Intervention], gated: list[Intervention], cfg: SteeringConfig) -> None:
    """A steer action's point is steered by that action alone (its table
    row is switched on as a whole), and all the request's interventions fit
    --max-steering."""
    from vllm.exceptions import VLLMValidationError

    owner: dict[int, str] = {item.id: "the request's steering" for item in wire}
    for item in gated:
        assert item.gate is not None  # _gate_steering gates every entry
        mine = f"probe_actions[{item.gate.action}]"
        other = owner.setdefault(item.id, mine)
        if other != mine:
            raise VLLMValidationError(
                f"{mine}: then.steer at {item.point!r}: {other} steers that point too; "
                "a steer action's points must be steered by it alone",
                parameter="probe_actions",
            )
    total = len(wire) + len(gated)
    if total > cfg.max_interventions:
        raise VLLMValidationError(
            f"probe_actions: steering and steer actions hold {total} interventions; this "
            f"engine allows at most {cfg.max_interventions} per request (--max-steering)",
            parameter="probe_actions",
        )


def _neuron_heads(vllm_config: "VllmConfig", points: "Sequence[str]") -> list[int]:
    """The heads of each wide point whose rows are returned per head,
    ``[positions, heads, head_dim]`` (0: returned flat): the query heads for
    attn_z and q, the KV heads for k and v (one row per KV head under GQA;
    vLLM's count, which reads each family's own config field: Falcon's
    multi_query has one, whatever its num_kv_heads says)."""
    if not any(map(is_head_address, points)):
        return []
    model_config = vllm_config.model_config
    heads = int(model_config.hf_text_config.num_attention_heads)
    kv_heads = int(model_config.get_total_num_kv_heads())
    return [
        (kv_heads if address_kind(p) in ("k", "v") else heads) if is_head_address(p) else 0
        for p in points
    ]
