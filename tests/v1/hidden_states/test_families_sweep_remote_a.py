# SPDX-License-Identifier: Apache-2.0
"""Families whose HF classes are remote code, settled by the sweep (issue
54: every vLLM text architecture settled), exact at every layer and point
(family_matrix.py) against an HF transformers class with the same math, run
on the same weights saved in its own layout (the tiny model's hf_reference/,
tools/tiny_models.py RELEASED_LAYOUTS): InternLM2 (packed wqkv, GQA; HF's
Llama), EXAONE 3 (transformer.h, attn.attention; HF's Llama), TeleChat2
(per-head key_value, biases on the attention's output and the MLP's down
projection only; HF's Llama with those biases, the others zero), Orion
(Llama between LayerNorms, plain adds; HF's StableLM with whole-head rotary
and no q/k/v biases, on the checkpoint itself), Tele-FLM (Llama with μP
logit scaling, input_mult 1; HF's Llama on the checkpoint itself), DeciLM
(Nemotron-NAS: a layer without attention, one without an FFN, FFNs of two
widths; an eager reference from its published modelling,
decilm_reference.py, on HF's Llama modules)."""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("internlm2", "exaone", "telechat2", "orion", "teleflm", "decilm")


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=())
def compiled_arch(request) -> str:
    return request.param
