# SPDX-License-Identifier: Apache-2.0
"""The API server's limits: one set of caps, read once from the flags.

Two stations use them: :mod:`.body_inspection` measures every request body
against the body caps before anything parses it, and the hidden-states routes
(:mod:`.openai_request`, :mod:`.hidden_states_route`) price a request against
the admission caps (input characters, results, response size) before any
tokenization or generation. Each refusal names the limit, its value and the
flag that sets it. The flags, their names and defaults, live with the
package's others (:mod:`vllm_hidden_states.engine_args`).
"""

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hidden_states.engine_args import (
    BATCH_FLAG,
    BODY_FLAG,
    CHARS_FLAG,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_INPUT_CHARS,
    DEFAULT_MAX_INPUT_ITEMS,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_JSON_VALUES,
    DEFAULT_MAX_LIST_ITEMS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_OBJECT_KEYS,
    DEFAULT_MAX_RESPONSE_MB,
    DEPTH_FLAG,
    INPUT_ITEMS_FLAG,
    KEYS_FLAG,
    LIST_FLAG,
    MAX_RESPONSE_ENV,
    MESSAGES_FLAG,
    RESPONSE_FLAG,
    VALUES_FLAG,
)
from vllm_hidden_states.server.encoding import value_bytes
from vllm_hidden_states.server.errors import invalid_request, too_large
from vllm_hidden_states.sweep import DEFAULT_MAX_CELLS as DEFAULT_MAX_SWEEP_CELLS
from vllm_hidden_states.sweep import MAX_CELLS_FLAG as SWEEP_CELLS_FLAG

MB = 2**20

# Bodies at least this large are counted, parsed and walked in a worker
# thread; smaller ones (at most ~85k values) take milliseconds on the loop.
INSPECT_OFF_LOOP_BYTES = 256 * 1024

# Wire bytes of one SAE feature, at most: an int32 id in JSON (11 characters)
# and a float32 value (15), each with a separator.
SAE_FEATURE_BYTES = 28


@dataclass(frozen=True)
class Limits:
    """The server's limits (the defaults are the flags' defaults).

    Attributes:
        max_response_bytes: the largest response a hidden-states request may
            produce (``--hidden-states-max-response-mb``).
        max_batch: hidden-state results per request (inputs on
            /v1/hidden_states, prompts x ``n`` on completions, ``n`` on chat).
        max_input_chars: characters of text per hidden-states request.
        max_body_bytes ... max_input_items: the body caps (``--request-max-*``).
        max_sweep_cells: cells one POST /v1/patch_sweep may run
            (``--patch-sweep-max-cells``).
        num_layers: the model's ``L`` (``hidden_states_layers`` may hold at
            most ``L + 1`` entries); None when unknown (no cap on bodies).
        off_loop_bytes: bodies at least this large are inspected in a thread.
    """

    max_response_bytes: int = int(DEFAULT_MAX_RESPONSE_MB * MB)
    max_batch: int = DEFAULT_MAX_BATCH
    max_input_chars: int = DEFAULT_MAX_INPUT_CHARS
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * MB)
    max_json_values: int = DEFAULT_MAX_JSON_VALUES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_list_items: int = DEFAULT_MAX_LIST_ITEMS
    max_object_keys: int = DEFAULT_MAX_OBJECT_KEYS
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_input_items: int = DEFAULT_MAX_INPUT_ITEMS
    max_sweep_cells: int = DEFAULT_MAX_SWEEP_CELLS
    num_layers: int | None = None
    off_loop_bytes: int = INSPECT_OFF_LOOP_BYTES

    @property
    def max_response_mb(self) -> float:
        return self.max_response_bytes / MB

    @classmethod
    def from_args(
        cls,
        args: Any = None,
        model_config: Any = None,
        environ: Mapping[str, str] | None = None,
    ) -> "Limits":
        """From the parsed ``vllm serve`` arguments (None or a missing flag:
        its default; ``VLLM_HIDDEN_STATES_MAX_RESPONSE_MB`` is the response
        cap's fallback) and the served model's config (None: unknown).
        ValueError naming the flag for a value that is not positive.

        The default list cap is ``max(65536, max_model_len)``: a token-id
        prompt may be as long as the model's context.
        """
        env: Mapping[str, str] = os.environ if environ is None else environ
        max_model_len = getattr(model_config, "max_model_len", None) or 0
        num_layers = None
        try:
            num_layers = int(model_config.hf_text_config.num_hidden_layers)
        except (AttributeError, TypeError, ValueError):
            pass

        def flag(name: str, option: str, default, cast=int):
            value = getattr(args, name, None)
            return default if value is None else _positive(value, option, cast)

        response_mb = getattr(args, "hidden_states_max_response_mb", None)
        if response_mb is not None:
            response_mb = _positive(response_mb, RESPONSE_FLAG, float)
        else:
            raw = env.get(MAX_RESPONSE_ENV)
            response_mb = (
                DEFAULT_MAX_RESPONSE_MB if raw in (None, "") else _positive(raw, MAX_RESPONSE_ENV)
            )
        body_mb = flag("request_max_body_mb", BODY_FLAG, DEFAULT_MAX_BODY_MB, float)
        return cls(
            max_response_bytes=int(response_mb * MB),
            max_batch=flag("hidden_states_max_batch", BATCH_FLAG, DEFAULT_MAX_BATCH),
            max_input_chars=flag(
                "hidden_states_max_input_chars", CHARS_FLAG, DEFAULT_MAX_INPUT_CHARS
            ),
            max_body_bytes=int(body_mb * MB),
            max_json_values=flag("request_max_json_values", VALUES_FLAG, DEFAULT_MAX_JSON_VALUES),
            max_json_depth=flag("request_max_json_depth", DEPTH_FLAG, DEFAULT_MAX_JSON_DEPTH),
            max_list_items=flag(
                "request_max_list_items", LIST_FLAG, max(DEFAULT_MAX_LIST_ITEMS, int(max_model_len))
            ),
            max_object_keys=flag("request_max_object_keys", KEYS_FLAG, DEFAULT_MAX_OBJECT_KEYS),
            max_messages=flag("request_max_messages", MESSAGES_FLAG, DEFAULT_MAX_MESSAGES),
            max_input_items=flag(
                "request_max_input_items", INPUT_ITEMS_FLAG, DEFAULT_MAX_INPUT_ITEMS
            ),
            max_sweep_cells=flag(
                "patch_sweep_max_cells", SWEEP_CELLS_FLAG, DEFAULT_MAX_SWEEP_CELLS
            ),
            num_layers=num_layers,
        )

    def describe_bodies(self) -> str:
        """The body caps, for the start-up log."""
        return (
            f"body <= {self.max_body_bytes / MB:g} MB, <= {self.max_json_values} "
            f"JSON values and keys, depth <= {self.max_json_depth}, <= {self.max_list_items} "
            f"items per list, <= {self.max_object_keys} keys per object, <= "
            f"{self.max_messages} messages, <= {self.max_input_items} /v1/responses "
            "input items"
        )


def _positive(value: Any, name: str, cast=float):
    """``cast(value)`` when it is a positive number; ValueError naming ``name``."""
    try:
        number = cast(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if isinstance(value, bool) or number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


# app -> its Limits (set when the app is built, see body_inspection.install).
_app_limits: "weakref.WeakKeyDictionary[Any, Limits]" = weakref.WeakKeyDictionary()
_default_limits: Limits | None = None


def limits_for_app(app: Any, args: Any, model_config: Any = None) -> Limits:
    """The limits of ``app``, read from its flags once."""
    try:
        return _app_limits[app]
    except KeyError:
        limits = _app_limits[app] = Limits.from_args(args, model_config)
        return limits


def limits_of(raw_request: Any) -> Limits:
    """The limits of the app serving ``raw_request`` (defaults without one)."""
    global _default_limits
    app = getattr(raw_request, "app", None)
    if app is None:
        if _default_limits is None:
            _default_limits = Limits.from_args(None)
        return _default_limits
    return limits_for_app(app, getattr(app.state, "args", None))


# --------------------------------------------------------------------------
# Admission: a hidden-states request priced before any work


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


@dataclass(frozen=True)
class ResponseSize:
    """What a response would carry, priced before any engine work.

    Attributes:
        results: choices (or inputs) in the response.
        positions: positions per result (may be an upper bound).
        layers: points per position.
        hidden_size: values per point and position.
        sae_top_k: SAE features per position (index + value each).
        pattern_values: attention-pattern weights in all.
        probe_outputs: probe scores per position (the sum of the probes' k).
    """

    results: int
    positions: int
    layers: int
    hidden_size: int
    sae_top_k: int = 0
    pattern_values: int = 0
    probe_outputs: int = 0


def check_response(
    limits: Limits,
    size: ResponseSize,
    encoding_format: str,
    param: str,
    advice: str,
    embed_dtype: str = "float32",
) -> None:
    """400 (on ``param``, ending with ``advice``) when a response of
    ``size`` in ``encoding_format`` would be over the cap."""
    results, positions, layers, hidden_size = (
        size.results,
        size.positions,
        size.layers,
        size.hidden_size,
    )
    sae_top_k, pattern_values, probe_outputs = (
        size.sae_top_k,
        size.pattern_values,
        size.probe_outputs,
    )
    values = results * positions * layers * hidden_size
    nbytes = (values + pattern_values) * value_bytes(encoding_format, embed_dtype)
    features = ""
    if sae_top_k:
        nbytes += results * positions * sae_top_k * SAE_FEATURE_BYTES
        features = f", plus top-{sae_top_k} SAE features per position"
    if pattern_values:
        features += f", plus {pattern_values} attention-pattern weights"
    if probe_outputs:
        nbytes += results * positions * probe_outputs * value_bytes(encoding_format, embed_dtype)
        features += f", plus {probe_outputs} probe scores per position"
    if nbytes > limits.max_response_bytes:
        raise invalid_request(
            f"the response would be about {nbytes / 2**20:.1f} MB ({results} results x "
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
