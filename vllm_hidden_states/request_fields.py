# SPDX-License-Identifier: Apache-2.0
"""The rules of a request's hidden-state fields, one copy for every surface."""

from typing import Any

from vllm_hidden_states.points import POSITIONS, Positions, Window

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
)

# -- the request rules, one copy for both surfaces --------------------------
# SamplingParams (frontend/validate.py) and the OpenAI fields
# (server/openai_fields.py) call these; each surface turns the ValueError into
# its own error (VLLMValidationError / HTTP 400) naming the field.


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
        leave_out = "; leave it out to receive sae_features only" if features_only else ""
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


ENABLE_HINT = (
    "start the engine with enable_hidden_states=True (LLM / EngineArgs) "
    "or `vllm serve MODEL --enable-hidden-states`"
)
