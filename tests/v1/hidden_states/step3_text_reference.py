# SPDX-License-Identifier: Apache-2.0
"""An eager reference for Step 3's text model (``Step3TextForCausalLM``),
whose HF code is remote (stepfun-ai/step3's ``modeling_step3.py``: no class
of transformers runs it). Written for the tests from that published
modelling code, independently of vLLM, on HF's Llama modules where the
remote code's are Llama's (norms, rotary, the dense SwiGLU MLP, the
decoder layer's pre-norm residuals):

* attention (``Step3vAttention``): one key/value head; the query through a
  shared low-rank projection, ``wq(inter_norm(q_proj(x)))`` (an RMSNorm of
  width share_q_dim), split into heads; neox rotary on queries and keys;
* MoE layers (those ``moe_layers_enum`` lists; all but the first without
  it): routed experts (``Step3vMoEMLP``: softmax over the gate's logits in
  float32, the top ``moe_top_k`` kept, not renormalized unless
  ``norm_expert_weight``; experts' weights stacked, ``[experts, out, in]``)
  plus a shared expert (``share_expert``, width share_expert_dim), their
  outputs summed; dense layers: a SwiGLU MLP of ``intermediate_size``.

The MoE layer's two blocks sit under one ``mlp`` module here (``mlp.moe``,
``mlp.share_expert``), whose output is the sum the remote layer adds: the
reference's weights are the released ones renamed so (the tiny model's
``hf_reference/``). Registered with transformers' Auto classes under the
model_type that directory declares
(:data:`vllm_hidden_states.tools.tiny_models.STEP3_TEXT_REFERENCE_TYPE`)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from vllm_hidden_states.tools.tiny_models import STEP3_TEXT_REFERENCE_TYPE

from .deepseek_v1_reference import SwiGLUExpert  # the same expert, of a given width


class Step3TextReferenceConfig(LlamaConfig):
    model_type = STEP3_TEXT_REFERENCE_TYPE


def moe_layers(config) -> list[int]:
    enum = getattr(config, "moe_layers_enum", None)
    if enum is not None:
        return [int(i) for i in str(enum).strip().split(",")]
    return list(range(1, config.num_hidden_layers))


class Step3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        q_size = config.share_q_dim
        heads = config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.inter_norm = LlamaRMSNorm(q_size, eps=config.rms_norm_eps)
        self.wq = nn.Linear(q_size, heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=False)
        self.num_key_value_groups = heads  # one key/value head

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        past_key_values=None,
        **kwargs,
    ):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.wq(self.inter_norm(self.q_proj(hidden_states)))
        query_states = query.view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(
                key_states, value_states, self.layer_idx
            )
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class MoELinear(nn.Module):
    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x, expert: int):
        return F.linear(x, self.weight[expert])


class Step3MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        experts, hidden, width = (
            config.moe_num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        self.top_k = config.moe_top_k
        self.renormalize = bool(getattr(config, "norm_expert_weight", False))
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.gate_proj = MoELinear(experts, hidden, width)
        self.up_proj = MoELinear(experts, hidden, width)
        self.down_proj = MoELinear(experts, width, hidden)

    def forward(self, x):
        weights = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for k in range(self.top_k):
            for e in range(self.gate.out_features):
                rows = chosen[:, k] == e
                if rows.any():
                    h = x[rows]
                    y = self.down_proj(F.silu(self.gate_proj(h, e)) * self.up_proj(h, e), e)
                    out[rows] += y * weights[rows, k, None]
        return out


class Step3MoEBlock(nn.Module):
    """A MoE layer's routed experts plus its shared expert: the sum the
    remote decoder layer adds to the stream."""

    def __init__(self, config):
        super().__init__()
        self.moe = Step3MoE(config)
        self.share_expert = SwiGLUExpert(config, config.share_expert_dim)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        return (self.moe(x) + self.share_expert(x)).reshape(shape)


class Step3TextReferenceForCausalLM(LlamaForCausalLM):
    config_class = Step3TextReferenceConfig

    def __init__(self, config):
        super().__init__(config)
        moe = set(moe_layers(config))
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Step3Attention(config, i)
            if i in moe:
                layer.mlp = Step3MoEBlock(config)


AutoConfig.register(STEP3_TEXT_REFERENCE_TYPE, Step3TextReferenceConfig, exist_ok=True)
AutoModelForCausalLM.register(
    Step3TextReferenceConfig, Step3TextReferenceForCausalLM, exist_ok=True
)
