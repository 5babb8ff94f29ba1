# SPDX-License-Identifier: Apache-2.0
"""Frontier families with dense MLPs, exact against HF at every layer and
point (family_matrix.py): Gemma, GPT-2 (pre-norm plain adds), Ernie 4.5
(vLLM's Llama layer), GLM-4 (sandwich norms), Exaone 4 (post-norms, sliding
and NoPE layers), LFM2 (gated short convolutions beside attention), Gemma 4 (sandwich norms,
per-layer input embeddings, a per-layer scalar); GPT-2 and
Exaone 4 also compiled."""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

DENSE = ("gemma", "gpt2", "ernie45", "glm4", "exaone4", "lfm2", "gemma4")


@pytest.fixture(scope="module", params=DENSE)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=("gpt2", "exaone4"))
def compiled_arch(request) -> str:
    return request.param
