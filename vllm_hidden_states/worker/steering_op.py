# SPDX-License-Identifier: Apache-2.0
"""The steering op: per-request interventions written into the residual stream
inside the forward, by one custom op, under torch.compile and CUDA-graph replay
alike. It is the capture op (``capture_op.py``) in the other direction, hooked
at the same modules as the capture taps (``taps.py``), before them. What it
computes and what it costs where nobody steers: docs/architecture.md,
"Steering".
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.logger import init_logger
from vllm_hidden_states.points import Z_KIND, point_of_id
from vllm_hidden_states.steering_config import KIND_ORDER
from vllm_hidden_states.worker import c_ops
from vllm_hidden_states.worker.capture_op import (
    count_readable_on_host,
    counts_on_host,
    off_cpu_route,
    register_custom_op,
)
from vllm_hidden_states.worker.taps import (
    Reader,
    child_module,
    first_arg,
    heads_out_module,
    layer_layout,
    point_tap,
    stream_tap,
)

logger = init_logger(__name__)

OP_NAME = "hidden_states_steer"


def _tables(vectors: list[torch.Tensor]) -> tuple:
    """``(adds, dirs, enc, dec, par)`` from a point's vector tables:
    ``[adds, dirs]``, or ``[adds, dirs, enc, dec, par]`` on an engine with
    an SAE (the clamp tables; None without)."""
    if len(vectors) == 5:
        return tuple(vectors)
    adds, dirs = vectors
    return adds, dirs, None, None, None


def _steer(
    target: torch.Tensor,
    other: torch.Tensor | None,
    tables: list[torch.Tensor],
    index: int,
    vectors: list[torch.Tensor],
    scale: float,
) -> None:
    """``target[r] += (adds[s] - (x[r] . dirs[s]) dirs[s]) / scale`` for the
    armed entries of point ``index`` (see module doc); ``tables``: ``[rows,
    slots, counts]`` (int64 ``[points, max_tokens]`` twice, then
    ``[2 * points]``); ``vectors``: ``[adds, dirs]`` float32 ``[slots,
    width]``, plus the clamp tables ``enc, dec`` (same shape) and ``par``
    (``[slots, 3]``: bias, threshold, value) on an engine with an SAE, which
    add ``(value - act(x[r] . enc[s] + bias)) dec[s] / scale``, ``act(p) =
    relu(p) * (p > threshold)`` (all zero in slots that do not clamp)."""
    rows, slots, counts = tables
    adds, dirs, enc, dec, par = _tables(vectors)
    if count_readable_on_host(counts.device):
        host = counts_on_host(counts)
        n = int(host[index])
        if not n:
            return
        op = c_ops.steer_op()
        if op is not None:  # the same write in C++, one dispatcher call
            op(target, other, rows, slots, counts, index, adds, dirs, scale, enc, dec, par)
            return
        if not host[counts.shape[0] // 2 + index]:
            # Only adds armed at this point (no direction, no clamp): the
            # general formula's projection terms are exact zeros; skip them.
            flat = target.view(-1, target.shape[-1])
            delta = adds.index_select(0, slots[index, :n])
            if scale != 1.0:
                delta = delta / scale
            flat.index_add_(0, rows[index, :n], delta.to(flat.dtype))
            return
        _apply(target, other, rows[index, :n], slots[index, :n], vectors, scale)
        return
    # No host sync: every entry a forward of this many tokens can have; those
    # past the count are row 0, slot 0 (a zero delta).
    n = min(rows.shape[1], target.reshape(-1, target.shape[-1]).shape[0])
    if target.is_cuda:
        # One kernel per point, whose programs return at once on slot 0.
        from vllm_hidden_states.worker import steer_kernel

        steer_kernel.steer(target, other, rows[index], slots[index], n, vectors, scale)
        return
    _apply(target, other, rows[index, :n], slots[index, :n], vectors, scale)


def _delta(
    x: torch.Tensor, s: torch.Tensor, vectors: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """What the general formula (module doc) adds to the tensor that carries
    the point: ``x`` float32 ``[n, hidden]``, the point's value at ``n``
    rows; ``s`` int64 ``[n]``, their slots; ``vectors`` as :func:`_steer`
    reads them. Returns float32 ``[n, hidden]``, already divided by
    ``scale``."""
    adds, dirs, enc, dec, par = _tables(vectors)
    d = dirs.index_select(0, s)
    delta = adds.index_select(0, s) - (x * d).sum(-1, keepdim=True) * d
    if enc is not None and dec is not None and par is not None:
        p = par.index_select(0, s)
        pre = (x * enc.index_select(0, s)).sum(-1) + p[:, 0]
        act = torch.relu(pre) * (pre > p[:, 1])
        delta = delta + (p[:, 2] - act)[:, None] * dec.index_select(0, s)
    if scale != 1.0:
        delta = delta / scale
    return delta


def _steer_every_token(
    target: torch.Tensor,
    other: torch.Tensor | None,
    token_slots: torch.Tensor,
    index: int,
    vectors: list[torch.Tensor],
    scale: float,
) -> None:
    """The formula at every token of the forward, its slot ``token_slots[index,
    t]`` (slot 0, all zeros, where nobody steers: a zero delta, ``x + 0`` is
    ``x``). Gathers of table rows and elementwise math only, no scatter, so
    inductor compiles it into a loop fused with its neighbours (a scatter
    into the stream, as :func:`_apply` does, is not fused on CPU and cost
    more than the opaque op's early return)."""
    flat = target.view(-1, target.shape[-1])
    s = token_slots[index, : flat.shape[0]]
    x = flat.float()
    if other is not None:
        x = x + other.reshape(-1, other.shape[-1]).float()
    if scale != 1.0:
        x = x * scale
    flat.add_(_delta(x, s, vectors, scale).to(flat.dtype))


def _apply(
    target: torch.Tensor,
    other: torch.Tensor | None,
    r: torch.Tensor,
    s: torch.Tensor,
    vectors: list[torch.Tensor],
    scale: float,
) -> None:
    """The general formula (module doc) at rows ``r`` with slots ``s`` (int64
    ``[n]`` each), added into ``target`` in place."""
    flat = target.view(-1, target.shape[-1])  # a view: the add lands in target
    x = flat.index_select(0, r).float()
    if other is not None:
        x = x + other.reshape(-1, other.shape[-1]).index_select(0, r).float()
    if scale != 1.0:
        x = x * scale
    flat.index_add_(0, r, _delta(x, s, vectors, scale).to(flat.dtype))


def steer(
    target: torch.Tensor,
    other: torch.Tensor | None,
    tables: list[torch.Tensor],
    index: int,
    vectors: list[torch.Tensor],
    scale: float,
    token_slots: torch.Tensor | None = None,
) -> None:
    """One steerable point's write (arguments as :func:`_steer`), by the
    route that costs least where the forward runs, as
    :func:`~.capture_points.capture` chooses for a capture: off CPU the
    opaque op (replayed inside CUDA graphs); on CPU under torch.compile the
    formula at every token as aten ops in the graph, each token's slot read
    from the dense map ``token_slots`` (int64 ``[points, max_tokens]``, 0
    where nobody steers; :func:`_steer_every_token`), since an opaque call
    would be a Python dispatch per point on every forward, steered or not;
    on CPU in eager mode the op's body, which reads the count."""
    if not count_readable_on_host(tables[2].device):
        if off_cpu_route() == "c":
            # _C's CUDA kernel (capture_points.use_off_cpu_route, for the
            # benchmarks): its own schema, the tables one by one.
            adds, dirs, enc, dec, par = _tables(vectors)
            torch.ops.vllm_hidden_states.steer(
                target, other, *tables, index, adds, dirs, scale, enc, dec, par
            )
        else:  # Triton (the op's body)
            torch.ops.vllm.hidden_states_steer(target, other, tables, index, vectors, scale)
    elif torch.compiler.is_compiling() and token_slots is not None:
        _steer_every_token(target, other, token_slots, index, vectors, scale)
    else:
        _steer(target, other, tables, index, vectors, scale)


def _steer_fake(
    target: torch.Tensor,
    other: torch.Tensor | None,
    tables: list[torch.Tensor],
    index: int,
    vectors: list[torch.Tensor],
    scale: float,
) -> None:
    return None


def register_op() -> None:
    """Register ``torch.ops.vllm.hidden_states_steer`` once per process."""
    register_custom_op(OP_NAME, _steer, _steer_fake, "target")


# -- where each steerable point is written -----------------------------------


def _pair(read: Reader) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """``(target, other)`` from a capture reader's ``(a, b)``: the op writes
    into the residual when there is one (``b``), else into the stream."""

    def target_of(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, Any]:
        a, b = read(args, kwargs, output)
        return (a, None) if b is None else (b, a)

    return target_of


def _add_norm_input(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused add-norm's ``(x, residual)``: the stream is their sum."""
    x = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
    residual = args[1] if len(args) > 1 else kwargs["residual"]
    return x, residual


@dataclass(frozen=True)
class SteerTap:
    """Where one steerable id is written: a forward hook on ``module``;
    ``pair(args, kwargs, output)`` gives ``(target, other)``."""

    module: nn.Module
    when: str
    pair: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    scale: float = 1.0
    order: int = 0  # network order among the ids written at one module
    # attn_z (the heads' outputs): patched only, NaN in a row keeping the
    # point's value (per-head writes); never steered by add / ablate.
    heads: bool = False


def steer_tap(layer: nn.Module, capture_id: int, num_layers: int, layout: str | None) -> SteerTap:
    """The tap of steerable id ``capture_id`` in decoder ``layer``."""
    point = point_of_id(capture_id, num_layers)
    if point is None:  # resid_pre: the stream entering the layer, by its class
        tap = stream_tap(layer, capture_id)
        return SteerTap(layer, "pre", _pair(tap.read), order=KIND_ORDER["resid_pre"])
    kind, i = point
    name = f"{kind}.{i}"
    if kind == Z_KIND:  # the attention output projection's input, as captured
        module = heads_out_module(layer, name)
        return SteerTap(module, "pre", _pair(first_arg(("x", "input_", "input"))), heads=True)
    # Each layer is steered by what its class is (layout is not used).
    known = layer_layout(layer, name)
    if known.layout == "granite_hybrid" and kind == "resid_mid":
        # Read at the layer's output for capture, but the MLP has used it by
        # then: steer its input, the pre-MLP norm's (the residual is that
        # same tensor, so the add after the MLP sees the steered stream).
        module = child_module(layer, "post_attention_layernorm", name)
        return SteerTap(
            module, "pre", _pair(first_arg(("x", "hidden_states"))), order=KIND_ORDER[kind]
        )
    if known.layout == "fused" and kind == "resid_mid":
        # Read at the layer's output for capture, but the MLP has used it
        # by then: steer where it is formed, at the add-norm after attention.
        norm = (
            "pre_feedforward_layernorm"
            if hasattr(layer, "pre_feedforward_layernorm")
            else known.mid_norm
        )
        module = child_module(layer, norm, name)
        return SteerTap(module, "pre", _pair(_add_norm_input), order=KIND_ORDER[kind])
    tap = point_tap(layer, kind, layout, name)
    return SteerTap(tap.module, tap.when, _pair(tap.read), tap.scale, KIND_ORDER[kind])


def steer_hook(
    entries: list[tuple[Callable, int, float, bool]],
    post: bool,
    host_counts: np.ndarray | None,
    patches: bool = False,
    rw_host_counts: np.ndarray | None = None,
    splice: tuple[int, int] | None = None,
) -> Callable[..., None]:
    """A forward hook that steers the ids written at one module:
    ``(pair, index in counts, scale, heads)`` each (``heads``: attn_z, only
    patched, per head), in network order, each one
    followed by its rewrites (``patches``: the engine has a patch table;
    ``splice``: ``(index of the SAE's point, the splice's index)`` at the
    module of the SAE's point). ``host_counts`` / ``rw_host_counts``: on
    CPU, the counts as numpy views, so that an eager forward where nobody
    steers returns after one memory read per point."""
    from vllm_hidden_states.worker.rewrite_op import patch, splice_rows

    indices = [index for _, index, _, heads in entries if not heads]
    every = [index for _, index, _, _ in entries]
    rw_indices = [*every, splice[1]] if splice is not None else every

    def steer_points(module: nn.Module, args: tuple, kwargs: dict, output: Any = None) -> None:
        # is_compiling() first: Dynamo must not see the numpy view at all.
        if not torch.compiler.is_compiling() and host_counts is not None:
            for index in indices:
                if host_counts[index]:
                    break
            else:
                if rw_host_counts is None or not any(rw_host_counts[i] for i in rw_indices):
                    return
        for pair, index, scale, heads in entries:
            target, other = pair(args, kwargs, output)
            if not heads:
                steer(
                    target,
                    other,
                    [module._hs_steer_rows, module._hs_steer_slots, module._hs_steer_counts],
                    index,
                    _vectors_of(module),
                    scale,
                    # Registered only on CPU (the compiled route's slot map).
                    getattr(module, "_hs_steer_token_slots", None),
                )
            if patches:
                patch(
                    target,
                    other,
                    module._hs_rw_rows,
                    module._hs_rw_slots,
                    module._hs_rw_counts,
                    index,
                    module._hs_patch_table,
                    scale,
                    # Registered only on CPU (the compiled route's row map).
                    getattr(module, "_hs_patch_token_slots", None),
                    heads,
                )
            if splice is not None and index == splice[0]:
                splice_rows(module, target, other, splice[1], scale)

    if post:
        return steer_points

    def steer_points_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        steer_points(module, args, kwargs)

    return steer_points_pre


def _vectors_of(module: nn.Module) -> list[torch.Tensor]:
    """The vector tables registered on ``module``: the clamp tables only on
    an engine with an SAE (static per graph)."""
    vectors = [module._hs_steer_adds, module._hs_steer_dirs]
    if hasattr(module, "_hs_steer_enc"):
        vectors += [module._hs_steer_enc, module._hs_steer_dec, module._hs_steer_par]
    return vectors


# -- per request ---------------------------------------------------------------


def compose(
    interventions: list[tuple[str, np.ndarray, float]],
) -> tuple[np.ndarray, np.ndarray]:
    """One ``(add, dir)`` pair (float32 ``[hidden_size]`` each) doing what
    ``interventions`` (``(op, vector, strength)``, in order, at one point) do
    one after the other: ``x -> x - (x . dir) dir + add``. At most one of
    them ablates (the front-end refuses more)."""
    width = interventions[0][1].shape[0]
    add = np.zeros(width, dtype=np.float64)
    direction = np.zeros(width, dtype=np.float64)
    for op, vector, strength in interventions:
        v: np.ndarray = vector.astype(np.float64)
        if op == "add":
            add += strength * v
        else:  # ablate: (x - (x.d0)d0 + a) projected off d
            d = v / np.linalg.norm(v)
            add -= (add @ d) * d
            direction = d
    return add.astype(np.float32), direction.astype(np.float32)
