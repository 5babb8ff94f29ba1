# SPDX-License-Identifier: Apache-2.0
"""Steering in the model runner: per-request interventions written into the
residual stream inside the forward, by one custom op, under torch.compile and
CUDA-graph replay alike.

The op is capture's (:mod:`.capture_points`) in the other direction. At model
load, each steerable point (``--steering-points``) gets a forward hook at the
same module its capture tap reads (registered first, so a point is steered
before it is captured) calling ``torch.ops.vllm.hidden_states_steer(target,
other, rows, slots, counts, index, adds, dirs, scale)``, which mutates
``target`` in place:

* the point's value is ``x = (target + other) * scale`` (``other`` None:
  ``target * scale``); for vLLM's fused-residual layers ``resid_pre.i`` is
  ``hidden + residual`` and the op writes into ``residual`` (into ``hidden``
  at layer 0, where there is no residual yet), so the layer, and every later
  capture of the stream, sees the steered value;
* for the ``n = counts[index]`` armed entries ``j``, with ``r = rows[index,
  j]`` and ``s = slots[index, j]``: ``x[r] <- x[r] - (x[r] . dirs[s])
  dirs[s] + adds[s]``, computed in float32 and added to ``target[r]`` (divided
  by ``scale``). ``add`` is ``adds[s] = strength * v, dirs[s] = 0``;
  ``ablate`` is ``adds[s] = 0, dirs[s] = v / |v|``; several interventions of
  one request at one point compose into one ``(adds, dirs)`` pair per stretch
  of positions (:func:`compose`).

``rows``/``slots`` (int64 ``[points, max_num_batched_tokens]``) and
``counts`` (int64 ``[2 x points]``: the armed entries per point, then whether
any of them projects, i.e. ablates or clamps, read on CPU to skip the
projection) are armed per step only when a steered request is in the batch;
``adds``/``dirs`` (float32 ``[slots, hidden_size]``, slot 0 all zeros) hold
each running steered request's vectors, written once when it enters the
batch (:class:`SlotTable`). All are registered as non-persistent module
buffers, so Dynamo lifts them as graph inputs; their storage never changes.

Cost where nobody steers (count 0), by where the forward runs
(:func:`steer`): on CUDA (the count is not readable without a host sync)
one Triton kernel per point (:mod:`.steer_kernel`) over the first ``tokens``
entries, whose programs return at once on slot 0; on CPU under
torch.compile the formula at every token as PyTorch ops traced into the
graph, each token's slot read from a dense map (``token_slots``, int64
``[points, max_tokens]``, 0 where nobody steers: slot 0 adds zeros, ``x +
0`` is ``x``), compiled into the forward's own kernels rather than a Python
dispatch per point; on CPU in eager mode a count read per steerable point,
and where it is not 0 ``vllm_hidden_states._C``'s C++ kernel (:mod:`.c_ops`;
the Python body where ``_C`` is not built).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.logger import init_logger
from vllm_hidden_states.points import point_of_id
from vllm_hidden_states.steering_config import KIND_ORDER, SteeringConfig, vector_files
from vllm_hidden_states.worker import c_ops
from vllm_hidden_states.worker.capture_points import (
    Reader,
    _child,
    _first_arg,
    _host_counts,
    count_readable_on_host,
    find_decoder_layers,
    layer_layout,
    off_cpu_route,
    point_tap,
    register_custom_op,
    stream_tap,
)
from vllm_hidden_states.worker.step_batch import StepBatch

logger = init_logger(__name__)

OP_NAME = "hidden_states_steer"


def _steer(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    adds: torch.Tensor,
    dirs: torch.Tensor,
    scale: float,
    enc: torch.Tensor | None = None,
    dec: torch.Tensor | None = None,
    par: torch.Tensor | None = None,
) -> None:
    """``target[r] += (adds[s] - (x[r] . dirs[s]) dirs[s]) / scale`` for the
    armed entries (see module doc); with the clamp tables (an engine with an
    SAE), also ``+ (value - act(x[r] . enc[s] + bias)) dec[s] / scale``,
    ``par[s] = (bias, threshold, value)``, ``act(p) = relu(p) * (p >
    threshold)`` (all zero in slots that do not clamp: a zero term)."""
    if count_readable_on_host(counts.device):
        host = _host_counts(counts)
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
        _apply(target, other, rows[index, :n], slots[index, :n], adds, dirs, scale, enc, dec, par)
        return
    # No host sync: every entry a forward of this many tokens can have; those
    # past the count are row 0, slot 0 (a zero delta).
    n = min(rows.shape[1], target.reshape(-1, target.shape[-1]).shape[0])
    if target.is_cuda:
        # One kernel per point, whose programs return at once on slot 0.
        from vllm_hidden_states.worker import steer_kernel

        steer_kernel.steer(
            target, other, rows[index], slots[index], n, adds, dirs, scale, enc, dec, par
        )
        return
    _apply(target, other, rows[index, :n], slots[index, :n], adds, dirs, scale, enc, dec, par)


def _delta(
    x: torch.Tensor,
    s: torch.Tensor,
    adds: torch.Tensor,
    dirs: torch.Tensor,
    scale: float,
    enc: torch.Tensor | None,
    dec: torch.Tensor | None,
    par: torch.Tensor | None,
) -> torch.Tensor:
    """What the general formula (module doc) adds to the tensor that carries
    the point: ``x`` float32 ``[n, hidden]``, the point's value at ``n``
    rows; ``s`` int64 ``[n]``, their slots. Returns float32 ``[n, hidden]``,
    already divided by ``scale``."""
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
    adds: torch.Tensor,
    dirs: torch.Tensor,
    scale: float,
    enc: torch.Tensor | None,
    dec: torch.Tensor | None,
    par: torch.Tensor | None,
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
    delta = _delta(x, s, adds, dirs, scale, enc, dec, par)
    flat.add_(delta.to(flat.dtype))


def _apply(
    target: torch.Tensor,
    other: torch.Tensor | None,
    r: torch.Tensor,
    s: torch.Tensor,
    adds: torch.Tensor,
    dirs: torch.Tensor,
    scale: float,
    enc: torch.Tensor | None,
    dec: torch.Tensor | None,
    par: torch.Tensor | None,
) -> None:
    """The general formula (module doc) at rows ``r`` with slots ``s`` (int64
    ``[n]`` each), added into ``target`` in place."""
    flat = target.view(-1, target.shape[-1])  # a view: the add lands in target
    x = flat.index_select(0, r).float()
    if other is not None:
        x = x + other.reshape(-1, other.shape[-1]).index_select(0, r).float()
    if scale != 1.0:
        x = x * scale
    delta = _delta(x, s, adds, dirs, scale, enc, dec, par)
    flat.index_add_(0, r, delta.to(flat.dtype))


def steer(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    adds: torch.Tensor,
    dirs: torch.Tensor,
    scale: float,
    enc: torch.Tensor | None = None,
    dec: torch.Tensor | None = None,
    par: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> None:
    """One steerable point's write, by the route that costs least where the
    forward runs, as :func:`~.capture_points.capture` chooses for a capture:
    off CPU the opaque op (replayed inside CUDA graphs); on CPU under
    torch.compile the formula at every token as aten ops in the graph, each
    token's slot read from the dense map ``token_slots`` (int64 ``[points,
    max_tokens]``, 0 where nobody steers; :func:`_steer_every_token`), since
    an opaque call would be a Python dispatch per point on every forward,
    steered or not; on CPU in eager mode the op's body, which reads the
    count."""
    if not count_readable_on_host(counts.device):
        # Triton (the op's body) unless the off-CPU route was set to _C's
        # CUDA kernel (capture_points.use_off_cpu_route, for the benchmarks).
        op = torch.ops.vllm_hidden_states.steer if off_cpu_route() == "c" else None
        if op is None:
            op = torch.ops.vllm.hidden_states_steer
        op(target, other, rows, slots, counts, index, adds, dirs, scale, enc, dec, par)
    elif torch.compiler.is_compiling() and token_slots is not None:
        _steer_every_token(target, other, token_slots, index, adds, dirs, scale, enc, dec, par)
    else:
        _steer(target, other, rows, slots, counts, index, adds, dirs, scale, enc, dec, par)


def _steer_fake(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    adds: torch.Tensor,
    dirs: torch.Tensor,
    scale: float,
    enc: torch.Tensor | None = None,
    dec: torch.Tensor | None = None,
    par: torch.Tensor | None = None,
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


def steer_tap(layer: nn.Module, capture_id: int, num_layers: int, layout: str | None) -> SteerTap:
    """The tap of steerable id ``capture_id`` in decoder ``layer``."""
    point = point_of_id(capture_id, num_layers)
    if point is None:  # resid_pre: the stream entering the layer, by its class
        tap = stream_tap(layer, capture_id)
        return SteerTap(layer, "pre", _pair(tap.read), order=KIND_ORDER["resid_pre"])
    kind, i = point
    name = f"{kind}.{i}"
    # Each layer is steered by what its class is (layout is not used).
    known = layer_layout(layer, name)
    if known.layout == "granite_hybrid" and kind == "resid_mid":
        # Read at the layer's output for capture, but the MLP has used it by
        # then: steer its input, the pre-MLP norm's (the residual is that
        # same tensor, so the add after the MLP sees the steered stream).
        module = _child(layer, "post_attention_layernorm", name)
        return SteerTap(
            module, "pre", _pair(_first_arg(("x", "hidden_states"))), order=KIND_ORDER[kind]
        )
    if known.layout == "fused" and kind == "resid_mid":
        # Read at the layer's output for capture, but the MLP has used it
        # by then: steer where it is formed, at the add-norm after attention.
        norm = (
            "pre_feedforward_layernorm"
            if hasattr(layer, "pre_feedforward_layernorm")
            else "post_attention_layernorm"
        )
        module = _child(layer, norm, name)
        return SteerTap(module, "pre", _pair(_add_norm_input), order=KIND_ORDER[kind])
    tap = point_tap(layer, kind, layout, name)
    return SteerTap(tap.module, tap.when, _pair(tap.read), tap.scale, KIND_ORDER[kind])


def _hook(
    entries: list[tuple[Callable, int, float]], post: bool, host_counts: np.ndarray | None
) -> Callable[..., None]:
    """A forward hook that steers the ids written at one module:
    ``(pair, index in counts, scale)`` each, in network order.
    ``host_counts``: on CPU, the counts as a numpy view, so that an eager
    forward where nobody steers returns after one memory read per point."""
    indices = [index for _, index, _ in entries]

    def steer_points(module: nn.Module, args: tuple, kwargs: dict, output: Any = None) -> None:
        # is_compiling() first: Dynamo must not see the numpy view at all.
        if not torch.compiler.is_compiling() and host_counts is not None:
            for index in indices:
                if host_counts[index]:
                    break
            else:
                return
        for pair, index, scale in entries:
            target, other = pair(args, kwargs, output)
            steer(
                target,
                other,
                module._hs_steer_rows,
                module._hs_steer_slots,
                module._hs_steer_counts,
                index,
                module._hs_steer_adds,
                module._hs_steer_dirs,
                scale,
                # Registered only on an engine with an SAE (static per graph).
                getattr(module, "_hs_steer_enc", None),
                getattr(module, "_hs_steer_dec", None),
                getattr(module, "_hs_steer_par", None),
                # Registered only on CPU (the compiled route's slot map).
                getattr(module, "_hs_steer_token_slots", None),
            )

    if post:
        return steer_points

    def steer_points_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        steer_points(module, args, kwargs)

    return steer_points_pre


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


@dataclass
class Stretch:
    """Positions ``start .. end - 1`` (``end`` None: on) of one request at
    one steerable point, steered by table slot ``slot``."""

    index: int  # the point's position in counts
    start: int
    end: int | None
    slot: int


class RequestSteering:
    """One request's interventions, split into stretches of positions with
    the same interventions per point, each one composed (add, dir) pair."""

    def __init__(
        self, wire: list[dict[str, Any]], vectors: "NamedVectors", index_of: dict[int, int]
    ):
        by_point: dict[int, list[dict[str, Any]]] = {}
        for item in wire:
            by_point.setdefault(int(item["id"]), []).append(item)
        self.stretches: list[Stretch] = []
        self.pairs: list[tuple[np.ndarray, np.ndarray]] = []
        # Per stretch: (encoder column, bias, threshold, value, decoder row)
        # of its clamp, or None (a clamp is alone at its point).
        self.clamps: list[tuple[np.ndarray, float, float, float, np.ndarray] | None] = []
        # Per stretch: whether it projects (ablates or clamps), not only adds.
        self.projects: list[bool] = []
        for capture_id, items in by_point.items():
            bounds = sorted(
                {int(x["start"]) for x in items}
                | {int(x["end"]) for x in items if x["end"] is not None}
            )
            for lo, hi in zip(bounds, [*bounds[1:], None]):
                active = [
                    x
                    for x in items
                    if x["start"] <= lo
                    and (x["end"] is None or (hi is not None and hi <= x["end"]))
                ]
                if not active:
                    continue
                self.stretches.append(Stretch(index_of[capture_id], lo, hi, 0))
                if active[0]["op"] == "clamp_sae_feature":
                    column, bias, threshold, row = vectors.sae_columns(active[0]["sae_feature"])
                    zero = np.zeros_like(row)
                    self.pairs.append((zero, zero))
                    self.projects.append(True)
                    self.clamps.append((column, bias, threshold, float(active[0]["value"]), row))
                    continue
                self.clamps.append(None)
                self.projects.append(any(x["op"] == "ablate" for x in active))
                self.pairs.append(
                    compose([(x["op"], vectors.get(x), float(x["strength"])) for x in active])
                )
        self.slots: list[int] | None = None  # table slots while resident


class NamedVectors:
    """Where vectors come from, on the host: inline, ``--steering-vectors``
    (loaded once per worker), or the engine's SAE (``sae_feature``)."""

    def __init__(self, directory: str | None, sae: Any = None):
        self._files = vector_files(directory) if directory else {}
        self._loaded: dict[str, np.ndarray] = {}
        self.sae = sae  # vllm_hidden_states.sae.SAE, None without --sae

    def sae_columns(self, feature: int) -> tuple[np.ndarray, float, float, np.ndarray]:
        """Feature ``feature`` of the SAE as ``(encoder column e, bias c,
        threshold, decoder row)``, float32: its activation is ``act(x . e +
        c)`` with ``c = b_enc[f] - b_dec . e`` when the SAE subtracts
        ``b_dec`` from its input."""
        sae = self.sae
        assert sae is not None, "sae_feature is refused in the front-end without an SAE"
        e = sae.W_enc[:, feature].double().cpu().numpy()
        c = float(sae.b_enc[feature])
        if sae.apply_b_dec_to_input:
            c -= float(sae.b_dec.double().cpu().numpy() @ e)
        threshold = float(sae.threshold[feature]) if sae.threshold is not None else 0.0
        row = sae.W_dec[feature].float().cpu().numpy()
        return e.astype(np.float32), c, threshold, row

    def get(self, item: dict[str, Any]) -> np.ndarray:
        if item.get("vector") is not None:
            return np.asarray(item["vector"], dtype=np.float32)
        if item.get("sae_feature") is not None:
            return self.sae_columns(int(item["sae_feature"]))[3]
        name = item["name"]
        if name not in self._loaded:
            from safetensors import safe_open

            path, key = self._files[name]
            with safe_open(path, framework="numpy") as f:
                self._loaded[name] = np.asarray(f.get_tensor(key), dtype=np.float32)
        return self._loaded[name]


class SlotTable:
    """Rows of the device vector tables (``adds``/``dirs``), lent to the
    steered requests of the batch; slot 0 stays zero. A request keeps its
    slots while it runs; when the table is full, requests not in the current
    batch give theirs back (and upload again when they return)."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, 0, -1))
        self.holders: dict[str, RequestSteering] = {}

    def lend(self, req_id: str, request: RequestSteering, batch: set[str]) -> list[int] | None:
        """Slots for ``request`` (None: it needed none before and has them)."""
        need = len(request.pairs)
        if len(self.free) < need:
            for other_id in [r for r in self.holders if r not in batch]:
                self.give_back(other_id)
                if len(self.free) >= need:
                    break
        if len(self.free) < need:
            raise RuntimeError(
                f"vllm-hidden-states: steering table full ({need} slots asked); "
                "raise --max-steering or lower max_num_seqs"
            )
        slots = [self.free.pop() for _ in range(need)]
        request.slots = slots
        self.holders[req_id] = request
        return slots

    def give_back(self, req_id: str) -> None:
        request = self.holders.pop(req_id, None)
        if request is not None and request.slots is not None:
            self.free.extend(request.slots)
            request.slots = None


class Steering:
    """The steerable points of one model, their buffers, and the steered
    requests of the runner."""

    def __init__(
        self,
        config: SteeringConfig,
        model: nn.Module,
        hidden_size: int,
        max_tokens: int,
        max_num_seqs: int,
        device: torch.device,
        layout: str | None,
        sae: Any = None,
    ):
        register_op()
        self.config = config
        n = config.num_layers
        _, decoder_layers = find_decoder_layers(model, n)
        from vllm_hidden_states.worker.capture_points import _is_pp_placeholder

        taps: dict[int, SteerTap] = {}
        for k in config.ids:
            point = point_of_id(k, n)
            layer = decoder_layers[k if point is None else point[1]]
            if _is_pp_placeholder(layer):
                continue  # another pipeline stage owns it
            taps[k] = steer_tap(layer, k, n, layout)
        self.index_of = {k: i for i, k in enumerate(config.ids)}
        num_points = max(len(config.ids), 1)
        self.max_tokens = max_tokens
        self.rows = torch.zeros(num_points, max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.zeros_like(self.rows)
        self.num_points = num_points
        self.counts = torch.zeros(2 * num_points, dtype=torch.int64, device=device)
        self.counts_host = torch.zeros(2 * num_points, dtype=torch.int64)
        # On CPU, each token's slot per point, for the compiled route (see
        # steer); 0 everywhere no request steers. Written and cleared through
        # a numpy view, entry by entry (the rows armed).
        self.token_slots: torch.Tensor | None = None
        self._token_slots_np: np.ndarray | None = None
        self._token_slots_written: list[tuple[int, np.ndarray]] = []
        if count_readable_on_host(device):
            self.token_slots = torch.zeros(num_points, max_tokens, dtype=torch.int64)
            self._token_slots_np = self.token_slots.numpy()
        num_slots = config.table_slots(max_num_seqs)
        self.adds = torch.zeros(num_slots, hidden_size, dtype=torch.float32, device=device)
        self.dirs = torch.zeros_like(self.adds)
        # clamp_sae_feature (an engine with an SAE): encoder columns, decoder
        # rows and (bias, threshold, value) per slot; zero where no clamp.
        self.enc = self.dec = self.par = None
        if sae is not None:
            self.enc = torch.zeros_like(self.adds)
            self.dec = torch.zeros_like(self.adds)
            self.par = torch.zeros(num_slots, 3, dtype=torch.float32, device=device)
        self.device = device
        self.table = SlotTable(num_slots)
        self.vectors = NamedVectors(config.vectors_dir, sae)
        self.requests: dict[str, RequestSteering] = {}
        # The stretches of the requests holding slots (:meth:`_stretch_table`),
        # rebuilt when a request comes, goes or gets slots.
        self._stretches: tuple | None = None
        self.armed = False
        hooks: dict[tuple[int, str], list[tuple[SteerTap, int]]] = {}
        modules: dict[int, nn.Module] = {}
        for k, tap in taps.items():
            module = tap.module
            if not hasattr(module, "_hs_steer_rows"):
                module.register_buffer("_hs_steer_rows", self.rows, persistent=False)
                module.register_buffer("_hs_steer_slots", self.slots, persistent=False)
                module.register_buffer("_hs_steer_counts", self.counts, persistent=False)
                module.register_buffer("_hs_steer_adds", self.adds, persistent=False)
                module.register_buffer("_hs_steer_dirs", self.dirs, persistent=False)
                if self.token_slots is not None:
                    module.register_buffer(
                        "_hs_steer_token_slots", self.token_slots, persistent=False
                    )
                if self.enc is not None:
                    module.register_buffer("_hs_steer_enc", self.enc, persistent=False)
                    module.register_buffer("_hs_steer_dec", self.dec, persistent=False)
                    module.register_buffer("_hs_steer_par", self.par, persistent=False)
            hooks.setdefault((id(module), tap.when), []).append((tap, self.index_of[k]))
            modules[id(module)] = module
        for (module_id, when), entries in hooks.items():
            entries.sort(key=lambda e: e[0].order)
            host_counts = self.counts.numpy() if count_readable_on_host(device) else None
            hook = _hook([(t.pair, i, t.scale) for t, i in entries], when == "post", host_counts)
            module = modules[module_id]
            # prepend: steer before any capture hook at the same module.
            if when == "pre":
                module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
            else:
                module.register_forward_hook(hook, with_kwargs=True, prepend=True)
        if count_readable_on_host(device):
            route = "eager: " + (
                "vllm_hidden_states._C (C++)"
                if c_ops.load()
                else f"the op's Python body ({c_ops.why_not()})"
            )
        else:
            route = "vllm_hidden_states._C CUDA" if off_cpu_route() == "c" else "Triton"
        logger.info(
            "vllm-hidden-states: %d steerable points (%s), %d vector slots of %d; writes: %s",
            len(taps),
            config.describe_points(),
            num_slots,
            hidden_size,
            route,
        )

    # -- per step --------------------------------------------------------------

    def begin_step(self, scheduler_output: Any) -> None:
        """New requests that steer (their ``SamplingParams.steering``, in
        wire form); finished ones leave."""
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            if params is not None and params.steering:
                # A preempted request comes back as new: its old slots go back.
                self.table.give_back(new.req_id)
                self.requests[new.req_id] = RequestSteering(
                    params.steering, self.vectors, self.index_of
                )
                self._stretches = None
        if self.requests and scheduler_output.finished_req_ids:
            for req_id in scheduler_output.finished_req_ids:
                if self.requests.pop(req_id, None) is not None:
                    self.table.give_back(req_id)
                    self._stretches = None

    def arm(self, batch: StepBatch, num_scheduled: dict[str, int]) -> None:
        """Right before the forward: the rows of every steered request in the
        batch, at each of its points (no-op when none is in the batch).

        Vectorized over the stretches of the requests holding table slots
        (:meth:`_stretch_table`); Python per step is one dict lookup per
        stretch, whatever its length."""
        if not self.requests:
            return
        index_of = batch.index_of
        missing = [
            r
            for r, q in self.requests.items()
            if q.slots is None and r in num_scheduled and r in index_of
        ]
        if missing:  # entering the batch without table slots: upload first
            in_batch = {r for r in self.requests if r in num_scheduled and r in index_of}
            for req_id in missing:
                self._upload(req_id, self.requests[req_id], in_batch)
            self._stretches = None  # slots changed (lent, or taken back from others)
        if self._stretches is None:
            self._stretches = self._stretch_table()
        owners, point, start, end, slot, projects = self._stretches
        if not owners:
            return
        idx = np.fromiter(
            (index_of.get(r, -1) if r in num_scheduled else -1 for r in owners),
            dtype=np.int64,
            count=len(owners),
        )
        live = idx >= 0
        if not live.any():
            return
        i = idx[live]
        query_start = batch.query_start
        p0 = batch.num_computed[i].astype(np.int64)
        row0 = query_start[i].astype(np.int64)
        p1 = p0 + (query_start[i + 1] - query_start[i])
        lo = np.maximum(start[live], p0)
        hi = np.minimum(end[live], p1)
        keep = lo < hi
        if not keep.any():
            return
        points = point[live][keep]
        firsts = (row0 + lo - p0)[keep]
        counts = (hi - lo)[keep]
        slots = slot[live][keep]
        projecting = projects[live][keep]
        # Device rows past each count are zero (disarm), so only the armed
        # entries are copied: a few per steered request.
        self.counts_host.zero_()
        for index in np.unique(points).tolist():
            mine = points == index
            first, count, slot_of = firsts[mine], counts[mine], slots[mine]
            total = int(count.sum())
            if total == len(count):  # a row each (decode): no ranges to expand
                rows, slot_of_row = first, slot_of
            else:
                offsets = np.cumsum(count) - count
                rows = np.repeat(first - offsets, count) + np.arange(total)
                slot_of_row = np.repeat(slot_of, count)
            self.rows[index, :total].copy_(torch.from_numpy(rows), non_blocking=True)
            self.slots[index, :total].copy_(torch.from_numpy(slot_of_row), non_blocking=True)
            self.counts_host[index] = total
            if self._token_slots_np is not None:
                self._token_slots_np[index, rows] = slot_of_row
                self._token_slots_written.append((index, rows))
            self.counts_host[self.num_points + index] = bool(projecting[mine].any())
        self.counts.copy_(self.counts_host, non_blocking=True)
        self.armed = True

    def _stretch_table(self) -> tuple:
        """Every stretch of the requests holding table slots, as columns:
        owner request id, point index, start, end (open: int64 max), slot,
        projects (ablate or clamp)."""
        owners: list[str] = []
        columns: list[tuple[int, int, int, int, bool]] = []
        for req_id, request in self.requests.items():
            if request.slots is None:
                continue
            for stretch, slot, projects in zip(request.stretches, request.slots, request.projects):
                owners.append(req_id)
                end = np.iinfo(np.int64).max if stretch.end is None else stretch.end
                columns.append((stretch.index, stretch.start, end, slot, projects))
        table = np.array(columns, dtype=np.int64).reshape(-1, 5)
        return (
            owners,
            table[:, 0],
            table[:, 1],
            table[:, 2],
            table[:, 3],
            table[:, 4].astype(bool),
        )

    def _upload(self, req_id: str, request: RequestSteering, batch: set[str]) -> None:
        """Write a request's composed vectors into table slots (once per
        entry into the batch)."""
        slots = self.table.lend(req_id, request, batch)
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64)
        adds = torch.from_numpy(np.stack([a for a, _ in request.pairs]))
        dirs = torch.from_numpy(np.stack([d for _, d in request.pairs]))
        if self.device.type != "cpu":
            index, adds, dirs = (t.to(self.device) for t in (index, adds, dirs))
        self.adds.index_copy_(0, index, adds)
        self.dirs.index_copy_(0, index, dirs)
        if self.enc is not None and self.dec is not None and self.par is not None:
            zero = np.zeros(adds.shape[1], np.float32)
            clamps = [c or (zero, 0.0, 0.0, 0.0, zero) for c in request.clamps]
            enc = torch.from_numpy(np.stack([c[0] for c in clamps]))
            dec = torch.from_numpy(np.stack([c[4] for c in clamps]))
            par = torch.tensor([[c[1], c[2], c[3]] for c in clamps], dtype=torch.float32)
            index = index.to(self.device)
            self.enc.index_copy_(0, index, enc.to(self.device))
            self.dec.index_copy_(0, index, dec.to(self.device))
            self.par.index_copy_(0, index, par.to(self.device))

    def disarm(self) -> None:
        """No steering in later forwards (warm-up and dummy runs included).
        Off CPU the op reads every entry up to the token count, so the index
        goes back to zeros (row 0, slot 0: a zero delta)."""
        if self.armed:
            self.rows.zero_()
            self.slots.zero_()
            self.counts.zero_()
            if self._token_slots_np is not None:
                for index, rows in self._token_slots_written:
                    self._token_slots_np[index, rows] = 0
                self._token_slots_written.clear()
            self.armed = False

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            if self.requests.pop(req_id, None) is not None:
                self.table.give_back(req_id)
                self._stretches = None
