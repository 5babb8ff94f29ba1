# SPDX-License-Identifier: Apache-2.0
"""Families settled by the sweep of issue 54 (none of vLLM's text
architectures left untried), exact at every layer and point
(family_matrix.py) against a reference independent of vLLM on the same
weights: an HF transformers class with the same math (or HF's own class).

* MuseGlimmer (text: ``MuseGlimmerForCausalLM``; Gemma 2's sandwich norms
  with plain adds, a weightless norm on the token embeddings, weightless
  per-head q/k norms with a query scale, a sigmoid gate on the heads'
  outputs, sliding RoPE layers and a NoPE global one every 4th, logits
  scaled then soft-capped): HF's MuseGlimmerTextModel with an LM head on the
  same weights, in the released names (muse_glimmer_reference.py).
* HyperCLOVA X SEED Think 32B's wrapper (``HCXVisionV2ForCausalLM``, among
  vLLM's text architectures: a Qwen2.5-VL vision tower, a projector and the
  language model its text_config names, HyperCLOVAX here), on text prompts:
  HF's own HyperCLOVAXVisionV2ForConditionalGeneration on the same weights
  (hf_reference/), the checkpoint in the released names.
"""

import pytest

from . import muse_glimmer_reference  # noqa: F401  (its Auto classes)
from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("muse_glimmer", "hcx_v2")


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=())
def compiled_arch(request) -> str:
    return request.param
