# SPDX-License-Identifier: Apache-2.0
"""Families settled by the sweep (issue 54: every vLLM text architecture
settled), exact at every layer and point each has (family_matrix.py) against
HF transformers on the same weights.

* GLM-4.7-Flash (Glm4MoeLiteForCausalLM: DeepSeek V2's multi-head latent
  attention in GLM-4.5's layer; a dense first layer, then GLM-4.5's MoE:
  sigmoid routing with a correction bias, renormalized, scaled, a shared
  expert): HF's Glm4MoeLiteForCausalLM; every layer and the points MLA has
  (no patterns, attn_z or q/k/v). vLLM's portable MLA backend (CPU_MLA: its
  AMX one takes bfloat16 only); YaRN rotary, as the DeepSeek tiny models
  (tiny_models: vLLM's eager CPU rotary kernel misplaces the default rope's
  rows of MLA's multi-head queries).

Also run compiled (Dynamo on its eager backend).
"""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("glm4_moe_lite",)


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=SWEEP)
def compiled_arch(request) -> str:
    return request.param
