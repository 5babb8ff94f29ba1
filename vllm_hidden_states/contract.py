# SPDX-License-Identifier: Apache-2.0
"""The shared contract: the msgspec structs that cross process boundaries.

Defined here, in the package, and only named by the patched
``vllm.v1.engine`` (patch 0001), so that a new field is a line in this
module and never a line in ``patches/``. This module imports no other module
of the package and nothing of vLLM beyond ``LoRARequest``: the patched vLLM
imports it while ``vllm.v1.engine`` is being imported.
docs/architecture.md, "Wire types".
"""

from typing import Any

import msgspec
import torch

from vllm.lora.request import LoRARequest

__all__ = [
    "EXTRA_ARGS",
    "CapturedRows",
    "HiddenStatesExtractRequest",
    "HiddenStatesSpec",
    "Intervention",
    "OpResults",
    "ProbeAction",
    "ProbeFiring",
    "SteerGate",
    "as_interventions",
]

# Per-request fields read from ``SamplingParams.extra_args`` (vLLM's own
# extension point), by name; any of them makes a request resolved by the
# package (``SamplingParams.asks_hidden_states``, patch 0001).
EXTRA_ARGS: frozenset[str] = frozenset({"probe_actions", "probe_monitors"})


class ProbeAction(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    frozen=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """One probe action, checked (vllm_hidden_states.actions): when output
    ``column`` of probe ``probe`` is above (``above``) or below ``threshold``
    at ``consecutive`` positions in a row, ``then`` ("stop" or "flag").
    ``then`` "steer": ``steer`` holds its interventions (the request form of
    ``steering`` entries, form-checked; the front-end resolves them against
    the engine's steerable points).
    ``label``: how responses, logs and metrics name it (``probe_actions[i]``
    for a request's own, the monitor's name for a server monitor)."""

    label: str
    probe: str
    threshold: float
    above: bool = True
    column: int = 0
    consecutive: int = 1
    then: str = "stop"
    monitor: bool = False
    steer: list[dict[str, Any]] = []


class SteerGate(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    frozen=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """What turns on an intervention of a steer action (probe action
    ``action`` of its request): output ``column`` of the request's probe
    scores above (``above``) or below ``threshold`` at ``consecutive``
    positions in a row."""

    action: int
    column: int
    threshold: float
    above: bool
    consecutive: int


class Intervention(
    msgspec.Struct,
    kw_only=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    frozen=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """One intervention of a request's ``steering``, checked and resolved
    (vllm_hidden_states.steering_fields.check_steering): what the worker
    applies and an extract replays.

    ``point``: the steerable point, canonical (``"resid_pre.3"``); ``id``:
    its capture id; ``op``: one of steering_config.STEERING_OPS; positions
    ``start .. end - 1`` of prompt + output (``end`` None: on).
    add / ablate / clamp: the direction from ``vector`` (float32 values,
    ``hidden_size`` of them), ``name`` (``--steering-vectors``) or
    ``sae_feature``, scaled by ``strength``; a clamp's ``value``.
    patch / ablate_heads: ``n`` patch-table rows, from ``rows`` (float32
    little-endian bytes, ``[n, width]``, NaN keeps a value) or the matrix
    ``name``. sae_splice: ``edits`` ([feature, mode, value] each) and
    ``keep_error``. ``gate``: set on a steer action's entries (off until it
    fires).

    Sent in ``SamplingParams.steering``, whose declared type is a list of
    dicts: a process that decodes it gets dicts, which
    :func:`as_interventions` turns back into these."""

    point: str
    id: int
    op: str
    start: int = 0
    end: int | None = None
    vector: list[float] | None = None
    name: str | None = None
    sae_feature: int | None = None
    strength: float = 1.0
    value: float | None = None
    n: int = 0
    rows: bytes | None = None
    edits: list[list[float]] | None = None
    keep_error: bool = False
    gate: SteerGate | None = None


def as_interventions(steering: list[Any]) -> list[Intervention]:
    """``steering`` as :class:`Intervention` structs: itself when it holds
    them already (the process that resolved it), else converted from the
    dicts a decoded ``SamplingParams`` holds."""
    if all(isinstance(item, Intervention) for item in steering):
        return steering
    return msgspec.convert(steering, list[Intervention])


class ProbeFiring(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    frozen=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """An action whose condition held at ``position`` (of prompt + output),
    with the probe's ``score`` there (float, the probe's output units)."""

    label: str
    position: int
    score: float
    then: str = "stop"
    monitor: bool = False


class OpResults(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """What a request's ops report beside rows (``CompletionOutput.op_results``,
    and per step ``CapturedRows.op_results``): one field per op that reports.
    ``firings``: the probe actions whose condition held, in position order."""

    firings: list[ProbeFiring] = []


class HiddenStatesSpec(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    frozen=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """vllm-hidden-states: what one request asked for, resolved by the
    InputProcessor (vllm_hidden_states.frontend.input_fields).

    ``layers``: layer keys exactly as the request gave them, e.g. ``[-1, 16]``;
    ``abs_layers``: capture ids of the layers, then of ``points`` (HF indices
    ``0..L`` for layers; vllm_hidden_states.points.point_id);
    ``positions``: ``"last"``, ``"all"`` or ``"prompt"``;
    ``inline``: "all" is captured during the request's own forwards, so only
    its final token goes through a HIDDEN_STATES_EXTRACT.
    """

    layers: list[int]
    abs_layers: list[int]
    positions: str = "last"
    inline: bool = False
    # SAE features (engine started with --sae): k strongest per position; 0 =
    # none. ``layers`` may then be empty (features only). ``sae_layer``: the
    # absolute layer the SAE reads.
    sae_top_k: int = 0
    sae_layer: int = 0
    # Point addresses exactly as the request gave them (hidden_states_points);
    # their capture ids follow the layers' in ``abs_layers``.
    points: list[str] = []
    # The SAE's point address when it reads a point (``sae_layer`` is then its
    # capture id), "" when it reads a layer.
    sae_point: str = ""
    # "all" over a window of positions: ``start`` .. ``end - 1`` of prompt +
    # output (``end`` None: to the final token); "generated" and
    # {"start", "end"} requests are "all" with a window.
    start: int = 0
    end: int | None = None
    # Attention patterns (hidden_states_points of kind attn_pattern): the
    # addresses as given, and their capture ids. A request with patterns is
    # served by an extract that recomputes every position (every key).
    patterns: list[str] = []
    pattern_ids: list[int] = []
    # Points of their own width (points.WIDE_KINDS): MLP neurons (mlp_post:
    # the down projection's input, intermediate_size wide) and the heads'
    # outputs (attn_z: the attention output projection's input, heads *
    # head_dim wide): addresses as given, and their capture ids.
    neurons: list[str] = []
    neuron_ids: list[int] = []
    # Linear probes (--probes) whose scores to return, names as given, and
    # each one's k (its outputs: CapturedRows.probe_scores columns).
    probes: list[str] = []
    probe_widths: list[int] = []
    # Probe actions (vllm_hidden_states.actions): decided in the engine on the
    # scores of ``probes`` at this request's positions, in the step computed.
    probe_actions: list[ProbeAction] = []
    # How many of ``probes`` (the first) the request gets back (-1: all; a
    # server monitor's probes are scored, never returned).
    probes_returned: int = -1
    # What the request gets of the positions captured: "" all of them; "last"
    # the final one (a "last" request on a server with monitors, which watch
    # every generated position); "none" nothing (only monitors asked).
    returns: str = ""
    # The heads of each point in ``neurons`` whose rows are returned per head
    # (points.HEAD_KINDS), ``[positions, heads, head_dim]``: query heads for
    # attn_z (TransformerLens' hook_z) and q, KV heads for k and v; 0 for a
    # point returned flat (mlp_post). Empty: every point flat.
    neuron_heads: list[int] = []


class CapturedRows(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """vllm-hidden-states: what one request (or a group of requests, see
    ``req_ids``) captured over a run of positions, every kind of data in one
    value (CPU tensors). ``hidden``: ``[num_layers, num_positions,
    hidden_size]`` (the spec's distinct layers); ``sae_ids`` / ``sae_values``:
    int32 / float32 ``[num_positions, k]``; ``patterns`` (below). Grouped,
    concatenated and sliced along positions by vllm_hidden_states.wire, the
    one path."""

    hidden: torch.Tensor | None = None
    sae_ids: torch.Tensor | None = None
    sae_values: torch.Tensor | None = None
    # float32 [num_patterns, heads, num_positions, keys]: attention patterns
    # of the query positions, over keys 0..keys-1.
    patterns: torch.Tensor | None = None
    # One [num_positions, width] per point of its own width (the spec's
    # neuron_ids, in order), model dtype: width intermediate_size for
    # mlp_post, heads * head_dim for attn_z and q, kv_heads * head_dim for k
    # and v (a list: widths may differ).
    neurons: list[torch.Tensor] | None = None
    # float32 [num_positions, sum of k]: the spec's probes' scores side by
    # side, in the spec's order.
    probe_scores: torch.Tensor | None = None
    # Several requests' rows in one value (a step's rows travel as one tensor
    # per field, not one per request): request ``req_ids[i]`` owns the next
    # ``counts[i]`` positions, in order. Empty when the value is one
    # request's, known from where it sits (EngineCoreOutput.captured).
    req_ids: list[str] = []
    counts: list[int] = []
    # Grouped: each request's first position (that of its first row), as
    # the worker armed it; the engine's probe actions read positions here.
    firsts: list[int] = []
    # What the request's ops decided in the engine this step (probe action
    # firings); only on a group of one request, which may carry no rows.
    op_results: OpResults | None = None


class HiddenStatesExtractRequest(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,
):  # type: ignore[call-arg]
    """vllm-hidden-states: payload of a HIDDEN_STATES_EXTRACT core request, a
    post-sampling prefill over ``token_ids`` (prompt + output) that returns the
    states of ``layers`` (distinct capture ids, result order) at
    ``positions`` (``"last"`` or ``"all"``) instead of tokens. LoRA and cache
    salt are the original request's (vllm_hidden_states.wire)."""

    request_id: str
    token_ids: list[int]
    layers: list[int]
    positions: str = "last"
    arrival_time: float = 0.0
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    priority: int = 0
    client_index: int = 0
    sae_top_k: int = 0
    # Attention patterns (capture ids) and their query positions
    # ``start .. end - 1`` (None: to the last); every position is computed
    # ("all") and the rows returned are cut to that window.
    patterns: list[int] = []
    start: int = 0
    end: int | None = None
    neurons: list[int] = []  # mlp_post, attn_z, q, k, v capture ids
    probes: list[str] = []  # linear probes to score, names
    # The original request's steering, replayed over the positions the
    # extract recomputes.
    steering: list[Intervention] | None = None
