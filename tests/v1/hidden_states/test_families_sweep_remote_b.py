# SPDX-License-Identifier: Apache-2.0
"""Families whose HF code is remote (on the Hub) settled by the sweep
(issue 54: every vLLM text architecture settled), exact at every layer and
point (family_matrix.py) against a reference independent of vLLM on the same
weights: an HF transformers class with the same math where one exists, else
an eager port of the family's published modelling code written for these
tests.

* MiniCPM (1 and 2: Llama's blocks with muP scale_emb, scale_depth and
  dim_model_base): HF's Granite, its multipliers set from them, in the same
  weight names; layer -1 the model output times its muP width.
* ChatGLM (GLM-4-9B-chat / ChatGLM3: the plain reader, grouped queries,
  q/k/v biases, half of each head rotated in interleaved pairs): HF's
  GlmForCausalLM on the same weights in its own names (the tiny model's
  hf_reference/).
* DeepSeek-MoE (V1: vLLM's DeepSeek V2 layer class with plain attention,
  read as its multi-head variant; a dense first layer, then softmax top-k
  routed experts, not renormalized, and a shared one): the eager port
  deepseek_v1_reference.py.
* Ling v1 (Bailing MoE: a fused query_key_value, DeepSeek-MoE's experts,
  renormalized): the same port, on its weights in DeepSeek-MoE's names.
* Ling 2.0 (Bailing MoE v2: RMSNorm q/k norms, partial rotary, sigmoid
  routing with an expert bias, grouped, scaled): HF's Glm4MoeForCausalLM on
  the same weights in its names.
* Step 3 (text: one key/value head, a low-rank shared query path, routed
  experts plus a shared expert): the eager port step3_text_reference.py.
* PLaMo 3 (sandwich norms stored less an offset, q/k norms, sliding layers
  with their own rotary base): HF's Gemma3ForCausalLM on the same weights
  in its names.
"""

import pytest

from . import deepseek_v1_reference, step3_text_reference  # noqa: F401  (their Auto classes)
from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = (
    "minicpm",
    "chatglm",
    "deepseek_v1",
    "bailing_moe",
    "bailing_moe_v2",
    "step3_text",
    "plamo3",
)


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=())
def compiled_arch(request) -> str:
    return request.param
