# SPDX-License-Identifier: Apache-2.0
"""Classic families settled by the sweep (issue 54: every vLLM text
architecture settled), exact against HF at every layer and point
(family_matrix.py): OPT in its pre-LN layout (OPT-125m and up: LayerNorms,
learned positions, biases, the MLP inline in the layer; HF pre-scales the
query, vLLM's kernel scales it), MiniCPM3 (muP scale_emb / scale_depth /
dim_model_base, MLA-shaped attention run as plain attention: no q / k / v;
layer -1 the model output times its muP width), Cohere2 MoE (Cohere's side
by side blocks: no resid_mid; a dense first layer, routed experts and a
shared one; sliding layers compared with HF run by vLLM's window, as
Cohere2), MiMo (vLLM's Qwen2 layers, against HF's Qwen2 on the same weights;
layer -1 the model output through its final norm)."""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = (
    "opt",
    "minicpm3",
    "cohere2_moe",
    "mimo",
)


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=())
def compiled_arch(request) -> str:
    return request.param
