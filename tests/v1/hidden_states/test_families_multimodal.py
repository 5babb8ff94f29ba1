# SPDX-License-Identifier: Apache-2.0
"""The checkpoints people download: multimodal wrappers, exact on text prompts.

Gemma 3 (4B and up), Gemma 4, Llama 4, Mistral Small 3.x, Qwen2.5-VL,
Qwen3-VL, LLaVA, LLaVA-OneVision and InternVL checkpoints declare a
``*ForConditionalGeneration`` architecture with the language model under
``text_config`` (``tools/tiny_vlms.py`` builds each in that shape). Every
check of the family matrix (family_matrix.py) runs on each, against HF's own
``*ForConditionalGeneration`` (``AutoModelForImageTextToText``).
"""

import pytest

from vllm_hidden_states.tools.tiny_vlms import VLM_ARCHS

from .family_matrix import *  # noqa: F403  (the checks, collected here)


@pytest.fixture(scope="module", params=tuple(VLM_ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=("qwen2_5_vl",))
def compiled_arch(request) -> str:
    return request.param
