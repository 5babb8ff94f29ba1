# SPDX-License-Identifier: Apache-2.0
"""Capture points inside the model: selected rows of the residual stream,
written into persistent buffers by one custom op, under torch.compile and
CUDA-graph replay alike.

At model load (:meth:`CapturePoints.install`), the decoder-layer list is found
generically (:func:`find_decoder_layers`: no per-architecture code) and each
decoder layer ``k`` whose layer index is capturable gets a capture point: a
forward pre-hook (PyTorch's ``register_forward_pre_hook``, traced by Dynamo
into the compiled graph like the forward itself) that calls
``torch.ops.vllm.hidden_states_capture(hidden, residual, rows, counts, index,
out)`` before the layer's own forward. Nothing of the layer is replaced:
parameter names, classes and forwards stay vLLM's, so weight loading, LoRA and
reloads see the same model.

The op writes ``(hidden + residual)[rows[:n]]`` into ``out[:n]``, ``n =
counts[index]`` (``index``: the point's position among the capture points): the
residual stream *entering* layer ``k``, which is HF's
``output_hidden_states[k]`` (``k = 0``: the embedding output, Gemma's
embedding scaling included; layers with vLLM's fused residual pass
``residual`` separately, others fold it into ``hidden``). Layer ``L``, the
final post-norm state, is the model's own output: the runner gathers it.

``rows`` (int64 ``[max_rows]``) and ``counts`` (int64 ``[num_points]``, one
count per capture point, so that a step captures only the layers some request
asked) are shared by all capture points; ``out`` is one ``[max_rows,
hidden_size]`` buffer per captured layer, in the model dtype. All are
registered as non-persistent module buffers, so Dynamo lifts them as graph
inputs rather than constants; their storage never changes, so compiled graphs
and captured CUDA graphs stay valid (``index`` is a constant of the graph). The
runner fills ``rows``/``counts`` before a forward that captures and zeroes them
after it (:meth:`CapturePoints.arm` / :meth:`CapturePoints.disarm`).

How a capture point's write is made depends on where the forward runs
(:func:`capture`):

* **Off CPU** (CUDA): the hook calls the opaque op, whose kernels a CUDA
  graph replays without Python. The count cannot be read on the host there
  without a sync (and not at all inside CUDA-graph capture), so the op
  launches one Triton kernel (:mod:`.capture_kernel`) of ``min(max_rows,
  tokens)`` programs that read the count on the device and return at once
  past it: one near-empty launch per capture point when nobody asked. Where
  Triton is missing, or a tensor is strided along its width, it gathers the
  first ``min(max_rows, tokens)`` entries of the persistent index with aten
  ops instead (``min(max_rows, tokens) x hidden_size`` elements copied per
  capture point per forward, asked or not).
* **On CPU under torch.compile**: no CUDA graph replays the step, so each
  opaque-op call would be a Python dispatch on every forward (about 30 us in
  the step, for every capture point, asked or not: x0.90 of plain vLLM with
  every point of a 5-layer model capturable). The hook writes a sync-free
  gather as aten ops instead, which Dynamo traces and inductor compiles into
  the forward's own kernels. It gathers :attr:`CapturePoints.armed`, the
  armed entries of ``rows`` as a tensor whose length is a dynamic size of
  the graph, set per step: a forward copies the rows armed in it (2 scratch
  rows per point when nobody asked), not one per token.
* **On CPU in eager mode**: the hook reads the count (a plain memory read,
  cheaper than any op call) and returns at once when it is 0; otherwise it
  writes the rows with ``vllm_hidden_states._C``'s C++ kernel
  (:mod:`.c_ops`), or, where ``_C`` is not built, with the op's Python body.

Invariant on every device: entries of ``rows`` past the armed count are 0
(:meth:`CapturePoints.arm` keeps them so, :meth:`CapturePoints.disarm` resets
the index), so that a gather without a count (or past it, up to the armed
index's floor of 2) never reads past a smaller batch.
Buffers are read only up to ``count``, right after the forward that armed them;
rows past it are scratch.
"""

import importlib.util
import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch._dynamo import mark_dynamic

from vllm.logger import init_logger
from vllm_hidden_states.config import NEURON_KIND, PATTERN_KIND, point_of_id
from vllm_hidden_states.layers import (
    FUSED_RESIDUAL_LAYOUTS,
    LayerClass,
    class_name,
    layer_class,
)
from vllm_hidden_states.worker import c_ops

logger = init_logger(__name__)

OP_NAME = "hidden_states_capture"

# The least length of CapturePoints.armed (see there): Dynamo specializes
# sizes 0 and 1.
ARMED_FLOOR = 2

# Names a decoder layer's forward uses for its input stream, most common
# first; failing these, the first positional argument that is not a position.
_STREAM_ARG_NAMES = ("hidden_states", "hidden_state", "hidden", "x")
_NOT_STREAM_ARGS = ("positions", "position_ids", "position_embeddings")


def count_readable_on_host(device: torch.device) -> bool:
    """Whether the op may read ``count`` on the host: on CPU it is a plain
    memory read; elsewhere it would be a host sync (and is impossible inside
    CUDA-graph capture), so the op gathers every entry of ``rows`` instead."""
    return device.type == "cpu"


def gather_rows(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    target: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """``target = ((hidden + residual) * scale)[index]``: ``hidden``/``residual``
    ``[tokens, hidden_size]``, ``index`` int64 ``[n]`` (every entry
    ``< tokens``), ``target`` ``[n, hidden_size]`` in the model dtype. The
    scale is applied to the gathered rows (the same products, elementwise)."""
    if residual is None:
        torch.index_select(hidden, 0, index, out=target)
    else:
        residual = residual.reshape(-1, residual.shape[-1])
        torch.add(hidden.index_select(0, index), residual.index_select(0, index), out=target)
    if scale != 1.0:
        target.mul_(scale)


# CPU count tensors seen as numpy arrays (the same memory), by data pointer:
# reading one element is then a plain memory read, not a tensor index.
_counts_views: dict[int, np.ndarray] = {}


def _host_counts(counts: torch.Tensor) -> np.ndarray:
    """``counts`` (a persistent CPU tensor) as a numpy view of its memory."""
    view = _counts_views.get(counts.data_ptr())
    if view is None or view.shape[0] != counts.shape[0]:
        view = _counts_views[counts.data_ptr()] = counts.numpy()
    return view


def _capture_rows(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
    scale: float,
) -> None:
    """``out[:n] = ((hidden + residual) * scale)[rows[:n]]`` with ``n =
    counts[index]`` (see module doc)."""
    if count_readable_on_host(counts.device):
        # A plain memory read on CPU; the "nobody asked" path is this one read.
        n = _host_counts(counts)[index]
        if n:
            op = c_ops.capture_op()
            if op is not None:  # the same write in C++, one dispatcher call
                op(hidden, residual, rows, counts, index, out, scale)
            else:
                gather_rows(
                    hidden.reshape(-1, hidden.shape[-1]), residual, rows[:n], out[:n], scale
                )
        return
    if hidden.is_cuda and off_cpu_route() == "triton":
        from vllm_hidden_states.worker import capture_kernel

        if capture_kernel.gather(hidden, residual, rows, counts, index, out, scale):
            return
    _gather_every_entry(hidden, residual, rows, out, scale)


# "c": vllm_hidden_states._C's CUDA kernel (count read on the device, as
# Triton's). Not the default until benchmarks/gpu/capture_op.py has timed it
# against Triton on a GPU.
OFF_CPU_ROUTES = ("triton", "torch", "c")
_off_cpu_route: str | None = None  # decided on first use


def off_cpu_route() -> str:
    """How the op writes where it cannot read the count on the host:
    ``"triton"`` (:mod:`.capture_kernel`, the count read on the device) where
    Triton is installed, else ``"torch"`` (every entry gathered with aten
    ops). Decided once per process, unless :func:`use_off_cpu_route` chose."""
    global _off_cpu_route
    if _off_cpu_route is None:
        _off_cpu_route = "triton" if importlib.util.find_spec("triton") else "torch"
    return _off_cpu_route


def use_off_cpu_route(route: str) -> None:
    """Choose the off-CPU route for forwards (and CUDA graphs) captured from
    now on: ``benchmarks/gpu/capture_op.py`` times both."""
    global _off_cpu_route
    if route not in OFF_CPU_ROUTES:
        raise ValueError(f"off-CPU route {route!r}; expected one of {OFF_CPU_ROUTES}")
    if route == "c" and not c_ops.load():
        raise ValueError(f"off-CPU route 'c': {c_ops.why_not()}")
    _off_cpu_route = route


def _gather_every_entry(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """The write without a count: the first ``n = min(max_rows, tokens)``
    entries of the persistent index (the rows armed for this forward are
    among them: at most one per token; entries past the count are 0, a row
    every forward has). ``tokens`` is static per CUDA graph, so a decode step
    of batch b gathers b rows, not max_rows. Written with out-of-place ops and
    one ``copy_``, so that Dynamo traces it into a compiled graph as well (on
    CPU ``rows`` is then :attr:`CapturePoints.armed`, whose length is the
    armed count: ``n`` follows it)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    n = min(rows.shape[0], hidden.shape[0])
    index = rows[:n]
    value = hidden.index_select(0, index)
    if residual is not None:
        value = value + residual.reshape(-1, residual.shape[-1]).index_select(0, index)
    if scale != 1.0:
        value = value * scale
    out[:n].copy_(value)


def _capture_rows_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
    scale: float,
) -> None:
    return None


def register_custom_op(
    name: str, func: Callable[..., None], fake: Callable[..., None], mutates: str
) -> None:
    """Register ``torch.ops.vllm.<name>`` (mutating argument ``mutates``) once
    per process, with vLLM's own helper."""
    if hasattr(torch.ops.vllm, name):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name=name, op_func=func, mutates_args=[mutates], fake_impl=fake)


def register_op() -> None:
    """Register ``torch.ops.vllm.hidden_states_capture`` once per process."""
    register_custom_op(OP_NAME, _capture_rows, _capture_rows_fake, "out")


def write_route(device: torch.device) -> str:
    """How capture points write on ``device``, in words (the engine-start log
    line names it)."""
    if count_readable_on_host(device):
        eager = (
            "vllm_hidden_states._C (C++)"
            if c_ops.load()
            else f"the op's Python body ({c_ops.why_not()})"
        )
        return (
            f"count read on the host; eager forwards write with {eager}, "
            "compiled ones with aten ops in the graph"
        )
    route = off_cpu_route()
    if route == "triton":
        return (
            "one Triton kernel per point, count read on the device (kept until "
            "benchmarks/gpu/capture_op.py times vllm_hidden_states._C on a GPU)"
        )
    if route == "c":
        return "vllm_hidden_states._C's CUDA kernel per point, count read on the device"
    return "aten gather of every entry (Triton not importable)"


def _is_pp_placeholder(layer: nn.Module) -> bool:
    from vllm.model_executor.models.utils import PPMissingLayer

    return isinstance(layer, PPMissingLayer)


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The model's decoder-layer list: ``(qualified name, ModuleList)``.

    Rule: of the ``nn.ModuleList`` s whose children are modules (not lists)
    and whose length is ``num_layers`` (the config's ``num_hidden_layers``;
    pipeline-parallel placeholders keep the length), the shallowest. Raises
    ``LookupError`` when there is none.
    """
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) == num_layers
        and not any(isinstance(c, (nn.ModuleList, nn.ModuleDict)) for c in module)
    ]
    if not candidates:
        raise LookupError(f"no list of {num_layers} decoder layers in {type(model).__name__}")
    return min(candidates, key=lambda c: c[0].count("."))


class StreamArgs:
    """Where a decoder layer's forward takes the residual stream: the
    ``hidden`` argument and, with vLLM's fused residual, ``residual``."""

    def __init__(self, forward: Callable[..., Any]):
        params = [p for p in inspect.signature(forward).parameters.values() if p.name != "self"]
        names = [p.name for p in params]
        positional = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        hidden = next((n for n in _STREAM_ARG_NAMES if n in names), None)
        if hidden is None:
            hidden = next((n for n in positional if n not in _NOT_STREAM_ARGS), None)
        if hidden is None:
            raise LookupError(f"no hidden-states argument in forward{tuple(names)}")
        self.hidden = hidden
        self.hidden_pos = positional.index(hidden) if hidden in positional else None
        self.residual = "residual" if "residual" in names else None
        self.residual_pos = positional.index("residual") if "residual" in positional else None

    def read(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.hidden_pos is not None and len(args) > self.hidden_pos:
            hidden = args[self.hidden_pos]
        else:
            hidden = kwargs[self.hidden]
        residual = None
        if self.residual is not None:
            if self.residual_pos is not None and len(args) > self.residual_pos:
                residual = args[self.residual_pos]
            else:
                residual = kwargs.get(self.residual)
        return hidden, residual

    def read_for_hook(
        self, args: tuple, kwargs: dict, output: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`read` as a :data:`Reader` (a pre-hook has no output)."""
        return self.read(args, kwargs)

    def __repr__(self) -> str:
        return f"StreamArgs(hidden={self.hidden!r}, residual={self.residual!r})"


_stream_args: dict[type[nn.Module], StreamArgs] = {}


def stream_args_of(cls: type[nn.Module]) -> StreamArgs:
    """Where ``cls.forward`` takes the residual stream (read once per class)."""
    if cls not in _stream_args:
        _stream_args[cls] = StreamArgs(cls.forward)
    return _stream_args[cls]


# -- where each capture id is read --------------------------------------------

Reader = Callable[[tuple, dict, Any], tuple[torch.Tensor, "torch.Tensor | None"]]


@dataclass(frozen=True)
class Tap:
    """Where one capture id is read: a forward hook on ``module`` (``"pre"``:
    before its forward, from its arguments; ``"post"``: after it, from its
    output). ``read(args, kwargs, output)`` gives ``(a, b)``; the op writes
    ``(a + b) * scale`` (``b`` None: ``a * scale``) at the armed rows."""

    module: nn.Module
    when: Literal["pre", "post"]
    read: Reader
    scale: float = 1.0


def _first_arg(names: tuple[str, ...]) -> Reader:
    """The module's first argument (positional, or the first of ``names``)."""

    def read(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, None]:
        if args:
            return args[0], None
        return next(kwargs[n] for n in names if n in kwargs), None

    return read


def _arg(i: int, name: str) -> Reader:
    """The module's argument ``i`` (positional, or keyword ``name``)."""

    def read(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, None]:
        return (args[i] if len(args) > i else kwargs[name]), None

    return read


def _output_item(i: int) -> Reader:
    """Item ``i`` of a module's tuple output."""

    def read(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, None]:
        return output[i], None

    return read


def _output_tensor(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, None]:
    """A module's output tensor (the first item of a tuple output)."""
    return (output[0] if isinstance(output, tuple) else output), None


def _output_sum(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused-residual layer's ``(hidden, residual)`` output, to be added."""
    return output[0], output[1]


def _child(layer: nn.Module, name: str, point: str) -> nn.Module:
    module = getattr(layer, name, None)
    if not isinstance(module, nn.Module):
        raise LookupError(f"{point}: decoder layer {type(layer).__name__} has no {name!r} module")
    return module


def layer_layout(layer: nn.Module, point: str) -> "LayerClass":
    """What is known of ``layer``'s class (:data:`LAYER_CLASSES`); raises
    ``LookupError`` naming it when nothing is: such a layer has no reader."""
    known = layer_class(type(layer))
    if known is None:
        raise LookupError(
            f"{point}: decoder layer class {class_name(type(layer))} is not one "
            "whose residual-stream convention vllm-hidden-states has verified "
            "(vllm_hidden_states/layers.py: LAYER_CLASSES)"
        )
    return known


def _hidden_only(stream: StreamArgs) -> Reader:
    """The ``hidden`` argument alone, for layers that take a ``residual``
    argument but carry the whole stream in ``hidden`` (Granite 4.0-H)."""

    def read(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, None]:
        return stream.read(args, kwargs)[0], None

    return read


def stream_tap(layer: nn.Module, k: int) -> Tap:
    """The tap of HF layer ``k`` (the stream entering decoder ``layer`` =
    layer ``k``), by the layer class's convention. Layer 0 of any class is
    its input as given (the embedding output; a fused-residual model passes
    no residual there); other layers of an unknown class raise
    ``LookupError``."""
    stream = stream_args_of(type(layer))
    known = layer_class(type(layer))
    if known is None and k != 0:
        layer_layout(layer, f"layer {k}")
    if known is not None and known.layout not in FUSED_RESIDUAL_LAYOUTS:
        return Tap(layer, "pre", _hidden_only(stream))
    return Tap(layer, "pre", stream.read_for_hook)


def _path(layer: nn.Module, path: str, point: str) -> nn.Module:
    module = layer
    for name in path.split("."):
        module = _child(module, name, point)
    return module


def point_tap(layer: nn.Module, kind: str, layout: str | None, point: str) -> Tap:
    """The tap of point ``kind`` (past ``L``) in decoder ``layer``, by the
    layer's class (:data:`vllm_hidden_states.layers.LAYER_CLASSES`; ``layout``
    is not used: a layer is read by what it is). Raises ``LookupError`` for a
    class that is not known, or a layer that is not as its class says."""
    known = layer_layout(layer, point)
    layout = known.layout
    fused = layout in FUSED_RESIDUAL_LAYOUTS
    if known.kinds is not None and kind not in known.kinds:
        raise LookupError(f"{point}: {type(layer).__name__} {known.lacks}")
    if kind == "resid_post":  # the layer's output (the last layer's: pre-norm)
        return Tap(layer, "post", _output_sum if fused else _output_tensor)
    if layout == "single_block":
        # (hidden, residual) in and out, one block: the layer returns (block
        # output, resid_pre); the block is a token mixer (attn_out) or an MLP
        # (mlp_out), as the class's kinds say.
        return Tap(layer, "post", _output_item(0))
    if fused:
        # (hidden, residual) in and out: the layer returns (mlp_out, resid_mid);
        # the add-norm after attention (Gemma: after its post-attention norm)
        # takes attn_out as its input.
        if kind == "attn_out":
            name = (
                "pre_feedforward_layernorm"
                if hasattr(layer, "pre_feedforward_layernorm")
                else "post_attention_layernorm"
            )
            return Tap(_child(layer, name, point), "pre", _first_arg(("x", "hidden_states")))
        return Tap(layer, "post", _output_item(1 if kind == "resid_mid" else 0))
    if layout == "granite_hybrid":
        # resid + block(x) * residual_multiplier, twice; the layer returns
        # (resid_post, resid_mid). The mixer is attention or Mamba2; the MLP
        # block is the shared MLP, plus routed experts where there are some.
        scale = float(layer.residual_multiplier)
        if kind == "attn_out":
            return Tap(_child(layer, known.mixer, point), "post", _output_tensor, scale)
        if kind == "mlp_out":
            if getattr(layer, "block_sparse_moe", None) is not None:
                raise LookupError(f"{point}: routed experts in {type(layer).__name__}: untested")
            return Tap(_child(layer, "shared_mlp", point), "post", _output_tensor, scale)
        return Tap(layer, "post", _output_item(1))
    if layout == "parallel_hybrid":
        # Falcon-H1: resid + (attention + Mamba2), then resid + MLP (its muP
        # multiplier applied inside); the MLP's norm reads resid_mid.
        if kind == "mlp_out":
            return Tap(_child(layer, "feed_forward", point), "post", _output_tensor)
        return Tap(
            _child(layer, "pre_ff_layernorm", point), "pre", _first_arg(("x", "hidden_states"))
        )
    if layout == "granite":
        # resid + block(x) * residual_multiplier, twice.
        scale = float(layer.residual_multiplier)
        if kind == "attn_out":
            return Tap(_child(layer, "self_attn", point), "post", _output_tensor, scale)
        if kind == "mlp_out":
            return Tap(_child(layer, "mlp", point), "post", _output_tensor, scale)
        return Tap(
            _child(layer, "post_attention_layernorm", point),
            "pre",
            _first_arg(("x", "hidden_states")),
        )
    if layout == "olmo2":
        # resid + post_norm(block(x)), twice; the MLP reads resid_mid unnormed.
        if kind == "attn_out":
            return Tap(_child(layer, "post_attention_layernorm", point), "post", _output_tensor)
        if kind == "mlp_out":
            return Tap(_child(layer, "post_feedforward_layernorm", point), "post", _output_tensor)
        return Tap(_child(layer, "mlp", point), "pre", _first_arg(("hidden_states", "x")))
    raise LookupError(f"{point}: no reader for layout {layout!r} of {type(layer).__name__}")


def neuron_module(layer: nn.Module, point: str) -> nn.Module:
    """The dense MLP's down projection of ``layer`` (its input: ``mlp_post``)."""
    known = layer_layout(layer, point)
    if known.neurons is None:
        raise LookupError(f"{point}: {type(layer).__name__}'s MLP is a mixture of experts")
    if getattr(layer, "block_sparse_moe", None) is not None:
        raise LookupError(f"{point}: routed experts in {type(layer).__name__}: untested")
    return _path(layer, known.neurons, point)


def attention_module(layer: nn.Module, point: str) -> nn.Module:
    """vLLM's ``Attention`` of ``layer``, whose query and key arguments give
    its pattern."""
    known = layer_layout(layer, point)
    if not known.attention:
        raise LookupError(f"{point}: {type(layer).__name__} has no vLLM attention module")
    return _path(layer, f"{known.mixer}.attn", point)


def capture(
    a: torch.Tensor,
    b: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
    scale: float,
    armed: torch.Tensor | None = None,
) -> None:
    """One capture point's write, ``out[:n] = ((a + b) * scale)[rows[:n]]``,
    by the route that costs least where the forward runs (see module doc).
    Under Dynamo the branch is taken at trace time (device and compiling are
    constants of the graph). ``armed``: on CPU, the armed entries of ``rows``
    as a tensor of dynamic length (:attr:`CapturePoints.armed`)."""
    if not count_readable_on_host(counts.device):
        if off_cpu_route() == "c":
            torch.ops.vllm_hidden_states.capture(a, b, rows, counts, index, out, scale)
        else:
            torch.ops.vllm.hidden_states_capture(a, b, rows, counts, index, out, scale)
    elif torch.compiler.is_compiling():
        _gather_every_entry(a, b, rows if armed is None else armed, out, scale)
    else:
        _capture_rows(a, b, rows, counts, index, out, scale)


def _hook(
    taps: list[tuple[Reader, str, int, float]], post: bool, host_counts: np.ndarray | None
) -> Callable[..., None]:
    """A forward hook (PyTorch's own extension point; Dynamo traces it into the
    compiled graph like the forward) that captures the points read at one
    module: ``(read, buffer name, index in counts, scale)`` each.
    ``host_counts``: on CPU, the counts as a numpy view, so that an eager
    forward where nobody asked returns after one memory read per point,
    before reading arguments or buffers (about 1.5 us of Python per point)."""
    indices = [index for _, _, index, _ in taps]

    def capture_points(module: nn.Module, args: tuple, kwargs: dict, output: Any = None) -> None:
        # is_compiling() first: Dynamo must not see the numpy view at all.
        if not torch.compiler.is_compiling() and host_counts is not None:
            for index in indices:
                if host_counts[index]:
                    break
            else:
                return
        for read, out_name, index, scale in taps:
            a, b = read(args, kwargs, output)
            capture(
                a,
                b,
                module._hs_rows,
                module._hs_counts,
                index,
                getattr(module, out_name),
                scale,
                getattr(module, "_hs_armed", None),
            )

    if post:
        return capture_points

    def capture_points_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        capture_points(module, args, kwargs)

    return capture_points_pre


def has_capture_points(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries a capture point."""
    return any(hasattr(m, "_hs_rows") for m in model.modules())


class CapturePoints:
    """The capture points of one model and their buffers.

    Attributes:
        layers: capture ids with a capture point, in the config's order
            (:attr:`HiddenStatesConfig.inner_layers`; with pipeline
            parallelism: this stage's only): HF layers ``k < L`` and points
            past ``L``.
        start_layer, end_layer: the decoder layers this stage owns,
            ``[start_layer, end_layer)``.
        buffers: ``{id: [max_rows, hidden_size]}`` in the model dtype.
        max_rows: rows one forward can capture.
        count: rows armed for the next forward (the points of the ids asked
            get it in the device ``counts`` tensor, the others 0).
        armed: on CPU, int64 ``[max(count, ARMED_FLOOR)]`` on the memory of
            ``rows``: the index the compiled graph gathers, its length a
            dynamic size of the graph (None off CPU, where CUDA graphs fix
            every size).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[int],
        num_layers: int,
        hidden_size: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: str | None = None,
    ):
        register_op()
        self.layers_name, decoder_layers = find_decoder_layers(model, num_layers)
        # The decoder layers this pipeline stage owns, [start_layer, end_layer)
        # (all of them without pipeline parallelism); the others are
        # placeholders and get no capture point.
        owned = [i for i, m in enumerate(decoder_layers) if not _is_pp_placeholder(m)]
        self.start_layer, self.end_layer = (owned[0], owned[-1] + 1) if owned else (0, 0)
        self.max_rows = max_rows
        self.rows = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # On the CPU the op reads the index and counts where arm() writes them
        # (no copy); elsewhere arm() writes host copies and copies them over.
        self._on_host = count_readable_on_host(self.rows.device)
        self.rows_host = self.rows if self._on_host else torch.zeros(max_rows, dtype=torch.int64)
        self.count = 0
        self._index: dict[int, int] = {}  # capture id -> its position in counts
        self.buffers: dict[int, torch.Tensor] = {}
        taps: dict[int, Tap] = {}
        # Attention patterns: vLLM's Attention module per pattern id; MLP
        # neurons: the down projection per mlp_post id.
        self.pattern_modules: dict[int, nn.Module] = {}
        self.neuron_modules: dict[int, nn.Module] = {}
        for k in layers:
            point = point_of_id(k, num_layers)
            layer = decoder_layers[k if point is None else point[1]]
            if _is_pp_placeholder(layer):
                continue  # another pipeline stage owns it
            if point is not None and point[0] == NEURON_KIND:
                # The MLP's hidden activations: its down projection's input.
                down = neuron_module(layer, f"{NEURON_KIND}.{point[1]}")
                self.neuron_modules[k] = down
                taps[k] = Tap(down, "pre", _first_arg(("x", "input_", "input")))
            elif point is not None and point[0] == PATTERN_KIND:
                attn = attention_module(layer, f"{PATTERN_KIND}.{point[1]}")
                self.pattern_modules[k] = attn
                taps[k] = Tap(attn, "pre", _arg(0, "query"))
            elif point is None:  # resid_pre: the stream entering layer k
                taps[k] = stream_tap(layer, k)
            else:
                taps[k] = point_tap(layer, point[0], layout, f"{point[0]}.{point[1]}")
        self.counts = torch.zeros(max(len(taps), 1), dtype=torch.int64, device=device)
        self.counts_host = (
            self.counts if self._on_host else torch.zeros_like(self.counts, device="cpu")
        )
        # numpy views of the host tensors: arm() writes them once per step,
        # where a tensor index costs microseconds each.
        self._rows_np = self.rows_host.numpy()
        self._counts_np = self.counts_host.numpy()
        self._rows_written = 0  # leading entries of rows_host that may be non-zero
        # Under torch.compile on CPU the writes gather the entries of
        # ``armed``: a tensor on the memory of ``rows`` whose length arm()
        # sets per step, a dynamic size of the compiled graph, so that a
        # forward copies the rows armed in it rather than min(max_rows,
        # tokens) rows at every point (a 1152-token prefill where nobody
        # asked: x0.967 of plain vLLM with every point of a 5 x 256 model
        # capturable). Its length is never below ARMED_FLOOR, which Dynamo
        # would specialize to a constant (sizes 0 and 1): one graph serves
        # every step, and a step where nobody asked gathers row 0 twice per
        # point into scratch rows (with fewer buffer rows than that, the
        # writes gather every entry, as off CPU).
        self.armed: torch.Tensor | None = None
        if self._on_host and max_rows >= ARMED_FLOOR:
            self.armed = torch.empty(0, dtype=torch.int64)
            self._set_armed(0)
            mark_dynamic(self.armed, 0, min=ARMED_FLOOR, max=max_rows)
        # One hook per (module, pre/post), calling the op for each id read there.
        hooks: dict[tuple[int, str], list[tuple[Reader, str, int, float]]] = {}
        modules: dict[int, nn.Module] = {}
        # Pattern ids: their queries and keys, [max_rows, heads x head_size].
        self.pattern_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # mlp_post ids: [max_rows, intermediate_size].
        self.neuron_buffers: dict[int, torch.Tensor] = {}
        for index, (k, tap) in enumerate(taps.items()):
            module = tap.module
            if not hasattr(module, "_hs_rows"):
                module.register_buffer("_hs_rows", self.rows, persistent=False)
                module.register_buffer("_hs_counts", self.counts, persistent=False)
                if self.armed is not None:
                    # A plain attribute, not a buffer: Dynamo gives buffers
                    # static shapes, and this one's length changes per step.
                    module._hs_armed = self.armed
            hooked = hooks.setdefault((id(module), tap.when), [])
            modules[id(module)] = module
            self._index[k] = index
            if k in self.pattern_modules:
                # Two writes at one index: the query and the key rows.
                attn = self.pattern_modules[k]
                widths = (attn.num_heads * attn.head_size, attn.num_kv_heads * attn.head_size)
                outs = []
                for part, width, read in zip(("q", "k"), widths, (tap.read, _arg(1, "key"))):
                    out = torch.zeros(max_rows, width, dtype=dtype, device=device)
                    name = f"_hs_out_{index}_{part}"
                    module.register_buffer(name, out, persistent=False)
                    hooked.append((read, name, index, 1.0))
                    outs.append(out)
                self.pattern_buffers[k] = (outs[0], outs[1])
                continue
            width = hidden_size
            if k in self.neuron_modules:
                down = self.neuron_modules[k]
                width = int(getattr(down, "input_size_per_partition", 0) or down.in_features)
            out = torch.zeros(max_rows, width, dtype=dtype, device=device)
            name = f"_hs_out_{index}"
            module.register_buffer(name, out, persistent=False)
            hooked.append((tap.read, name, index, tap.scale))
            if k in self.neuron_modules:
                self.neuron_buffers[k] = out
            else:
                self.buffers[k] = out
        host_counts = self._counts_np if self._on_host else None
        for (module_id, when), module_taps in hooks.items():
            module = modules[module_id]
            if when == "pre":
                module.register_forward_pre_hook(
                    _hook(module_taps, False, host_counts), with_kwargs=True
                )
            else:
                module.register_forward_hook(
                    _hook(module_taps, True, host_counts), with_kwargs=True
                )
        self.layers = list(self.buffers)
        route = write_route(self.rows.device)
        if self.layers:
            logger.info(
                "Hidden states: %d capture points in %d of %d layers of %s.%s (%s), "
                "%d rows each; writes: %s",
                len(self.layers),
                len({k if (p := point_of_id(k, num_layers)) is None else p[1] for k in taps}),
                num_layers,
                type(model).__name__,
                self.layers_name,
                ", ".join(sorted({type(m).__name__ for m in decoder_layers})),
                max_rows,
                route,
            )

    def arm(self, rows: np.ndarray, layers: "Collection[int] | None" = None) -> None:
        """Capture batch rows ``rows`` (int64, at most ``max_rows``) in the
        next forward, at the capture points of ``layers`` (absolute indices;
        None: all of them)."""
        n = len(rows)
        if n > self.max_rows:
            raise ValueError(f"{n} rows asked in one step; the buffers hold {self.max_rows}")
        self._rows_np[:n] = rows
        if self._rows_written > n:
            # Entries past n stay 0 (the invariant above, for the writes that
            # gather without reading the count): only those a larger earlier
            # arm wrote are zeroed.
            self._rows_np[n : self._rows_written] = 0
        self._rows_written = n
        if layers is None:
            self._counts_np[:] = n
        else:
            self._counts_np[:] = 0
            for k in layers:
                if k in self._index:
                    self._counts_np[self._index[k]] = n
        if not self._on_host:
            self.rows.copy_(self.rows_host, non_blocking=True)
            self.counts.copy_(self.counts_host, non_blocking=True)
        elif self.armed is not None:
            self._set_armed(n)
        self.count = n

    def _set_armed(self, n: int) -> None:
        """Point :attr:`armed` at the first ``max(n, ARMED_FLOOR)`` entries
        of ``rows`` (in place: the compiled graph reads this tensor object,
        and its length, on every forward). Entries past ``n`` are 0."""
        assert self.armed is not None
        length = max(n, ARMED_FLOOR)
        if self.armed.shape[0] != length:
            with torch.no_grad():
                self.armed.set_(self.rows.untyped_storage(), 0, (length,), (1,))

    def disarm(self) -> None:
        """No capture in later forwards (profile, dummy and warm-up runs included).

        The index goes back to all zeros too: a write that cannot read the
        count (off CPU; on CPU under torch.compile) gathers every entry, and
        an index left over from a larger batch would read past a smaller
        one's rows (off CPU a device-side assert that kills the engine)."""
        if self.count:
            if self._on_host:
                self._counts_np[:] = 0
                self._rows_np[: self._rows_written] = 0
                self._rows_written = 0
                if self.armed is not None:
                    self._set_armed(0)
            else:
                # The host copy keeps its entries; the next arm zeroes those
                # past its count before copying it over.
                self.rows.zero_()
                self.counts.zero_()
            self.count = 0

    def read(self, k: int) -> torch.Tensor:
        """``[count, hidden_size]``: layer ``k``'s rows of the last forward (a view)."""
        return self.buffers[k][: self.count]

    def read_neurons(self, k: int) -> torch.Tensor:
        """``[count, intermediate_size]``: mlp_post id ``k``'s rows of the last forward."""
        return self.neuron_buffers[k][: self.count]

    def read_pattern(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pattern id ``k``'s query and key rows of the last forward (views)."""
        q, key = self.pattern_buffers[k]
        return q[: self.count], key[: self.count]
