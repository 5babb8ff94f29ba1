# SPDX-License-Identifier: Apache-2.0
"""Frontier families with dense MLPs, exact against HF at every layer and
point (family_matrix.py): Gemma, GPT-2 (pre-norm plain adds), Ernie 4.5
(vLLM's Llama layer), GLM-4 (sandwich norms), Exaone 4 (post-norms, sliding
and NoPE layers), LFM2 (gated short convolutions beside attention), Gemma 4 (sandwich norms,
per-layer input embeddings, a per-layer scalar), Cohere 2 (attention and MLP
side by side; compared with HF run by vLLM's sliding-window convention, one
key wider, and shown to differ from HF's own only beyond the window); GPT-2 and
Exaone 4 also compiled."""

import pytest
import torch

from vllm import SamplingParams
from vllm_hidden_states.tools.tiny_models import SHORT_WINDOW

from .conftest import HFReference, assert_close, assert_prompt_logprobs_match, token_ids_of
from .family_matrix import *  # noqa: F403  (the checks, collected here)
from .test_architectures import PROMPT, engine_for

DENSE = ("gemma", "gpt2", "ernie45", "glm4", "exaone4", "lfm2", "gemma4", "cohere2")


@pytest.fixture(scope="module", params=DENSE)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=("gpt2", "exaone4"))
def compiled_arch(request) -> str:
    return request.param


@pytest.mark.parametrize("arch", ["cohere2"], indirect=True)  # on cohere2's one engine
def test_cohere2_differs_from_hfs_own_mask_only_beyond_its_window(arch):
    """vLLM's Cohere attends to one key more than HF's sliding mask (its
    "training convention"): against HF's own code every layer matches on the
    positions inside the window and differs past it; the final state, put
    through the tied LM head and logit scale, gives the engine's own prompt
    logprobs (the state served is the engine's)."""
    llm, by_vllm_convention = engine_for(arch)
    hf = HFReference(by_vllm_convention.model.name_or_path)  # HF's own window
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        prompt_logprobs=0,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions="prompt",
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    ids = out.prompt_token_ids
    assert len(ids) > SHORT_WINDOW + 2
    states = out.outputs[0].hidden_states
    reference = hf.states(ids)
    inside = slice(0, SHORT_WINDOW)
    for layer in range(hf.num_layers + 1):
        assert_close(states[layer][inside], reference[layer][inside], f"layer {layer}")
    final = states[hf.num_layers]
    beyond = (final[SHORT_WINDOW:] - reference[-1][SHORT_WINDOW:]).abs().max()
    assert beyond / reference[-1].abs().max() > 1e-2
    config = hf.model.config
    with torch.inference_mode():
        logits = hf.model.lm_head(final) * config.logit_scale
    assert_prompt_logprobs_match(out, logits, 1e-4, "cohere2")
    assert token_ids_of(out)
