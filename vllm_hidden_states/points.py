# SPDX-License-Identifier: Apache-2.0
"""The address grammar: layers, points and positions, and their capture ids.

Layers follow HF transformers' ``output_hidden_states`` (``0`` the embedding
output, ``L``/``-1`` the final post-norm state); points are SAELens /
TransformerLens names (``attn_out.3``, ``blocks.3.hook_mlp_out``). Every
capturable thing has one integer capture id (:func:`point_id`). The
convention: docs/architecture.md, "Addresses".
"""

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

# ``hidden_states_positions`` values. "last": the final token of prompt +
# output; "all": every position; "prompt": every prompt position;
# "generated": every output position; or a :class:`Window`.
Positions = Literal["last", "all", "prompt", "generated"]
POSITIONS: tuple[Positions, ...] = get_args(Positions)


@dataclass(frozen=True)
class Window:
    """``hidden_states_positions: {"start": s, "end": e}``: positions
    ``s .. e - 1`` of prompt + output (``end`` None: to the final token).
    Captured like "all", but only the window's rows."""

    start: int
    end: int | None = None

    def as_json(self) -> dict[str, int | None]:
        return {"start": self.start, "end": self.end}


# Positions served by a post-sampling HIDDEN_STATES_EXTRACT prefill. "prompt" is
# captured during the request's own prefill instead: no extract, one pass.
EXTRACT_POSITIONS: tuple[str, ...] = ("last", "all")


def window_of(positions: "Positions | Window", prompt_len: int) -> Window | None:
    """The window an "all"-like request captures: "generated" is
    ``{"start": prompt_len}``, "all" none (every position)."""
    if isinstance(positions, Window):
        return positions
    return Window(prompt_len) if positions == "generated" else None


# -- capture points (see the module doc) -------------------------------------

PointKind = Literal[
    "resid_pre",
    "attn_out",
    "resid_mid",
    "mlp_out",
    "resid_post",
    "attn_pattern",
    "mlp_post",
    "attn_z",
    "q",
    "k",
    "v",
]
POINT_KINDS: tuple[PointKind, ...] = get_args(PointKind)
# Attention patterns: [heads, query positions, key positions] per layer, not
# a row of the residual stream (CapturedRows.patterns, not .hidden).
PATTERN_KIND: PointKind = "attn_pattern"
# MLP neurons: the down projection's input, [positions, intermediate_size]
# per layer (CapturedRows.neurons). Dense MLPs only.
NEURON_KIND: PointKind = "mlp_post"
# Heads' outputs: the attention output projection's input, [positions,
# heads * head_dim] per layer (TransformerLens' hook_z flattened: head h at
# columns h * head_dim .. (h + 1) * head_dim - 1). Travels with the neurons
# (CapturedRows.neurons), its own width per point.
Z_KIND: PointKind = "attn_z"
# Queries, keys and values as vLLM's attention kernel reads them: the
# arguments of the layer's ``Attention`` module (after the QKV projection,
# QK-norm where the model has it, and rotary embedding; TransformerLens'
# hook_rot_q / hook_rot_k / hook_v), [positions, heads * head_dim] for q,
# [positions, kv_heads * head_dim] for k and v (one per KV head under GQA),
# returned [positions, heads, head_dim]. Travel with the neurons too.
QKV_KINDS: tuple[PointKind, ...] = ("q", "k", "v")
# Kinds whose rows are returned per head ([positions, heads, head_dim]).
HEAD_KINDS: tuple[PointKind, ...] = (Z_KIND, *QKV_KINDS)
# Kinds whose rows are not hidden_size wide (each point its own width): they
# travel apart from the residual rows, as CapturedRows.neurons.
WIDE_KINDS: tuple[PointKind, ...] = (NEURON_KIND, Z_KIND, *QKV_KINDS)
# Longest sequence an attention-pattern request may reach: its answer is
# [heads, positions, keys] per point, square in the length.
MAX_PATTERN_POSITIONS = 4096
# Kinds whose every layer has a capture id of its own past L, in id order.
_OWN_ID_KINDS: tuple[PointKind, ...] = ("attn_out", "resid_mid", "mlp_out")

_ADDRESS = re.compile(r"^(?:blocks\.(-?\d+)\.hook_([a-z_]+)|([a-z_]+)\.(-?\d+))$")
# TransformerLens' own names of the attention hooks: blocks.{i}.attn.hook_pattern
# (attn_pattern), blocks.{i}.attn.hook_z (attn_z), hook_rot_q / hook_rot_k
# (q, k: after rotary) and hook_v (v). TransformerLens' pre-rotary hook_q /
# hook_k are refused naming q / k (vLLM applies rotary before its attention
# module; no tap reads the query or key before it).
_TL_ATTN = re.compile(r"^blocks\.(-?\d+)\.attn\.hook_(pattern|z|rot_q|rot_k|v|q|k)$")
_TL_ATTN_KINDS: dict[str, PointKind] = {
    "pattern": PATTERN_KIND,
    "z": Z_KIND,
    "rot_q": "q",
    "rot_k": "k",
    "v": "v",
}
# Kinds past L, in capture-id order.
_PAST_KINDS: tuple[PointKind, ...] = (PATTERN_KIND, NEURON_KIND, Z_KIND, *QKV_KINDS)


def address_help(num_layers: int) -> str:
    return (
        f"a point is '<kind>.<i>' or 'blocks.<i>.hook_<kind>' with kind one of "
        f"{list(POINT_KINDS)} (also 'blocks.<i>.attn.hook_pattern', "
        f"'blocks.<i>.attn.hook_z', 'blocks.<i>.attn.hook_rot_q', "
        f"'blocks.<i>.attn.hook_rot_k' and 'blocks.<i>.attn.hook_v') and i a decoder "
        f"layer in "
        f"{-num_layers}..{num_layers - 1}"
    )


_QK_NAME = {"q": "query", "k": "key"}


def parse_point(address: Any, num_layers: int) -> tuple[PointKind, int]:
    """``(kind, layer)`` of a point address, the layer absolute in
    ``0..L-1``; ValueError naming the allowed forms."""
    tl = _TL_ATTN.match(address) if isinstance(address, str) else None
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None and tl is None:
        raise ValueError(f"{address!r} is not a point address; {address_help(num_layers)}")
    kind: str
    if tl is not None and tl[2] in ("q", "k"):
        raise ValueError(
            f"{address!r}: TransformerLens' hook_{tl[2]} is the {_QK_NAME[tl[2]]} before "
            f"rotary embedding, which is not captured (vLLM rotates it before its "
            f"attention module reads it); the {_QK_NAME[tl[2]]} after rotary is "
            f"'{tl[2]}.{tl[1]}' (TransformerLens' blocks.{tl[1]}.attn.hook_rot_{tl[2]})"
        )
    if tl is not None:
        layer_text, kind = tl[1], _TL_ATTN_KINDS[tl[2]]
    elif match is not None and match[1] is not None:
        layer_text, kind = match[1], match[2]
    else:
        assert match is not None
        layer_text, kind = match[4], match[3]
    if kind not in POINT_KINDS:
        raise ValueError(f"{address!r}: unknown kind {kind!r}; {address_help(num_layers)}")
    layer = int(layer_text)
    if not -num_layers <= layer < num_layers:
        raise ValueError(
            f"{address!r}: layer {layer} is out of range for a {num_layers}-layer "
            f"model; {address_help(num_layers)}"
        )
    return kind, layer % num_layers  # type: ignore[return-value]


def point_id(kind: PointKind, layer: int, num_layers: int) -> int:
    """The capture id of point ``kind.layer`` (``layer`` absolute): HF layer
    ``layer`` for resid_pre, ``layer + 1`` for resid_post below the last
    layer, else an id past ``L``."""
    n = num_layers
    if kind == "resid_pre":
        return layer
    if kind == "resid_post":
        return layer + 1 if layer < n - 1 else n + 1 + len(_OWN_ID_KINDS) * n
    if kind in _PAST_KINDS:
        return n + 2 + (len(_OWN_ID_KINDS) + _PAST_KINDS.index(kind)) * n + layer
    return n + 1 + _OWN_ID_KINDS.index(kind) * n + layer


def point_of_id(capture_id: int, num_layers: int) -> tuple[PointKind, int] | None:
    """``(kind, layer)`` of a capture id past ``L``; None for an HF layer
    ``0..L`` (resid_pre of it, or the final post-norm state)."""
    n = num_layers
    if capture_id <= n:
        return None
    offset = capture_id - (n + 1)
    if offset == len(_OWN_ID_KINDS) * n:
        return "resid_post", n - 1
    if offset > len(_OWN_ID_KINDS) * n:
        rest = offset - len(_OWN_ID_KINDS) * n - 1
        return _PAST_KINDS[rest // n], rest % n
    return _OWN_ID_KINDS[offset // n], offset % n


def is_pattern_id(capture_id: int, num_layers: int) -> bool:
    """Whether a capture id is an attention pattern (not a residual row)."""
    point = point_of_id(capture_id, num_layers)
    return point is not None and point[0] == PATTERN_KIND


def is_neuron_id(capture_id: int, num_layers: int) -> bool:
    """Whether a capture id is an MLP-neuron point (``intermediate_size`` wide)."""
    point = point_of_id(capture_id, num_layers)
    return point is not None and point[0] == NEURON_KIND


def is_wide_id(capture_id: int, num_layers: int) -> bool:
    """Whether a capture id is a point whose rows are not ``hidden_size``
    wide (:data:`WIDE_KINDS`: mlp_post, attn_z)."""
    point = point_of_id(capture_id, num_layers)
    return point is not None and point[0] in WIDE_KINDS


def is_neuron_address(address: str) -> bool:
    """Whether a (well-formed) point address names MLP neurons (mlp_post)."""
    match = _ADDRESS.match(address)
    return match is not None and NEURON_KIND in (match[2], match[3])


def is_z_address(address: str) -> bool:
    """Whether a (well-formed) point address names the heads' outputs
    (attn_z, TransformerLens' ``blocks.<i>.attn.hook_z``)."""
    tl = _TL_ATTN.match(address)
    if tl is not None:
        return tl[2] == "z"
    match = _ADDRESS.match(address)
    return match is not None and Z_KIND in (match[2], match[3])


def address_kind(address: str) -> str | None:
    """The kind a (well-formed) point address names, without knowing the
    model (None: not a point address)."""
    tl = _TL_ATTN.match(address)
    if tl is not None:
        return _TL_ATTN_KINDS.get(tl[2])
    match = _ADDRESS.match(address)
    if match is None:
        return None
    return match[2] if match[2] is not None else match[3]


def is_qkv_address(address: str) -> bool:
    """Whether a (well-formed) point address names queries, keys or values
    (q, k, v; TransformerLens' hook_rot_q / hook_rot_k / hook_v)."""
    return address_kind(address) in QKV_KINDS


def is_head_address(address: str) -> bool:
    """Whether a point's rows are returned per head, ``[positions, heads,
    head_dim]`` (:data:`HEAD_KINDS`: attn_z, q, k, v)."""
    return address_kind(address) in HEAD_KINDS


def is_wide_address(address: str) -> bool:
    """Whether a (well-formed) point address names a point of its own width
    (:data:`WIDE_KINDS`), which travels apart from the residual rows."""
    return is_neuron_address(address) or is_z_address(address) or is_qkv_address(address)


def is_pattern_address(address: str) -> bool:
    """Whether a (well-formed) point address names an attention pattern,
    without knowing the model (the server splits a request's points)."""
    tl = _TL_ATTN.match(address)
    if tl is not None:
        return tl[2] == "pattern"
    match = _ADDRESS.match(address)
    return match is not None and PATTERN_KIND in (match[2], match[3])


def layer_of_id(capture_id: int, num_layers: int) -> int:
    """The decoder layer whose forward computes a capture id (for pipeline
    stages): ``k`` for HF layer ``k < L`` (entering layer ``k``), the layer
    of a point past ``L``, ``L`` for the final post-norm state."""
    point = point_of_id(capture_id, num_layers)
    return capture_id if point is None else point[1]


def id_name(capture_id: int, num_layers: int) -> str:
    """A capture id as users name it: the HF layer, or ``kind.i``."""
    point = point_of_id(capture_id, num_layers)
    return str(capture_id) if point is None else f"{point[0]}.{point[1]}"
