# SPDX-License-Identifier: Apache-2.0
"""Hybrid and state-space families settled by the sweep (issue 54: every
vLLM text architecture settled), exact at every layer and point each has
(family_matrix.py) against HF transformers on the same weights.

* Mamba2 (Mamba2 blocks only: norm, mixer, add; vLLM's fused residual):
  HF's Mamba2ForCausalLM, its stream read where it enters each block
  (conftest.STREAM_BY_HOOKS: HF's own hidden_states omit the embedding
  output); each block's mixer output is its attn_out.
* Zamba2 (Mamba2 layers; hybrid layers whose shared attention + MLP block,
  on the stream concatenated with the embedding output, feeds their Mamba2
  mixer's input): HF's Zamba2ForCausalLM; the Mamba2 mixer's output, the one
  thing a layer adds to the stream, is its attn_out.
* Apertus (q/k norms, an MLP without a gate around xIELU, Llama 3 rotary
  scaling): HF's ApertusForCausalLM, its xIELU held in bfloat16 as vLLM
  holds it whatever the model's dtype (test_architectures.REFERENCE_BFLOAT16;
  the checkpoint's xIELU parameters are bfloat16 values).

All three also run compiled (Dynamo on its eager backend).
"""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("mamba2", "zamba2", "apertus")


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=("mamba2", "zamba2", "apertus"))
def compiled_arch(request) -> str:
    return request.param
