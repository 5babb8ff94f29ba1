# SPDX-License-Identifier: Apache-2.0
"""More families whose HF code is remote (on the Hub) settled by the sweep
(issue 54: every vLLM text architecture settled), exact at every layer and
point (family_matrix.py) against a reference independent of vLLM on the same
weights: an HF transformers class with the same math where one exists, else
an eager port of the family's published modelling code written for these
tests.

* openPangu-Embedded (dense: Llama's blocks with q/k/v and o biases): HF's
  LlamaForCausalLM (attention_bias) on the same weights.
* Param2 MoE (Ling 2.0's layout and router: q/k norms, sigmoid routing with
  an expert bias, grouped, scaled, a shared expert; full rotary): HF's
  Glm4MoeForCausalLM on the same weights in its names.
* Sarvam MoE (vLLM's Ling class): Ling 2.0's tiny model declaring it, HF's
  Glm4MoeForCausalLM on the same weights in its names.
* Sarvam MLA (DeepSeek V3's layers: MLA, DeepSeek's YaRN, sigmoid routing
  with a correction bias, a shared expert): HF's DeepseekV3ForCausalLM on
  the same weights and names.
* Mistral Large 3 (vLLM's DeepSeek V3 class on weights in Mistral's names:
  MLA with a query low rank, softmax top-k renormalized, Llama 4's query
  scaling): the eager reference mistral_large_3_reference.py on HF's
  DeepSeek V2 modules.
"""

import pytest

from . import mistral_large_3_reference  # noqa: F401  (its Auto classes)
from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("pangu_embedded", "param2moe", "sarvam_moe", "sarvam_mla", "mistral_large_3")


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=())
def compiled_arch(request) -> str:
    return request.param
