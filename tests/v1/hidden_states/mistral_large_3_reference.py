# SPDX-License-Identifier: Apache-2.0
"""An eager reference for Mistral Large 3 (``MistralLarge3ForCausalLM``),
whose published code is Mistral's own (mistral-inference; no class of
transformers runs it): DeepSeek V3's layers, multi-head latent attention
with a query low rank, and

* routing: softmax over the gate's logits, the top ``num_experts_per_tok``
  kept and renormalized to sum to one, times ``routed_scaling_factor``
  (Mistral's ``renorm_strategy`` WEIGHTS), plus the shared experts;
* Llama 4's query scaling (``llama_4_scaling``): each query, at position
  ``p``, times ``1 + beta * log(1 + floor(p / original_max_position_
  embeddings))``.

Written for the tests on HF's DeepSeek V2 modules (its MLA, its experts,
its softmax router, whose top-k this renormalizes; the scaling a hook on
each attention's query projection, the query being linear in it), not from
vLLM. Registered with transformers' Auto classes under the model_type the
tiny model's ``hf_reference/`` declares
(:data:`vllm_hidden_states.tools.tiny_models.MISTRAL_LARGE_3_REFERENCE_TYPE`).
"""

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
)
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

from vllm_hidden_states.tools.tiny_models import MISTRAL_LARGE_3_REFERENCE_TYPE


class MistralLarge3ReferenceConfig(DeepseekV2Config):
    model_type = MISTRAL_LARGE_3_REFERENCE_TYPE


class RenormalizedRouter(DeepseekV2TopkRouter):
    """Softmax top-k, the kept weights renormalized, then scaled."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(
            hidden_states.type(torch.float32), self.weight.type(torch.float32)
        )
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights * self.routed_scaling_factor, indices


class MistralLarge3ReferenceForCausalLM(DeepseekV2ForCausalLM):
    config_class = MistralLarge3ReferenceConfig

    def __init__(self, config):
        super().__init__(config)
        scaling = config.llama_4_scaling
        original, beta = scaling["original_max_position_embeddings"], scaling["beta"]
        for layer in self.model.layers:
            if hasattr(layer.mlp, "gate"):
                router = RenormalizedRouter(config)
                router.weight = layer.mlp.gate.weight
                layer.mlp.gate = router
            query = layer.self_attn.q_b_proj if config.q_lora_rank else layer.self_attn.q_proj

            def scale(module, args, output, original=original, beta=beta):
                # [batch, positions, heads * head dim]: the forward runs
                # every position from the first.
                p = torch.arange(output.shape[-2], dtype=torch.float32)
                factor = 1 + beta * torch.log(1 + torch.floor(p / original))
                return output * factor[:, None].to(output.dtype)

            query.register_forward_hook(scale)


# DeepSeek V2's own conversion of its saved per-expert weights into its fused
# expert tensors (transformers keys it by model_type).
register_checkpoint_conversion_mapping(
    MISTRAL_LARGE_3_REFERENCE_TYPE, get_checkpoint_conversion_mapping("deepseek_v2"), overwrite=True
)
AutoConfig.register(MISTRAL_LARGE_3_REFERENCE_TYPE, MistralLarge3ReferenceConfig, exist_ok=True)
AutoModelForCausalLM.register(
    MistralLarge3ReferenceConfig, MistralLarge3ReferenceForCausalLM, exist_ok=True
)
