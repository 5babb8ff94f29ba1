# SPDX-License-Identifier: Apache-2.0
"""Frontier families with routed experts, exact against HF at every layer
and point (family_matrix.py): Qwen2-MoE and OLMoE, GLM-4.5 (sigmoid grouped
routing, a dense first layer, shared experts), Llama 4 text (MoE every other
layer, NoPE layers, q/k norms; q and k in HF's per-head order, though vLLM's
loader permutes them), Granite MoE (multipliers), gpt-oss
(attention sinks, sliding and full layers alternating), Ernie 4.5 MoE (a
dense first layer, shared experts); Llama 4 and gpt-oss
also compiled. An MoE block's ``mlp_out`` is its whole output (shared experts
included); ``mlp_post`` is refused."""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

MOE = ("qwen2_moe", "olmoe", "glm4_moe", "llama4", "granitemoe", "gpt_oss", "ernie45_moe")


@pytest.fixture(scope="module", params=MOE)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=("llama4", "gpt_oss"))
def compiled_arch(request) -> str:
    return request.param
