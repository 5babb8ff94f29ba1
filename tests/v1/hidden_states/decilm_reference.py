# SPDX-License-Identifier: Apache-2.0
"""An eager reference for DeciLM (Nemotron-NAS), written for the tests from
its published modelling (NVIDIA's remote modeling_decilm.py, not vLLM's):
HF transformers' own Llama attention, MLP and RMSNorm; each layer's
block_config choosing whether it attends (``attention.no_op``: no attention
and no norm before it) and its FFN's width (``ffn.ffn_mult``: 2/3 of it times
the hidden size, rounded up to a multiple of 256) or no FFN (``ffn.no_op``);
pre-norm blocks and plain adds; Llama's final norm and LM head. Registered
with HF's Auto classes as model_type ``hs_decilm_reference`` (the tiny
model's hf_reference/ declares it)."""

import copy

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def _ffn_width(ffn_mult: float, hidden_size: int) -> int:
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


class DeciLMReferenceConfig(LlamaConfig):
    model_type = "hs_decilm_reference"


class DeciLMReferenceLayer(LlamaDecoderLayer):
    """Llama's layer with the blocks its block_config has."""

    def __init__(self, config: DeciLMReferenceConfig, layer_idx: int):
        block = config.block_configs[layer_idx]
        attention, ffn = block["attention"], block["ffn"]
        own = copy.deepcopy(config)
        if not attention.get("no_op"):
            own.num_key_value_heads = config.num_attention_heads // attention["n_heads_in_group"]
        if not ffn.get("no_op"):
            own.intermediate_size = _ffn_width(ffn["ffn_mult"], config.hidden_size)
        super().__init__(own, layer_idx)
        if attention.get("no_op"):
            self.self_attn = self.input_layernorm = None
        else:  # the model's config: its attention implementation (eager in the tests)
            self.self_attn.config = config
        if ffn.get("no_op"):
            self.mlp = self.post_attention_layernorm = None
        # The one block where the other is a no-op (conftest.point_sites).
        one = {(True, False): "mlp_out", (False, True): "attn_out"}
        self.hs_single_block = one.get((bool(attention.get("no_op")), bool(ffn.get("no_op"))))

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        if self.self_attn is not None:
            residual = hidden_states
            attended, _ = self.self_attn(
                hidden_states=self.input_layernorm(hidden_states),
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            hidden_states = residual + attended
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class DeciLMReferenceForCausalLM(LlamaForCausalLM):
    config_class = DeciLMReferenceConfig

    def __init__(self, config: DeciLMReferenceConfig):
        super().__init__(config)
        self.model.layers = nn.ModuleList(
            DeciLMReferenceLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.post_init()


AutoConfig.register("hs_decilm_reference", DeciLMReferenceConfig, exist_ok=True)
AutoModelForCausalLM.register(DeciLMReferenceConfig, DeciLMReferenceForCausalLM, exist_ok=True)
