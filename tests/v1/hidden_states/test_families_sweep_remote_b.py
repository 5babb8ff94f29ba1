# SPDX-License-Identifier: Apache-2.0
"""Families whose HF code is remote (on the Hub) settled by the sweep (issue
54: every vLLM text architecture settled), exact at every layer and point
(family_matrix.py) against an HF transformers class with the same math on
the same weights: MiniCPM (1 and 2: Llama's blocks with muP scale_emb,
scale_depth and dim_model_base; HF's Granite, its multipliers set from
them, in the same weight names; layer -1 the model output times its muP
width), ChatGLM (GLM-4-9B-chat / ChatGLM3: the plain reader, grouped
queries, q/k/v biases, half of each head rotated in interleaved pairs;
HF's GlmForCausalLM on the same weights in its own names, the tiny model's
hf_reference/), DeepSeek-MoE (V1: vLLM's DeepSeek V2 layer class with plain
attention, a dense first layer, then softmax top-k routed experts, not
renormalized, and shared ones; against an eager port of its published
modelling code, deepseek_v1_reference.py, on the same weights; no patterns,
attn_z or mlp_post: read by DeepSeek V2's class)."""

import pytest

from . import deepseek_v1_reference  # noqa: F401  (its HF reference's Auto classes)
from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("minicpm", "chatglm", "deepseek_v1", "bailing_moe")


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=())
def compiled_arch(request) -> str:
    return request.param
