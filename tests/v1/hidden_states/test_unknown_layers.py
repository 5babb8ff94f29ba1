# SPDX-License-Identifier: Apache-2.0
"""A model whose decoder layers are not verified: nothing is guessed.

A tiny random OPT in OPT-350m's post-LN layout (``do_layer_norm_before``
false) runs on vLLM's own ``OPTForCausalLM``; its layer class is tested in
the pre-LN layout only (test_families_sweep_classic.py), so the post-LN
variant has no reader. The engine serves exactly what does not depend on the
layers, layer 0 (the embedding output entering the first block) and layer -1
(the model's final output), compared here with HF transformers, and refuses
the rest at start and per request, naming why and what is exact. One engine,
in-process.
"""

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_hidden_states.tools.tiny_models import build_tiny_model

from .conftest import (
    COMMON_ENGINE_ARGS,
    MODELS,
    HFReference,
    assert_close,
    assert_prompt_logprobs_match,
    llm_in_process,
    shut_down_in_process,
    token_ids_of,
)

PROMPT = "Once upon a time there was a small robot who loved to count"
ENGINE_ARGS = dict(COMMON_ENGINE_ARGS, max_num_seqs=4, max_model_len=256)


@pytest.fixture(scope="module")
def opt_dir():
    return build_tiny_model(
        MODELS / "tiny-opt-post-ln", arch="opt_post_ln", max_position_embeddings=256
    )


@pytest.fixture(scope="module")
def opt(opt_dir):
    llm = llm_in_process(
        model=str(opt_dir), enable_hidden_states=True, enforce_eager=True, **ENGINE_ARGS
    )
    yield llm, HFReference(opt_dir)
    shut_down_in_process(llm)


def test_an_engine_asked_for_a_layer_it_cannot_read_refuses_at_start(opt_dir):
    with pytest.raises(ValueError) as e:
        LLM(
            model=str(opt_dir),
            enable_hidden_states=True,
            hidden_states_layers=[1, -1],
            enforce_eager=True,
            **ENGINE_ARGS,
        )
    message = str(e.value)
    assert "--hidden-states-layers 1" in message and "OPTDecoderLayer" in message
    assert "do_layer_norm_before=false" in message
    assert "not verified" in message and "hidden_states_layers=[0, -1]" in message


def test_the_embedding_output_and_the_final_state_match_hf(opt):
    llm, hf = opt
    params = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        return_hidden_states=True,
        hidden_states_layers=[0, -1],
        hidden_states_positions="all",
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    ids = token_ids_of(out)
    reference = hf.states(ids)
    states = out.outputs[0].hidden_states
    assert list(states) == [0, -1]
    assert states[0].dtype == torch.float32
    assert_close(states[0], reference[0], "opt layer 0")
    assert_close(states[-1], reference[hf.num_layers], "opt layer -1")


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("hidden_states_layers", [1], "layer 1 is the residual stream entering decoder layer 1"),
        ("hidden_states_layers", [-2], "entering decoder layer 3"),
        ("hidden_states_points", ["resid_pre.2"], "resid_pre.2 is in decoder layer 2"),
    ],
)
def test_a_request_for_a_state_it_cannot_read_is_refused_naming_why(opt, field, value, says):
    llm, _ = opt
    params = SamplingParams(max_tokens=2, return_hidden_states=True, **{field: value})
    with pytest.raises(VLLMValidationError) as e:
        llm.generate([PROMPT], params, use_tqdm=False)
    message = str(e.value)
    assert says in message and "not verified" in message
    assert "0 (the embedding output)" in message and "-1 (the final post-norm state)" in message
    # The engine keeps serving.
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.outputs[0].token_ids


@pytest.fixture(scope="module")
def gemma3n_dir():
    return build_tiny_model(MODELS / "tiny-gemma3n", arch="gemma3n", max_position_embeddings=256)


def test_gemma3n_serves_its_final_state_the_one_its_logits_come_from(gemma3n_dir):
    """HF's own hidden_states[-1] for Gemma 3n is not the final post-norm
    state, and vLLM's Gemma 3n differs from HF's (its prompt logprobs, seen:
    up to 0.17): the served layer -1, through HF's LM head and soft-cap, gives
    the engine's own prompt logprobs. Layer 0 is refused per request too."""
    llm = LLM(model=str(gemma3n_dir), enable_hidden_states=True, enforce_eager=True, **ENGINE_ARGS)
    try:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            prompt_logprobs=0,
            return_hidden_states=True,
            hidden_states_layers=[-1],
            hidden_states_positions="prompt",
        )
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        hf = HFReference(gemma3n_dir)
        final = out.outputs[0].hidden_states[-1]
        assert final.shape == (len(out.prompt_token_ids), hf.hidden_size)
        cap = hf.model.config.final_logit_softcapping
        with torch.inference_mode():
            logits = hf.model.lm_head(final)
            logits = torch.tanh(logits / cap) * cap
        assert_prompt_logprobs_match(out, logits, 1e-4, "gemma3n")
        params.hidden_states_layers = [0]
        with pytest.raises(VLLMValidationError, match="four AltUp streams"):
            llm.generate([PROMPT], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def hrm_text_dir():
    return build_tiny_model(MODELS / "tiny-hrm_text", arch="hrm_text", max_position_embeddings=256)


@pytest.mark.parametrize(
    "arch, why",
    [
        ("gemma3n", "four AltUp streams"),  # its layers take four stacked streams
        ("hrm_text", "several times per"),  # its layers run several times a forward
    ],
)
def test_a_family_whose_layers_hold_no_single_stream_refuses_layer_0_at_start(arch, why, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    with pytest.raises(ValueError, match=rf"--hidden-states-layers 0: .*{why}"):
        LLM(
            model=str(model_dir),
            enable_hidden_states=True,
            hidden_states_layers=[0, -1],
            enforce_eager=True,
            **ENGINE_ARGS,
        )


def test_hrm_text_serves_its_final_state_the_one_hf_gives_with_the_prompt_bidirectional(
    hrm_text_dir,
):
    """vLLM's HRM-Text prefill attends the prompt both ways (prefix_lm); HF's
    does so given the prompt as one block (token_type_ids 1; its default
    forward is causal, seen 0.24 apart in prompt logprobs). The served layer
    -1, through HF's LM head, gives HF's logits for that forward."""
    llm = LLM(model=str(hrm_text_dir), enable_hidden_states=True, enforce_eager=True, **ENGINE_ARGS)
    try:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            return_hidden_states=True,
            hidden_states_layers=[-1],
            hidden_states_positions="prompt",
        )
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        hf = HFReference(hrm_text_dir)
        final = out.outputs[0].hidden_states[-1]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            expected = hf.model(ids, token_type_ids=torch.ones_like(ids)).logits[0]
            logits = hf.model.lm_head(final)
        assert_close(logits, expected, "hrm_text final state through HF's LM head")
    finally:
        llm.llm_engine.engine_core.shutdown()
