# SPDX-License-Identifier: Apache-2.0
"""Families settled by the sweep (issue "The checkpoints people download"),
exact against HF at every layer and point (family_matrix.py): StableLM
(LayerNorms, plain adds, partial rotary), GPT-J (attention and MLP side by
side on one LayerNorm: no resid_mid), Nemotron (LayerNorm1P, squared-ReLU
MLP), Bloom (ALiBi: no attention pattern; its HF attention and MLP add the
residual themselves), Granite MoE shared (routed experts plus a shared MLP:
no mlp_out), Falcon (7B's layout: side by side, multi-query; no pattern, HF
has no causal eager reference), LFM2-MoE (short convolutions beside
attention, a dense first layer, a routing bias), EXAONE MoE (a dense first
layer, shared experts, sliding layers), AFMoE (sandwich norms, a dense first
layer, shared experts, sliding layers), HyperCLOVA X (muP multipliers,
post-norms on both blocks: no attn_out / mlp_out); StableLM also compiled."""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = (
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
)


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=("stablelm",))
def compiled_arch(request) -> str:
    return request.param
