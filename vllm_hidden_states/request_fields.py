# SPDX-License-Identifier: Apache-2.0
"""The one resolver of a request's hidden-state fields, for every surface.

:func:`resolve_fields` turns the fields a request carries (:class:`RequestFields`,
read from ``SamplingParams`` or from an OpenAI request body) into what it asks
of the engine (:class:`AskedStates`), or raises :class:`FieldError` naming the
field, what was wrong and what is allowed. The engine front-end
(``frontend/input_fields.py``) and the HTTP server (``server/``) call it with
the same fields and raise its message as their own error (``VLLMValidationError``,
HTTP 400), so a bad field reads the same on both. What only one surface knows
stays there: the prompt's length (front-end), the wire format and streaming
(HTTP).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_hidden_states.contract import EXTRA_ARGS, ProbeAction
from vllm_hidden_states.points import (
    POSITIONS,
    Positions,
    Window,
    is_pattern_id,
    is_wide_id,
)
from vllm_hidden_states.probe_actions import action_probes, check_monitors, check_probe_actions

if TYPE_CHECKING:
    from vllm_hidden_states.hidden_states_config import HiddenStatesConfig

# Layers a request gets when it asks for hidden states without naming any: the
# final post-norm state. The one place this default is written.
DEFAULT_LAYERS: tuple[int, ...] = (-1,)

# Body fields that ask for captured data on the OpenAI routes. The one list:
# chat/completions read them, and the routes that cannot carry captured data
# (/v1/responses, /v1/messages, /v1/chat/completions/batch) refuse them.
REQUEST_FIELDS: tuple[str, ...] = (
    "return_hidden_states",
    "hidden_states_layers",
    "hidden_states_points",
    "hidden_states_format",
    "hidden_states_positions",
    "hidden_states_stream",
    "hidden_states_heads",
    "sae_features",
    "probes",
    "probe_actions",
)
# The fields that ask for captured data on their own (they imply
# return_hidden_states; full states then only for the layers named).
IMPLYING_FIELDS: tuple[str, ...] = ("sae_features", "probes", "probe_actions")


class FieldError(ValueError):
    """A request field breaks a rule; the message says what was wrong and what
    is allowed, ``parameter`` names the field."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


@dataclass(frozen=True)
class RequestFields:
    """The hidden-state fields of one request, as given (unchecked): the same
    names on ``SamplingParams`` and in an OpenAI request body."""

    return_hidden_states: Any = None
    hidden_states_layers: Any = None
    hidden_states_points: Any = None
    hidden_states_positions: Any = None
    sae_features: Any = None
    probes: Any = None
    probe_actions: Any = None
    # Set by the API server only (its --monitors), never read from a body.
    probe_monitors: Any = None

    @classmethod
    def of(cls, source: Any) -> "RequestFields":
        """The fields of ``SamplingParams`` (attributes, and the names of
        :data:`~vllm_hidden_states.contract.EXTRA_ARGS` from its
        ``extra_args``) or of a request body's extra fields (a dict; missing
        fields are None)."""
        if isinstance(source, dict):
            # Never the server's monitors: a body cannot set them.
            return cls(
                **{n: source.get(n) for n in cls.__dataclass_fields__ if n != "probe_monitors"}
            )
        extra_args = getattr(source, "extra_args", None) or {}

        def get(name: str) -> Any:
            if name in EXTRA_ARGS:
                return extra_args.get(name)
            return getattr(source, name, None)

        return cls(*(get(name) for name in cls.__dataclass_fields__))


@dataclass(frozen=True)
class AskedStates:
    """What one request asks of the engine, checked against it.

    Attributes:
        layers: the layers as named (HF convention; the default when none is
            named), in result order.
        abs_layers: ``layers`` as absolute capture ids ``0..L``.
        positions: "last", "all", "prompt", "generated" or a :class:`Window`.
        sae_top_k: k of ``sae_features`` (0: not asked).
        points, point_ids: residual-stream points beyond the layers, as
            named, and their capture ids.
        patterns, pattern_ids: attention-pattern points, and their ids.
        neurons, neuron_ids: points of their own width (MLP neurons,
            mlp_post; heads' outputs, attn_z), and their ids.
        probes: the engine's linear probes to score, names as given, then
            those only ``probe_actions`` read.
        probe_actions: its probe actions, then the server's monitors, checked.
        probes_returned: how many of ``probes`` (the first) it gets back.
        returns: "" (every position captured), "last" (only the final one: a
            "last" request watched by monitors) or "none" (monitors only).
    """

    layers: tuple[int, ...]
    abs_layers: tuple[int, ...]
    positions: "Positions | Window"
    sae_top_k: int = 0
    points: tuple[str, ...] = ()
    point_ids: tuple[int, ...] = ()
    patterns: tuple[str, ...] = ()
    pattern_ids: tuple[int, ...] = ()
    neurons: tuple[str, ...] = ()
    neuron_ids: tuple[int, ...] = ()
    probes: tuple[str, ...] = ()
    probe_actions: tuple[ProbeAction, ...] = ()
    probes_returned: int = -1
    returns: str = ""


def asks_states(fields: RequestFields) -> bool:
    """Whether a request asks for captured data: ``return_hidden_states`` is
    true or ``sae_features`` or ``probes`` is given (each implies the flag).
    Refuses a flag that is not a boolean, and layers or points named without
    the flag."""
    flag = fields.return_hidden_states
    if flag is not None and not isinstance(flag, bool):
        raise FieldError(
            f"return_hidden_states must be true or false, got {flag!r}", "return_hidden_states"
        )
    if asks_itself(fields) or fields.probe_monitors is not None:
        return True
    for name in ("hidden_states_layers", "hidden_states_points"):
        if getattr(fields, name) is not None:
            refuse_without_flag(name)
    return False


def asks_itself(fields: RequestFields) -> bool:
    """Whether the request itself (not the server's monitors) asks for
    captured data."""
    return bool(fields.return_hidden_states) or any(
        getattr(fields, name) is not None for name in IMPLYING_FIELDS
    )


def refuse_without_flag(name: str) -> None:
    """Refuse field ``name``, given without ``return_hidden_states``."""
    raise FieldError(
        f"{name} was given but return_hidden_states is not true; set "
        "return_hidden_states to true to receive hidden states",
        name,
    )


def resolve_fields(cfg: "HiddenStatesConfig | None", fields: RequestFields) -> AskedStates:
    """What a request that :func:`asks_states` asks of an engine of ``cfg``
    (None: hidden states not enabled); :class:`FieldError` for the first field
    that breaks a rule, checked in the order of the fields."""
    if cfg is None:
        if fields.sae_features is not None:
            raise _no_sae()
        for name in ("probes", "probe_actions"):
            if getattr(fields, name) is not None:
                raise FieldError(f"{name} need probes on this engine; {PROBES_HINT}", name)
        raise FieldError(
            f"hidden states are not enabled on this engine; {ENABLE_HINT}", "return_hidden_states"
        )
    monitors = (
        ()
        if fields.probe_monitors is None
        else tuple(checked(check_monitors, "probe_monitors", fields.probe_monitors, cfg.probes))
    )
    if not asks_itself(fields):
        # Watched by the server's monitors only: their scores, nothing returned.
        return AskedStates(
            layers=(),
            abs_layers=(),
            positions="generated",
            probes=action_probes(list(monitors), ()),
            probe_actions=monitors,
            probes_returned=0,
            returns="none",
        )
    actions = (
        ()
        if fields.probe_actions is None
        else tuple(checked(check_probe_actions, "probe_actions", fields.probe_actions, cfg.probes))
    )
    positions = checked(
        check_positions,
        "hidden_states_positions",
        "last" if fields.hidden_states_positions is None else fields.hidden_states_positions,
    )
    if actions:
        positions = positions_for_actions(positions)
    sae_top_k = 0
    if fields.sae_features is not None:
        if cfg.sae is None:
            raise _no_sae()
        sae_top_k = checked(
            check_sae_features, "sae_features", fields.sae_features, cfg.sae["d_sae"]
        )
    probes = (
        ()
        if fields.probes is None
        else tuple(checked(check_probes, "probes", fields.probes, cfg.probes))
    )
    probes = action_probes(list(actions), probes)
    returned, returns = len(probes), ""
    if monitors:
        if positions == "last":
            positions, returns = "generated", "last"
        elif positions == "prompt":
            raise FieldError(
                "this server's monitors watch every generated position as it is "
                "computed, which hidden_states_positions 'prompt' cannot share; ask "
                "for 'all' (the prompt's rows come first) instead",
                "hidden_states_positions",
            )
        probes = action_probes(list(monitors), probes)
        actions = (*actions, *monitors)
    asked = checked(check_points, "hidden_states_points", fields.hidden_states_points)
    ids = checked(cfg.resolve_points, "hidden_states_points", asked)
    # With sae_features, probes or points, full states only for the layers named.
    layers = checked(
        check_layers,
        "hidden_states_layers",
        fields.hidden_states_layers,
        bool(sae_top_k or probes),
        bool(asked),
    )
    abs_layers = checked(cfg.resolve_all, "hidden_states_layers", layers)
    # Attention patterns, MLP neurons and heads' outputs travel apart from
    # the residual rows.
    n = cfg.num_layers
    pattern = [is_pattern_id(k, n) for k in ids]
    neuron = [is_wide_id(k, n) for k in ids]
    row = [not (p or q) for p, q in zip(pattern, neuron)]
    return AskedStates(
        layers=tuple(layers),
        abs_layers=tuple(abs_layers),
        positions=positions,
        sae_top_k=sae_top_k,
        points=_where(asked, row),
        point_ids=_where(ids, row),
        patterns=_where(asked, pattern),
        pattern_ids=_where(ids, pattern),
        neurons=_where(asked, neuron),
        neuron_ids=_where(ids, neuron),
        probes=probes,
        probe_actions=actions,
        probes_returned=returned,
        returns=returns,
    )


def positions_for_actions(positions: "Positions | Window") -> "Positions | Window":
    """The positions of a request with probe actions: what they watch, as it
    is computed. "last" (the default) reads as "generated"; "prompt" is
    refused (its rows come with the prefill, before any action can apply to
    a generated token)."""
    if positions == "last":
        return "generated"
    if positions == "prompt":
        raise FieldError(
            "probe_actions watch the positions the request covers as they are "
            "computed; hidden_states_positions 'prompt' does not reach any generated "
            "token: use 'generated' (what the default 'last' means with "
            'probe_actions), \'all\' or a window {"start": s, "end": e}',
            "hidden_states_positions",
        )
    return positions


def _no_sae() -> FieldError:
    return FieldError(f"sae_features needs an SAE on this engine; {SAE_HINT}", "sae_features")


def checked(rule: Any, parameter: str, *args: Any) -> Any:
    """``rule(*args)``, its ValueError raised as a :class:`FieldError` of
    ``parameter`` (one that is a FieldError already keeps its own)."""
    try:
        return rule(*args)
    except FieldError:
        raise
    except ValueError as e:
        raise FieldError(str(e), parameter) from None


def _where(values: list[Any], keep: list[bool]) -> tuple[Any, ...]:
    return tuple(v for v, k in zip(values, keep) if k)


# -- the rules of single fields ------------------------------------------------


def check_positions(value: Any) -> "Positions | Window":
    """``hidden_states_positions``: one of :data:`POSITIONS`, or a window
    ``{"start": s, "end": e}`` (integers, ``0 <= s < e``; ``end`` may be
    left out or null: to the final token). Whether the window fits the
    request is checked once its prompt is tokenized (:func:`window_problem`)."""
    if isinstance(value, dict):
        start: Any = value.get("start")
        end: Any = value.get("end")
        if (
            set(value) - {"start", "end"}
            or not _is_int(start)
            or start < 0
            or (end is not None and (not _is_int(end) or end <= start))
        ):
            raise ValueError(
                'hidden_states_positions as a window must be {"start": s, "end": e} '
                "with integers 0 <= s < e (end optional: to the final token), got "
                f"{value!r}"
            )
        return Window(start, end)
    if value not in POSITIONS:
        raise ValueError(
            f"hidden_states_positions must be one of {list(POSITIONS)} or a window "
            f'{{"start": s, "end": e}}, got {value!r}'
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def window_problem(window: Window, prompt_len: int, max_len: int) -> str | None:
    """Why ``window`` cannot be served for a prompt of ``prompt_len`` tokens
    whose sequence can reach ``max_len`` positions (prompt + max_tokens),
    or None."""
    if window.start >= max_len:
        return (
            f"the window starts at position {window.start}, past the last position "
            f"this request can reach ({max_len - 1}: {prompt_len} prompt tokens + "
            f"max_tokens); positions count over prompt + output from 0"
        )
    if window.end is not None and window.end > max_len:
        return (
            f"the window ends at {window.end}, past the {max_len} positions this "
            f"request can reach ({prompt_len} prompt tokens + max_tokens); lower "
            "end or leave it out (to the final token)"
        )
    return None


def check_layers(value: Any, features_only: bool, points: bool = False) -> list[int]:
    """``hidden_states_layers``: a non-empty list of integers (HF convention),
    or None for the default (:data:`DEFAULT_LAYERS`; none when the request
    asks for SAE features only, ``features_only``, or names ``points``).
    Whether each layer exists is :meth:`HiddenStatesConfig.resolve_all`'s
    check."""
    if value is None:
        return [] if features_only or points else list(DEFAULT_LAYERS)
    if (
        not isinstance(value, (list, tuple))
        or not value
        or any(isinstance(k, bool) or not isinstance(k, int) for k in value)
    ):
        leave_out = (
            "; leave it out to receive sae_features or probe_scores only" if features_only else ""
        )
        raise ValueError(
            "hidden_states_layers must be a non-empty list of integers (HF "
            "convention: 0 = embeddings, -1 = final post-norm state), got "
            f"{value!r}{leave_out}"
        )
    return [int(k) for k in value]


def check_points(value: Any) -> list[str]:
    """``hidden_states_points``: None (none) or a non-empty list of address
    strings; whether each exists is :meth:`HiddenStatesConfig.resolve_points`'s
    check."""
    if value is None:
        return []
    if (
        not isinstance(value, (list, tuple))
        or not value
        or any(not isinstance(a, str) for a in value)
    ):
        raise ValueError(
            "hidden_states_points must be a non-empty list of point addresses such "
            f"as ['attn_out.3', 'blocks.5.hook_mlp_out'], got {value!r}"
        )
    return list(value)


SAE_HINT = "start it with sae=DIR (LLM / EngineArgs) or `vllm serve MODEL --sae DIR`"


def check_sae_features(value: Any, d_sae: int | None = None) -> int:
    """``k`` of ``sae_features={"top_k": k}``: an integer ``1 <= k <= d_sae``
    (the bound is checked when ``d_sae`` is given)."""
    k = value.get("top_k") if isinstance(value, dict) else None
    bound = (
        f"1..{d_sae} (the SAE's d_sae)" if d_sae is not None else ">= 1 (at most the SAE's d_sae)"
    )
    if (
        not isinstance(value, dict)
        or set(value) != {"top_k"}
        or isinstance(k, bool)
        or not isinstance(k, int)
        or k < 1
        or (d_sae is not None and k > d_sae)
    ):
        raise ValueError(
            f'sae_features must be {{"top_k": k}} with an integer k in {bound}, got {value!r}'
        )
    return k


PROBES_HINT = "start it with probes=DIR (LLM / EngineArgs) or `vllm serve MODEL --probes DIR`"


def check_probes(value: Any, available: "dict[str, Any] | None" = None) -> list[str]:
    """``probes``: a non-empty list of distinct probe names; each must be one
    of ``available`` (the engine's, by name) when given."""
    if (
        not isinstance(value, (list, tuple))
        or not value
        or any(not isinstance(name, str) for name in value)
    ):
        raise ValueError(
            f"probes must be a non-empty list of probe names such as ['toxicity'], got {value!r}"
        )
    if len(set(value)) != len(value):
        twice = sorted({name for name in value if list(value).count(name) > 1})
        raise ValueError(f"probes names {twice} more than once; name each probe once")
    if available is not None:
        if not available:
            raise ValueError(f"this engine has no probes; {PROBES_HINT}")
        for name in value:
            if name not in available:
                raise ValueError(
                    f"probe {name!r} is not loaded on this engine; available probes: "
                    f"{sorted(available)} (GET /v1/probes lists them)"
                )
    return list(value)


ENABLE_HINT = (
    "start the engine with enable_hidden_states=True (LLM / EngineArgs) "
    "or `vllm serve MODEL --enable-hidden-states`"
)
