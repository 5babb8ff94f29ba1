# SPDX-License-Identifier: Apache-2.0
"""Models on vLLM's Transformers backend (HF's own decoder layers): the
stream entering every layer is served, as HF's ``output_hidden_states``
defines it, on GPT-NeoX (parallel residual), OLMo 3 (post-norms, sliding
window) and SmolLM3 (NoPE layers) (Seed-OSS and Hunyuan dense seen too,
outside the suite: ``TRANSFORMERS_BACKEND_SEEN``); steering adds at
every layer; a point inside a layer is refused, naming the class. Each
engine runs in its own process (the backend decorates HF's classes in place,
after which HF cannot run them in this process)."""

import pytest

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_hidden_states.tools.tiny_models import TRANSFORMERS_BACKEND_ARCHS

from .conftest import decoder_layers_of
from .family_matrix import (  # noqa: F401  (collected here)
    _last_engine_is_shut_down,
    test_add_at_every_layer_matches_hf_hooks,
    test_every_layer_of_every_position_matches_hf,
    test_every_layer_of_the_last_token_matches_hf,
)
from .test_architectures import PROMPT, engine_for


@pytest.fixture(scope="module", params=TRANSFORMERS_BACKEND_ARCHS)
def arch(request) -> str:
    return request.param


def test_a_point_inside_a_layer_is_refused_naming_its_class(arch):
    llm, hf = engine_for(arch)
    layer_class = type(decoder_layers_of(hf.model)[1]).__name__
    params = SamplingParams(
        max_tokens=1, return_hidden_states=True, hidden_states_points=["attn_out.1"]
    )
    with pytest.raises(
        VLLMValidationError, match=rf"attn_out.1 is inside decoder layer 1, a {layer_class}"
    ):
        llm.generate([PROMPT], params, use_tqdm=False)
    # The stream entering it is served.
    params.hidden_states_points = ["resid_pre.1"]
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.outputs[0].hidden_states["resid_pre.1"].shape == (1, hf.hidden_size)
