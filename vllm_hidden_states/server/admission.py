# SPDX-License-Identifier: Apache-2.0
"""Admission: every hidden-states request is priced before any work is done.

Before tokenization or generation, a request that asks for hidden states (on
/v1/completions, /v1/chat/completions, streamed or not, and POST
/v1/hidden_states) is priced by what it can cost the server:

* **input characters**: the text the server would template and tokenize
  (``prompt``, every string in ``messages``, ``input``), summed over the
  request; over ``--hidden-states-max-input-chars`` -> 413;
* **batch**: the number of hidden-state results the response carries
  (prompts x ``n`` on completions, ``n`` on chat, inputs on /v1/hidden_states);
  over ``--hidden-states-max-batch`` -> 413;
* **response size**: results x positions x layers x hidden_size x bytes per
  value of the chosen format (base64: 16/3, exact; float JSON: 16, an upper
  bound; binary: the dtype's size); over ``--hidden-states-max-response-mb``
  -> 400 (its size named), streamed responses included. chat/completions
  with "last" return one position per layer, so their price is exact before
  any work; "all"/"prompt" and /v1/hidden_states are priced at one position
  per result (a lower bound) before tokenization, and again right after it
  with the exact prompt lengths (+ ``max_tokens`` for "all"), before any
  generation.

Layers: ``hidden_states_layers`` may name each layer once. A list longer than
the model's ``L + 1`` layers, or one naming a layer twice (``-1`` and ``L`` are
the same layer), is refused with a 400; so a request returns at most ``L + 1``
rows per position.

The limits are server options (defaults below); the response cap also reads
the environment variable ``VLLM_HIDDEN_STATES_MAX_RESPONSE_MB`` when the flag is
not given, for servers configured before the flag existed.
"""

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from vllm_hidden_states.server.encoding import ApiError, invalid_request, value_bytes

MAX_RESPONSE_ENV = "VLLM_HIDDEN_STATES_MAX_RESPONSE_MB"
DEFAULT_MAX_RESPONSE_MB = 256.0
DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_INPUT_CHARS = 2_000_000

RESPONSE_FLAG = "--hidden-states-max-response-mb"
BATCH_FLAG = "--hidden-states-max-batch"
CHARS_FLAG = "--hidden-states-max-input-chars"

# POST /v1/hidden_states runs a batch this many inputs at a time (tokenized,
# generated and encoded per slice), so other requests interleave with it.
ADMISSION_SLICE = 8

# Payloads at least this large are (de)serialized in a worker thread, never on
# the event loop.
OFF_LOOP_BYTES = 1 << 20


@dataclass(frozen=True)
class Limits:
    """The server's admission limits."""

    max_response_bytes: int
    max_batch: int
    max_input_chars: int

    @property
    def max_response_mb(self) -> float:
        return self.max_response_bytes / 2**20


def _positive(value: Any, name: str, cast=float):
    try:
        number = cast(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


def limits_from(args: Any = None, environ: Mapping[str, str] | None = None) -> Limits:
    """Limits from the parsed ``vllm serve`` arguments (None: defaults), with
    ``VLLM_HIDDEN_STATES_MAX_RESPONSE_MB`` as the response cap's fallback."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    mb = getattr(args, "hidden_states_max_response_mb", None)
    if mb is not None:
        mb = _positive(mb, RESPONSE_FLAG)
    else:
        raw = env.get(MAX_RESPONSE_ENV)
        mb = DEFAULT_MAX_RESPONSE_MB if raw in (None, "") else _positive(raw, MAX_RESPONSE_ENV)
    batch = getattr(args, "hidden_states_max_batch", None)
    chars = getattr(args, "hidden_states_max_input_chars", None)
    return Limits(
        max_response_bytes=int(mb * 2**20),
        max_batch=DEFAULT_MAX_BATCH if batch is None else _positive(batch, BATCH_FLAG, int),
        max_input_chars=(
            DEFAULT_MAX_INPUT_CHARS if chars is None else _positive(chars, CHARS_FLAG, int)
        ),
    )


_app_limits: "weakref.WeakKeyDictionary[Any, Limits]" = weakref.WeakKeyDictionary()
_default_limits: Limits | None = None


def limits_of(raw_request: Any) -> Limits:
    """The limits of the app serving ``raw_request`` (computed once per app)."""
    global _default_limits
    app = getattr(raw_request, "app", None)
    if app is None:
        if _default_limits is None:
            _default_limits = limits_from(None)
        return _default_limits
    try:
        return _app_limits[app]
    except KeyError:
        limits = limits_from(getattr(app.state, "args", None))
        _app_limits[app] = limits
        return limits


# --------------------------------------------------------------------------
# Prices


def too_large(message: str, param: str | None) -> ApiError:
    return ApiError(message, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "invalid_request_error", param)


def check_input_chars(limits: Limits, chars: int, param: str) -> None:
    if chars > limits.max_input_chars:
        raise too_large(
            f"'{param}' has {chars} characters, over this server's limit of "
            f"{limits.max_input_chars} input characters per hidden-states request "
            f"({CHARS_FLAG}); send less text or split it over requests",
            param,
        )


def check_batch(limits: Limits, results: int, param: str, what: str) -> None:
    if results > limits.max_batch:
        raise too_large(
            f"this request asks for hidden states of {results} {what}, over this "
            f"server's limit of {limits.max_batch} per request ({BATCH_FLAG}); "
            "split it over requests",
            param,
        )


# Wire bytes of one SAE feature, at most: an int32 id in JSON (11 characters)
# and a float32 value (15), each with a separator.
SAE_FEATURE_BYTES = 28


def check_response(
    limits: Limits,
    results: int,
    positions: int,
    layers: int,
    hidden_size: int,
    encoding_format: str,
    param: str,
    advice: str,
    embed_dtype: str = "float32",
    sae_top_k: int = 0,
    pattern_values: int = 0,
) -> None:
    """400 when ``results x positions x layers x hidden`` values, plus
    ``sae_top_k`` SAE features per position and ``pattern_values``
    attention-pattern weights, would make a response over the cap
    (``positions`` may be an upper bound)."""
    values = results * positions * layers * hidden_size
    size = (values + pattern_values) * value_bytes(encoding_format, embed_dtype)
    features = ""
    if sae_top_k:
        size += results * positions * sae_top_k * SAE_FEATURE_BYTES
        features = f", plus top-{sae_top_k} SAE features per position"
    if pattern_values:
        features += f", plus {pattern_values} attention-pattern weights"
    if size > limits.max_response_bytes:
        raise invalid_request(
            f"the response would be about {size / 2**20:.1f} MB ({results} results x "
            f"{positions} positions x {layers} layers x {hidden_size} values, "
            f"encoding_format={encoding_format!r}{features}), over this server's "
            f"{limits.max_response_mb:g} MB cap ({RESPONSE_FLAG}, or the environment "
            f"variable {MAX_RESPONSE_ENV}); {advice}",
            param,
        )


def text_chars(value: Any, budget: int) -> int:
    """Characters in every string inside ``value`` (a prompt, messages);
    stops counting once over ``budget`` (the caller refuses then).

    Token-id prompts count one per token."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            if item and isinstance(item[0], int) and not isinstance(item[0], bool):
                total += len(item)  # token ids
            else:
                stack.extend(item)
        if total > budget:
            break
    return total


def check_layers(layers: tuple[int, ...], num_layers: int, resolve, param: str) -> None:
    """At most ``L + 1`` layers, none named twice (``resolve`` gives the
    absolute index, raising ValueError for a bad layer)."""
    limit = num_layers + 1
    if len(layers) > limit:
        raise invalid_request(
            f"{param} has {len(layers)} entries; this {num_layers}-layer model has "
            f"{limit} layers (0..{num_layers}, or -{limit}..-1), and a request may "
            "name each at most once",
            param,
        )
    seen: dict[int, int] = {}
    for layer in layers:
        try:
            absolute = resolve(layer)
        except ValueError as e:
            raise invalid_request(str(e), param) from None
        if absolute in seen:
            raise invalid_request(
                f"{param} names layer {absolute} twice ({seen[absolute]} and "
                f"{layer}); name each layer once",
                param,
            )
        seen[absolute] = layer
