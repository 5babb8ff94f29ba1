# SPDX-License-Identifier: Apache-2.0
"""The request side of /v1/chat/completions and /v1/completions.

vLLM's serving code calls this module at named sites (patch
``0009-openai-serving``, one line each): :func:`admit` parses the request's
hidden-state fields (OpenAI extras, ``model_extra``), ``steering`` and
``sae_features`` and ``probes`` once, checks them against the engine and prices the response
before anything is tokenized; :func:`price` prices "all"/"prompt" responses
exactly once each prompt is sized; :func:`ask_engine` puts the fields onto
``SamplingParams``; :func:`refuse` answers the routes that cannot carry them
(/v1/responses, /v1/messages, /v1/chat/completions/batch) with a 400. The
fields and their answers are told in docs/openai_server.md; the response side
is :mod:`.openai_response`.
"""

import contextvars
from dataclasses import dataclass
from typing import Any

import orjson

from vllm_hidden_states.points import (
    Positions,
    Window,
    address_kind,
    is_pattern_address,
    is_wide_address,
)
from vllm_hidden_states.probe_actions import check_probe_actions
from vllm_hidden_states.request_fields import (
    IMPLYING_FIELDS,
    REQUEST_FIELDS,
    FieldError,
    RequestFields,
    asks_states,
    check_layers,
    check_points,
    check_positions,
    check_probes,
    check_sae_features,
    checked,
    positions_for_actions,
    refuse_without_flag,
    resolve_fields,
    window_problem,
)
from vllm_hidden_states.server.encoding import ENCODING_FORMATS
from vllm_hidden_states.server.errors import ApiError, invalid_request
from vllm_hidden_states.server.limits import (
    Limits,
    ResponseSize,
    check_batch,
    check_input_chars,
    check_response,
    limits_of,
    text_chars,
)
from vllm_hidden_states.server.monitors import monitors_loaded, put_monitors
from vllm_hidden_states.server.request_checks import (
    STEERING_PARAM,
    engine_config,
    steering_config,
    validate_steering,
)
from vllm_hidden_states.server.stored_rows import has_store_refs, resolve_store_refs
from vllm_hidden_states.steering_config import z_head_dim
from vllm_hidden_states.store import choice_writer

# The response object of each of q, k, v's rows.
QKV_OBJECTS: dict[str, str] = {"q": "queries", "k": "keys", "v": "values"}


@dataclass(frozen=True)
class HiddenStatesAsk:
    """What a chat/completions request asked for (already type-checked)."""

    layers: tuple[int, ...]
    encoding_format: str
    positions: "Positions | Window" = "last"
    stream: bool = False  # rows on every SSE chunk ("all", "generated", windows)
    sae_top_k: int = 0  # sae_features: {"top_k": k}; 0 = not asked
    points: tuple[str, ...] = ()  # hidden_states_points, as given (rows)
    patterns: tuple[str, ...] = ()  # hidden_states_points of attention patterns
    # hidden_states_points of their own width: MLP neurons (mlp_post) and
    # heads' outputs (attn_z), answered as the neurons / head_outputs objects.
    neurons: tuple[str, ...] = ()
    heads: tuple[int, ...] | None = None  # hidden_states_heads; None = every head
    probes: tuple[str, ...] = ()  # probes: names of the engine's probes to score
    # probe_actions as given (checked by the one resolver); their probes are
    # in ``probes`` too (scores returned).
    probe_actions: tuple[Any, ...] = ()

    @property
    def positions_json(self) -> Any:
        """``positions`` as the response names it."""
        return self.positions.as_json() if isinstance(self.positions, Window) else self.positions

    @property
    def every_position(self) -> bool:
        """Rows of every position asked ("all", "generated", a window), not
        one ("last") nor the prompt's only."""
        return self.positions not in ("last", "prompt")

    def first_position(self, prompt_len: int) -> int:
        """The position of a choice's first row."""
        if isinstance(self.positions, Window):
            return self.positions.start
        return prompt_len if self.positions == "generated" else 0

    @property
    def wide_objects(self) -> dict[str, tuple[str, ...]]:
        """The response objects of ``neurons``, each with its points in
        request order: ``neurons`` (mlp_post, intermediate_size wide),
        ``head_outputs`` (attn_z, heads * head_dim wide), ``queries`` (q),
        ``keys`` (k) and ``values`` (v) (one object each: a point's heads are
        the query heads for q, the KV heads for k and v); only those asked."""
        kinds = {p: address_kind(p) for p in self.neurons}
        objects = (
            ("neurons", tuple(p for p in self.neurons if kinds[p] == "mlp_post")),
            ("head_outputs", tuple(p for p in self.neurons if kinds[p] == "attn_z")),
            *(
                (name, tuple(p for p in self.neurons if kinds[p] == kind))
                for kind, name in QKV_OBJECTS.items()
            ),
        )
        return {name: points for name, points in objects if points}

    @property
    def keys(self) -> tuple[int | str, ...]:
        """The rows of ``hidden_states``, in order: the layers, then the points."""
        return (*self.layers, *self.points)


def _field(rule: Any, parameter: str, *args: Any) -> Any:
    """``rule(*args)`` of the one resolver (``request_fields.checked``), its
    :class:`FieldError` as this route's 400."""
    try:
        return checked(rule, parameter, *args)
    except FieldError as e:
        raise invalid_request(str(e), e.parameter) from None


def _one_of(extra: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    """``extra[name]``, one of ``allowed`` (the first when absent or null)."""
    value = extra.get(name)
    if value is None:
        return allowed[0]
    if value not in allowed:
        raise invalid_request(f"{name} must be one of {list(allowed)}, got {value!r}", name)
    return value


def parse_ask(extra: dict[str, Any] | None) -> HiddenStatesAsk | None:
    """The request's hidden-state fields; None when it did not ask.

    Raises :class:`ApiError` (400) for malformed fields. Whether the layers
    exist on this engine is checked by :func:`validate_ask`.
    """
    if not extra or all(extra.get(f) is None for f in REQUEST_FIELDS):
        return None
    fields = RequestFields.of(extra)
    if not _field(asks_states, "return_hidden_states", fields):
        # The fields only HTTP has, given without the flag: the same refusal.
        for name in REQUEST_FIELDS[1:]:
            if name not in IMPLYING_FIELDS and extra.get(name) not in (None, False):
                _field(refuse_without_flag, name, name)
        return None
    sae_top_k = 0
    if fields.sae_features is not None:
        sae_top_k = _field(check_sae_features, "sae_features", fields.sae_features)
        if fields.return_hidden_states is False:
            raise invalid_request(
                "sae_features needs hidden states captured; drop "
                "return_hidden_states: false (sae_features alone is enough)",
                "return_hidden_states",
            )
    probes = () if fields.probes is None else tuple(_field(check_probes, "probes", fields.probes))
    actions = _probe_actions_of(fields.probe_actions)
    probes = (*probes, *dict.fromkeys(a["probe"] for a in actions if a["probe"] not in probes))
    points = _field(check_points, "hidden_states_points", fields.hidden_states_points)
    # With sae_features, probes or points, full states only for the layers named.
    layers = _field(
        check_layers,
        "hidden_states_layers",
        fields.hidden_states_layers,
        bool(sae_top_k or probes),
        bool(points),
    )
    fmt = _one_of(extra, "hidden_states_format", ENCODING_FORMATS)
    positions = _field(
        check_positions,
        "hidden_states_positions",
        "last" if fields.hidden_states_positions is None else fields.hidden_states_positions,
    )
    if actions:
        positions = _field(positions_for_actions, "hidden_states_positions", positions)
    stream = extra.get("hidden_states_stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise invalid_request(
            f"hidden_states_stream must be true or false, got {stream!r}",
            "hidden_states_stream",
        )
    if stream and positions in ("last", "prompt"):
        raise invalid_request(
            "hidden_states_stream streams the rows of every position as they "
            "are computed, so it needs hidden_states_positions 'all', "
            f"'generated' or a window (got {positions!r})",
            "hidden_states_stream",
        )
    patterns = tuple(p for p in points if is_pattern_address(p))
    if patterns and stream:
        raise invalid_request(
            "attention patterns come once, on the finish chunk: drop "
            "hidden_states_stream, or ask for the patterns in a separate request",
            "hidden_states_stream",
        )
    heads = extra.get("hidden_states_heads")
    if heads is not None:
        if (
            not isinstance(heads, list)
            or not heads
            or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in heads)
            or len(set(heads)) != len(heads)
        ):
            raise invalid_request(
                "hidden_states_heads must be a non-empty list of distinct query-head "
                f"indices (integers >= 0), got {heads!r}",
                "hidden_states_heads",
            )
        if not patterns:
            raise invalid_request(
                "hidden_states_heads selects the query heads of attention patterns; "
                "ask for one in hidden_states_points (e.g. 'attn_pattern.3')",
                "hidden_states_heads",
            )
    neurons = tuple(p for p in points if is_wide_address(p))
    return HiddenStatesAsk(
        tuple(layers),
        fmt,
        positions,
        stream,
        sae_top_k,
        points=tuple(p for p in points if p not in patterns and p not in neurons),
        patterns=patterns,
        neurons=neurons,
        heads=None if heads is None else tuple(heads),
        probes=probes,
        probe_actions=actions,
    )


def _probe_actions_of(value: Any) -> tuple[dict[str, Any], ...]:
    """``probe_actions`` as given, when it has the request form's shape (a
    list of objects naming a probe); else the one resolver's error."""
    if value is None:
        return ()
    if isinstance(value, list) and all(
        isinstance(a, dict) and isinstance(a.get("probe"), str) for a in value
    ):
        return tuple(value)
    _field(check_probe_actions, "probe_actions", value, {})
    raise AssertionError("check_probe_actions accepted a malformed value")


def ask_of(request: Any) -> HiddenStatesAsk | None:
    """:func:`parse_ask` on a vLLM OpenAI request model's extra fields."""
    return parse_ask(request.model_extra)


def fields_of(request: Any) -> RequestFields:
    """The hidden-state fields of a vLLM OpenAI request model, as given."""
    return RequestFields.of(request.model_extra or {})


def validate_ask(serving: Any, request: Any, raw_request: Any = None) -> HiddenStatesAsk | None:
    """Parse, check and price a chat/completions request against the engine,
    before anything is tokenized or generated (see :mod:`.limits`)."""
    ask = ask_of(request)
    if ask is None:
        return None
    engine_client = serving.engine_client
    # The engine's rules, through the one resolver the Python API applies.
    cfg = engine_config(engine_client)
    _field(resolve_fields, "return_hidden_states", cfg, fields_of(request))
    if ask.heads is not None:
        num_heads = int(engine_client.model_config.hf_text_config.num_attention_heads)
        if max(ask.heads) >= num_heads:
            raise invalid_request(
                f"hidden_states_heads {list(ask.heads)}: this model has {num_heads} "
                f"query heads (0..{num_heads - 1})",
                "hidden_states_heads",
            )
    if getattr(request, "use_beam_search", False):
        raise invalid_request(
            "return_hidden_states is not supported with use_beam_search",
            "use_beam_search",
        )
    if ask.stream and not getattr(request, "stream", False):
        raise invalid_request(
            "hidden_states_stream puts rows on the chunks of a streamed "
            "response; set stream: true, or drop hidden_states_stream to get "
            "every position on the response",
            "hidden_states_stream",
        )
    limits = limits_of(raw_request)
    n = getattr(request, "n", None) or 1
    if hasattr(request, "messages"):
        source, prompts = "messages", 1
    else:
        source = "prompt"
        prompt = getattr(request, "prompt", None)
        prompts = (
            len(prompt)
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            else 1
        )
    value = getattr(request, source, None)
    check_input_chars(limits, text_chars(value, limits.max_input_chars), source)
    results = prompts * n
    check_batch(limits, results, "n", "choices (prompts x n)")
    # "last": one position per result, exact. "all"/"prompt": at least one
    # (a lower bound); the exact price follows tokenization (:func:`price`).
    check_response(
        limits,
        ResponseSize(
            results=results,
            positions=1,
            layers=len(ask.keys),
            hidden_size=engine_client.model_config.get_hidden_size(),
            sae_top_k=ask.sae_top_k,
            probe_outputs=probe_outputs(cfg, ask),
        ),
        ask.encoding_format,
        "hidden_states_layers",
        "ask for fewer layers or choices or a smaller top_k, or use hidden_states_format 'base64'",
    )
    return ask


def probe_outputs(cfg: Any, ask: HiddenStatesAsk) -> int:
    """Probe scores per position of ``ask`` (the sum of its probes' k)."""
    return sum(cfg.probes[name]["k"] for name in ask.probes) if ask.probes else 0


@dataclass
class PositionPricing:
    """The response budget of one "all"/"prompt" request, spent per prompt as
    vLLM sizes each (``get_max_tokens``, right after tokenization)."""

    limits: Limits
    ask: HiddenStatesAsk
    n: int
    hidden_size: int
    spent_positions: int = 0
    heads: int = 0  # query heads: an attention pattern is [heads, queries, keys]
    intermediate: int = 0  # an mlp_post row's width
    z_width: int = 0  # an attn_z (and q) row's width (heads * head_dim)
    kv_width: int = 0  # a k / v row's width (kv_heads * head_dim)
    spent_extra_values: int = 0  # attention-pattern weights and MLP neurons
    probe_outputs: int = 0  # probe scores per position


def price_positions(pricing: PositionPricing, prompt_len: int, max_tokens: int) -> None:
    """Add one prompt's positions (x n choices) to the request's price; 400 when
    the whole response would pass the cap."""
    positions = pricing.ask.positions
    if isinstance(positions, Window):
        problem = window_problem(positions, prompt_len, prompt_len + max_tokens)
        if problem is not None:
            raise invalid_request(problem, "hidden_states_positions")
    if positions == "last":
        per_choice = 1
    elif positions == "prompt":
        per_choice = prompt_len
    elif positions == "generated":
        per_choice = max_tokens
    elif isinstance(positions, Window):
        reach = prompt_len + max_tokens
        per_choice = max(min(reach, positions.end or reach) - positions.start, 0)
    else:
        per_choice = prompt_len + max_tokens
    pricing.spent_positions += pricing.n * per_choice
    if pricing.probe_outputs:
        pricing.spent_extra_values += pricing.n * per_choice * pricing.probe_outputs
    if pricing.ask.neurons:
        widths = [
            pricing.z_width
            if address_kind(p) in ("attn_z", "q")
            else pricing.kv_width
            if address_kind(p) in ("k", "v")
            else pricing.intermediate
            for p in pricing.ask.neurons
        ]
        pricing.spent_extra_values += pricing.n * per_choice * sum(widths)
    if pricing.ask.patterns:
        # [heads, queries, keys] per pattern point, keys up to the whole sequence.
        keys = prompt_len + max_tokens
        pricing.spent_extra_values += (
            pricing.n
            * len(pricing.ask.patterns)
            * (pricing.heads if pricing.ask.heads is None else len(pricing.ask.heads))
            * per_choice
            * keys
        )
    check_response(
        pricing.limits,
        ResponseSize(
            results=1,
            positions=pricing.spent_positions,
            layers=len(pricing.ask.keys),
            hidden_size=pricing.hidden_size,
            sae_top_k=pricing.ask.sae_top_k,
            pattern_values=pricing.spent_extra_values,
        ),
        pricing.ask.encoding_format,
        "max_tokens",
        f"positions are priced at prompt tokens + max_tokens ({prompt_len} + "
        f"{max_tokens} here) per choice; lower max_tokens, ask for fewer layers "
        "or choices or a smaller top_k, use hidden_states_format 'base64', or "
        "raise the cap",
    )


# --------------------------------------------------------------------------
# Steering (the ``steering`` field; no hidden states needed)

# What the routes that cannot serve them refuse (:func:`refuse`): the
# captured-data fields and steering (which asks for no captured data).
REFUSED_FIELDS: tuple[str, ...] = (*REQUEST_FIELDS, STEERING_PARAM)


@dataclass(frozen=True)
class SteeringAsk:
    """A chat/completions request's ``steering``, checked by :func:`admit`."""

    interventions: list[dict[str, Any]]  # as the request gave them
    stream: bool  # the request streams (its windows are checked in price)
    windows: tuple[tuple[int, Window], ...] = ()  # (intervention, its window)


async def admit_steering(serving: Any, request: Any) -> SteeringAsk | None:
    """The request's ``steering`` checked against the engine (None when not
    given), its patches' stored ``capture`` rows read (``stored_rows``);
    :class:`ApiError` (400) naming what is allowed."""
    value = request.model_extra.get(STEERING_PARAM)
    if value is None:
        return None
    cfg = steering_config(serving.engine_client)
    if cfg is not None and has_store_refs(value):
        value = await resolve_store_refs(value, cfg.num_layers)
    validate_steering(serving.engine_client, value)
    if getattr(request, "use_beam_search", False):
        raise invalid_request(
            "steering is not supported with use_beam_search; drop one of them",
            "use_beam_search",
        )
    windows: list[tuple[int, Window]] = []
    for i, item in enumerate(value):
        if isinstance(item.get("positions"), dict):
            window = check_positions(item["positions"])  # well-formed: checked above
            assert isinstance(window, Window)
            windows.append((i, window))
    return SteeringAsk(list(value), bool(getattr(request, "stream", False)), tuple(windows))


def steering_window_problem(
    steering: SteeringAsk, prompt_len: int, max_tokens: int
) -> ApiError | None:
    """The 400 for the first steering window that does not fit a prompt of
    ``prompt_len`` tokens and ``max_tokens`` (the message the engine front-end
    would give), or None."""
    for i, window in steering.windows:
        problem = window_problem(window, prompt_len, prompt_len + max_tokens)
        if problem is not None:
            return invalid_request(f"steering[{i}].positions: {problem}", STEERING_PARAM)
    return None


_steering: contextvars.ContextVar[SteeringAsk | None] = contextvars.ContextVar(
    "steering_ask", default=None
)


# --------------------------------------------------------------------------
# Call-outs from vLLM's serving code (patch 0009-openai-serving). Each is one
# line at its site; requests that asked for neither captured data nor
# steering pay two dict lookups in ``admit`` and context-variable reads at
# the others.


@dataclass
class AdmittedAsk:
    """One chat/completions request that asked for captured data, as
    :func:`admit` parsed, checked and priced it.

    Lives in a context variable from :func:`admit` (the first line of
    ``create_chat_completion`` / ``create_completion``) through the rest of
    that handler (:func:`admitted`); the response side records its choices'
    rows from :func:`.openai_response.observe` on.
    """

    ask: HiddenStatesAsk
    request: Any  # vLLM's ChatCompletionRequest / CompletionRequest
    choices_per_prompt: int  # the request's n
    pricing: PositionPricing | None  # "all"/"prompt": the response budget
    num_layers: int  # the engine's L (the store names points absolutely)
    sae_name: str  # the engine's SAE (its directory name); "" without one


_admitted: contextvars.ContextVar[AdmittedAsk | None] = contextvars.ContextVar(
    "hidden_states_admitted", default=None
)


def admitted() -> AdmittedAsk | None:
    """The request being served, as :func:`admit` admitted it (None: it asked
    for no captured data)."""
    return _admitted.get()


async def admit(serving: Any, request: Any, raw_request: Any) -> Any:
    """Parse, check and price the request's fields before anything is
    tokenized or generated; vLLM's ``ErrorResponse`` (400/413) to return, or
    None to go on. Called first in ``create_chat_completion`` and
    ``create_completion``."""
    if (refusal := unmonitored_refusal(request)) is not None:
        return refusal.to_error_response()
    extra = request.model_extra
    if not extra or not (STEERING_PARAM in extra or any(f in extra for f in REQUEST_FIELDS)):
        if _admitted.get() is not None:
            _admitted.set(None)
        if _steering.get() is not None:
            _steering.set(None)
        return None
    try:
        if raw_request is not None and not choice_writer.is_open():
            app_state = getattr(getattr(raw_request, "app", None), "state", None)
            choice_writer.open_store(getattr(app_state, "args", None))
        steering = await admit_steering(serving, request)
        ask = validate_ask(serving, request, raw_request)
    except ApiError as e:
        return e.to_error_response()
    _steering.set(steering)
    if ask is None:
        _admitted.set(None)
        return None
    n = getattr(request, "n", None) or 1
    pricing = None
    cfg = engine_config(serving.engine_client)  # not None: validate_ask checked it
    assert cfg is not None
    if ask.positions != "last" or ask.patterns or ask.neurons:
        model_config = serving.engine_client.model_config
        pricing = PositionPricing(
            limits_of(raw_request),
            ask,
            n,
            model_config.get_hidden_size(),
            heads=int(model_config.hf_text_config.num_attention_heads),
            intermediate=int(getattr(model_config.hf_text_config, "intermediate_size", 0) or 0),
            z_width=int(model_config.hf_text_config.num_attention_heads) * z_head_dim(model_config),
            kv_width=int(model_config.get_total_num_kv_heads()) * int(model_config.get_head_size()),
            probe_outputs=probe_outputs(cfg, ask),
        )
    sae_name = cfg.sae["name"] if cfg.sae is not None else ""
    _admitted.set(AdmittedAsk(ask, request, n, pricing, cfg.num_layers, sae_name))
    return None


def price(prompt_len: int, max_tokens: int) -> Any:
    """Add one prompt's positions to an "all"/"prompt" request's price, where
    vLLM has just sized it (``get_max_tokens``); ``ErrorResponse`` (400) when
    the whole response would pass the cap, or when a streamed request's
    steering window does not fit this prompt, else None."""
    steering = _steering.get()
    if steering is not None and steering.stream and steering.windows:
        problem = steering_window_problem(steering, prompt_len, max_tokens)
        if problem is not None:
            return problem.to_error_response()
    admitted = _admitted.get()
    if admitted is None or admitted.pricing is None:
        return None
    try:
        price_positions(admitted.pricing, prompt_len, max_tokens)
    except ApiError as e:
        return e.to_error_response()
    return None


def ask_engine(params: Any) -> None:
    """Copy what the request asked onto its ``SamplingParams`` (right after
    ``to_sampling_params``), in the engine's terms: steering (asked with or
    without hidden states) and the hidden-state fields."""
    put_monitors(params)
    steering = _steering.get()
    if steering is not None:
        # As given (the front-end resolves it into the wire form on its own
        # clone); one list per SamplingParams (completions: one per prompt).
        params.steering = [dict(item) for item in steering.interventions]
    admitted = _admitted.get()
    if admitted is None:
        return
    ask, extra = admitted.ask, admitted.request.model_extra
    params.return_hidden_states = True
    params.sae_features = extra.get("sae_features")
    params.probes = list(ask.probes) or None
    # With sae_features alone, no full states (None: the engine's "no layers").
    params.hidden_states_layers = list(ask.layers) or None
    params.hidden_states_points = [*ask.points, *ask.neurons, *ask.patterns] or None
    params.hidden_states_positions = ask.positions_json
    if ask.probe_actions:
        params.extra_args = {**(params.extra_args or {}), "probe_actions": list(ask.probe_actions)}


def refuse(request: Any, raw_request: Any, route: str) -> Any:
    """``ErrorResponse`` (400) when a route that cannot carry captured data
    or steering (/v1/responses, /v1/messages, /v1/chat/completions/batch) is
    sent any of :data:`REFUSED_FIELDS`; else None. Called first in those
    handlers. On a server with monitors (``--monitors``), every request there:
    the monitors cannot reach them, and a client must not evade them."""
    if monitors_loaded():
        return invalid_request(
            f"this server watches every generation with probe monitors, which "
            f"{route} cannot carry yet; use /v1/chat/completions or /v1/completions",
            "model",
        ).to_error_response()
    field_name = _captured_field_asked(request, raw_request)
    if field_name is None:
        return None
    if field_name == STEERING_PARAM:
        return invalid_request(
            f"'steering' is not supported on this route ({route}); steering works "
            "on /v1/chat/completions, /v1/completions and POST /v1/hidden_states "
            "(server started with --enable-steering)",
            STEERING_PARAM,
        ).to_error_response()
    return invalid_request(
        f"'{field_name}' is not supported on this route ({route}): hidden states "
        "are not supported here; return_hidden_states, hidden_states_*, "
        "sae_features and probes work on /v1/chat/completions and /v1/completions (and "
        "POST /v1/hidden_states)",
        field_name,
    ).to_error_response()


def unmonitored_refusal(request: Any) -> ApiError | None:
    """The 400 for a chat/completions request the server's monitors could
    not watch (beam search), or None."""
    if monitors_loaded() and getattr(request, "use_beam_search", False):
        return invalid_request(
            "this server watches every generation with probe monitors, which beam "
            "search cannot carry yet; drop use_beam_search",
            "use_beam_search",
        )
    return None


def _field_asked(data: Any) -> str | None:
    """The first of :data:`REFUSED_FIELDS` set (not null, not false) in ``data``."""
    if not isinstance(data, dict):
        return None
    return next((f for f in REFUSED_FIELDS if data.get(f) not in (None, False)), None)


def _captured_field_asked(request: Any, raw_request: Any) -> str | None:
    extra = getattr(request, "model_extra", None)
    if extra is not None:
        return _field_asked(extra)
    # Models that drop unknown fields (Anthropic's): look at the body read
    # for them (starlette caches it on the request).
    body = getattr(raw_request, "_body", None)
    if not body:
        return None
    try:
        return _field_asked(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None
