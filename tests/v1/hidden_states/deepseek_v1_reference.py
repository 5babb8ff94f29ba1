# SPDX-License-Identifier: Apache-2.0
"""An eager reference for DeepSeek-MoE (V1, ``DeepseekForCausalLM``), whose
HF code is remote (``modeling_deepseek.py`` of deepseek-ai/deepseek-moe-16b):
no class of transformers runs it. Written for the tests from that published
modelling code, independently of vLLM: its attention, norms, dense MLP and
decoder layer are Llama's (HF's own LlamaForCausalLM modules, as the remote
code's are), and its MoE block is ported here:

* the gate (``MoEGate``): ``softmax(x W^T)`` over the routed experts, the
  top ``num_experts_per_tok`` kept, divided by their sum only where
  ``norm_topk_prob`` (and top_k > 1);
* ``DeepseekMoE``: the routed experts' SwiGLU outputs weighted by those,
  summed, plus the shared experts' (one SwiGLU MLP of
  ``moe_intermediate_size * n_shared_experts``) on the same input;
* a layer's MLP is that block where ``n_routed_experts`` is set, ``layer >=
  first_k_dense_replace`` and ``layer % moe_layer_freq == 0``, Llama's dense
  MLP (``intermediate_size``) elsewhere.

Registered with transformers' Auto classes under the model_type the tiny
model's ``hf_reference/`` declares
(:data:`vllm_hidden_states.tools.tiny_models.DEEPSEEK_V1_REFERENCE_TYPE`)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from vllm_hidden_states.tools.tiny_models import DEEPSEEK_V1_REFERENCE_TYPE


class DeepseekV1ReferenceConfig(LlamaConfig):
    model_type = DEEPSEEK_V1_REFERENCE_TYPE


class SwiGLUExpert(LlamaMLP):
    """``DeepseekMLP``: down(silu(gate(x)) * up(x)), of a given width."""

    def __init__(self, config, intermediate_size: int):
        super().__init__(config)
        hidden = config.hidden_size
        self.gate_proj = nn.Linear(hidden, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden, bias=False)


class MoEGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        assert getattr(config, "scoring_func", "softmax") == "softmax"
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight).softmax(dim=-1)
        weight, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weight


class DeepseekMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList(
            SwiGLUExpert(config, config.moe_intermediate_size)
            for _ in range(config.n_routed_experts)
        )
        self.gate = MoEGate(config)
        self.shared_experts = (
            SwiGLUExpert(config, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        idx, weight = self.gate(x)
        y = torch.zeros_like(x)
        for k in range(idx.shape[-1]):  # each token's k-th pick, expert by expert
            for e, expert in enumerate(self.experts):
                rows = idx[:, k] == e
                if rows.any():
                    y[rows] += weight[rows, k, None] * expert(x[rows])
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)


class DeepseekV1ReferenceForCausalLM(LlamaForCausalLM):
    config_class = DeepseekV1ReferenceConfig

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            if (
                config.n_routed_experts is not None
                and i >= config.first_k_dense_replace
                and i % config.moe_layer_freq == 0
            ):
                layer.mlp = DeepseekMoE(config)


AutoConfig.register(DEEPSEEK_V1_REFERENCE_TYPE, DeepseekV1ReferenceConfig, exist_ok=True)
AutoModelForCausalLM.register(
    DeepseekV1ReferenceConfig, DeepseekV1ReferenceForCausalLM, exist_ok=True
)
