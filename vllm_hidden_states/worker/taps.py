# SPDX-License-Identifier: Apache-2.0
"""Taps: where each capture id is read in a loaded model.

The decoder-layer list is found generically (:func:`find_decoder_layers`), and
each point is read at a module of its layer by a forward pre- or post-hook,
chosen by the decoder layer's class (``layers.LAYER_CLASSES``): a layer of a
class not known there has no tap. docs/architecture.md, "Capture points".
"""

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from vllm_hidden_states.layers import (
    FUSED_RESIDUAL_LAYOUTS,
    HEADS_OUT_NAMES,
    LayerClass,
    class_name,
    loaded_layer_class,
)
from vllm_hidden_states.points import Z_KIND

# Names a decoder layer's forward uses for its input stream, most common
# first; failing these, the first positional argument that is not a position.
_STREAM_ARG_NAMES = ("hidden_states", "hidden_state", "hidden", "x")
_NOT_STREAM_ARGS = ("positions", "position_ids", "position_embeddings")


def is_pp_placeholder(layer: nn.Module) -> bool:
    from vllm.model_executor.models.utils import PPMissingLayer

    return isinstance(layer, PPMissingLayer)


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The model's decoder-layer list: ``(qualified name, ModuleList)``.

    Rule: of the ``nn.ModuleList`` s whose children are modules (not lists)
    and whose length is ``num_layers`` (the config's ``num_hidden_layers``;
    pipeline-parallel placeholders keep the length), the shallowest; in a
    multimodal model, searched within its language model only (a vision
    tower's blocks may be as many). Raises ``LookupError`` when there is none.
    """
    within = ""
    language_model = getattr(model, "get_language_model", None)
    if callable(language_model):
        inner = language_model()
        within = next((n + "." for n, m in model.named_modules() if m is inner and n), "")
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if name.startswith(within)
        and isinstance(module, nn.ModuleList)
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


def first_arg(names: tuple[str, ...]) -> Reader:
    """The module's first argument (positional, or the first of ``names``)."""

    def read(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, None]:
        if args:
            return args[0], None
        return next(kwargs[n] for n in names if n in kwargs), None

    return read


def arg_reader(i: int, name: str) -> Reader:
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


def child_module(layer: nn.Module, name: str, point: str) -> nn.Module:
    module = getattr(layer, name, None)
    if not isinstance(module, nn.Module):
        raise LookupError(f"{point}: decoder layer {type(layer).__name__} has no {name!r} module")
    return module


def layer_layout(layer: nn.Module, point: str) -> "LayerClass":
    """What is known of ``layer``'s class (:data:`LAYER_CLASSES`); raises
    ``LookupError`` naming it when nothing is: such a layer has no reader."""
    known = loaded_layer_class(layer)
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
    known = loaded_layer_class(layer)
    if known is None and k != 0:
        layer_layout(layer, f"layer {k}")
    if known is not None and known.layout not in FUSED_RESIDUAL_LAYOUTS:
        return Tap(layer, "pre", _hidden_only(stream))
    return Tap(layer, "pre", stream.read_for_hook)


def _path(layer: nn.Module, path: str, point: str) -> nn.Module:
    module = layer
    for name in path.split("."):
        module = child_module(module, name, point)
    return module


def _block_multiplier(layer: nn.Module) -> float:
    """What a "granite" layer multiplies each block's output by before its
    add: Granite's residual_multiplier; MiniCPM3's muP scale_depth /
    sqrt(num_hidden_layers), which its layer reads from its config."""
    multiplier = getattr(layer, "residual_multiplier", None)
    if multiplier is not None:
        return float(multiplier)
    config = layer.config
    return float(config.scale_depth / math.sqrt(config.num_hidden_layers))


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
        # (Cohere's layer returns (stream, the residual as it came): item 0.)
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
                else known.mid_norm
            )
            return Tap(child_module(layer, name, point), "pre", first_arg(("x", "hidden_states")))
        return Tap(layer, "post", _output_item(1 if kind == "resid_mid" else 0))
    if layout == "granite_hybrid":
        # resid + block(x) * residual_multiplier, twice; the layer returns
        # (resid_post, resid_mid). The mixer is attention or Mamba2; the MLP
        # block is the shared MLP, plus routed experts where there are some.
        scale = float(layer.residual_multiplier)
        if kind == "attn_out":
            return Tap(child_module(layer, known.mixer, point), "post", _output_tensor, scale)
        if kind == "mlp_out":
            if getattr(layer, "block_sparse_moe", None) is not None:
                raise LookupError(f"{point}: routed experts in {type(layer).__name__}: untested")
            return Tap(child_module(layer, "shared_mlp", point), "post", _output_tensor, scale)
        return Tap(layer, "post", _output_item(1))
    if layout == "parallel_hybrid":
        # Falcon-H1: resid + (attention + Mamba2), then resid + MLP (its muP
        # multiplier applied inside); the MLP's norm reads resid_mid.
        if kind == "mlp_out":
            return Tap(child_module(layer, "feed_forward", point), "post", _output_tensor)
        return Tap(
            child_module(layer, "pre_ff_layernorm", point), "pre", first_arg(("x", "hidden_states"))
        )
    if layout == "granite":
        # resid + block(x) * residual_multiplier, twice (MiniCPM3: times
        # scale_depth / sqrt(num_hidden_layers), from its config).
        scale = _block_multiplier(layer)
        if kind == "attn_out":
            return Tap(child_module(layer, known.mixer, point), "post", _output_tensor, scale)
        if kind == "mlp_out":
            return Tap(child_module(layer, known.mlp, point), "post", _output_tensor, scale)
        return Tap(
            child_module(layer, known.mid_norm, point),
            "pre",
            first_arg(("x", "hidden_states")),
        )
    if layout in ("plain", "parallel"):
        # resid + block(norm(x)): GPT-2's blocks one after the other (the
        # MLP's norm reads resid_mid), Cohere's side by side on one norm
        # (Zamba2's hybrid layer: its mixer inside its Mamba layer).
        if kind == "attn_out":
            return Tap(_path(layer, known.mixer, point), "post", _output_tensor)
        if kind == "mlp_out":
            return Tap(child_module(layer, known.mlp, point), "post", _output_tensor)
        return Tap(
            child_module(layer, known.mid_norm, point), "pre", first_arg(("x", "hidden_states"))
        )
    if layout == "post_norm":
        # resid + post_norm(block(x)), twice; resid_mid read where the MLP
        # block takes it (the MLP itself, or Gemma 4's pre-MLP norm).
        if kind == "attn_out":
            return Tap(
                child_module(layer, "post_attention_layernorm", point), "post", _output_tensor
            )
        if kind == "mlp_out":
            return Tap(
                child_module(layer, "post_feedforward_layernorm", point), "post", _output_tensor
            )
        return Tap(
            child_module(layer, known.mid_norm, point), "pre", first_arg(("hidden_states", "x"))
        )
    raise LookupError(f"{point}: no reader for layout {layout!r} of {type(layer).__name__}")


def neuron_module(layer: nn.Module, point: str) -> nn.Module:
    """The dense MLP's down projection of ``layer`` (its input: ``mlp_post``)."""
    known = layer_layout(layer, point)
    if known.neurons is None:
        raise LookupError(f"{point}: {type(layer).__name__}'s MLP is a mixture of experts")
    if getattr(layer, "block_sparse_moe", None) is not None:
        raise LookupError(f"{point}: routed experts in {type(layer).__name__}: untested")
    return _path(layer, known.neurons, point)


def heads_out_module(layer: nn.Module, point: str) -> nn.Module:
    """The attention's output projection of ``layer``: its input, ``[tokens,
    heads * head_dim]`` (the heads' outputs side by side), is ``attn_z``.
    The first of :data:`~vllm_hidden_states.layers.HEADS_OUT_NAMES` inside
    the layer's mixer, where the mixer is vLLM's attention."""
    known = layer_layout(layer, point)
    if not known.attention or (known.kinds is not None and Z_KIND not in known.kinds):
        raise LookupError(f"{point}: {type(layer).__name__} has no heads' outputs to read")
    mixer = _path(layer, known.mixer, point)  # (EXAONE 3's: attn.attention)
    for name in HEADS_OUT_NAMES:
        module = getattr(mixer, name, None)
        if isinstance(module, nn.Module):
            return module
    raise LookupError(
        f"{point}: {type(mixer).__name__} ({type(layer).__name__}.{known.mixer}) has none of "
        f"{list(HEADS_OUT_NAMES)}, the attention output projections known"
    )


def flat_arg_reader(i: int, name: str) -> Reader:
    """The module's argument ``i`` (positional, or keyword ``name``) as
    ``[tokens, width]``: vLLM's attention takes queries, keys and values flat
    (``[tokens, heads * head_size]``) or per head (``[tokens, heads,
    head_size]``), the same values either way."""

    def read(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, None]:
        t = args[i] if len(args) > i else kwargs[name]
        return t.reshape(t.shape[0], -1), None

    return read


# The argument of vLLM's ``Attention.forward`` each of q, k, v is.
QKV_ARGS: dict[str, tuple[int, str]] = {"q": (0, "query"), "k": (1, "key"), "v": (2, "value")}


def qkv_module(layer: nn.Module, point: str) -> nn.Module:
    """vLLM's ``Attention`` of ``layer``, whose query, key and value
    arguments are the points q, k, v (after the QKV projection, QK-norm and
    rotary embedding: what its kernel reads)."""
    known = layer_layout(layer, point)
    if not known.attention or known.qkv or (known.kinds is not None and Z_KIND not in known.kinds):
        raise LookupError(f"{point}: {type(layer).__name__} has no queries, keys, values to read")
    return _path(layer, f"{known.mixer}.attn", point)


def qkv_width(attn: nn.Module, kind: str) -> int:
    """A q / k / v row's width at vLLM attention ``attn``: heads x head
    size for q, KV heads x head size for k, KV heads x value head size for v."""
    if kind == "q":
        return int(attn.num_heads) * int(attn.head_size)
    if kind == "k":
        return int(attn.num_kv_heads) * int(attn.head_size)
    return int(attn.num_kv_heads) * int(getattr(attn, "head_size_v", attn.head_size))


def qk_halves_head_size(layer: nn.Module, attn: nn.Module, kind: str) -> int | None:
    """The head size of q / k point ``kind`` at ``layer``'s attention
    ``attn`` where vLLM holds each head's dimensions in halves order (its
    class's ``qk_halves``: Llama 4), to be put back in HF's order by
    :func:`heads_in_hf_order`; None where the rows are in HF's order already
    (v, and every other class)."""
    known = loaded_layer_class(layer)
    if kind not in ("q", "k") or known is None or not known.qk_halves:
        return None
    return int(attn.head_size)


def heads_in_hf_order(rows: torch.Tensor, head_size: int) -> torch.Tensor:
    """``rows`` (``[n, heads * head_size]``, whole heads side by side) with
    each head's dimensions in HF's order, where vLLM holds them in halves
    order: Llama 4's loader permutes each q_proj / k_proj head's output rows
    (``permute_qk_weight_for_rotary``: ``view(heads, head_size // 2, 2, in)
    .transpose(1, 2)``) so that it can apply neox-style rotary, HF's
    dimension ``2j`` becoming ``j`` and ``2j + 1`` becoming ``head_size // 2
    + j``. Its inverse, on the rows being copied out (a new tensor); the
    same for any number of whole heads (one rank's, or all of them)."""
    n, width = rows.shape
    halves = rows.reshape(n, width // head_size, 2, head_size // 2)
    return halves.transpose(-1, -2).reshape(n, width)


def attention_module(layer: nn.Module, point: str) -> nn.Module:
    """vLLM's ``Attention`` of ``layer``, whose query and key arguments give
    its pattern."""
    known = layer_layout(layer, point)
    if not known.attention:
        raise LookupError(f"{point}: {type(layer).__name__} has no vLLM attention module")
    return _path(layer, f"{known.mixer}.attn", point)
