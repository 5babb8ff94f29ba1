# SPDX-License-Identifier: Apache-2.0
"""Attention patterns (``attn_pattern.i``): post-softmax weights of the query
heads, ``[heads, queries, keys]``, exact against HF transformers' eager
attention (``output_attentions=True``) on the token ids vLLM reports.

One engine per architecture (in this process) with vLLM's own attention (all of the matrix but
OLMo 2), every layer's pattern capturable, 24-row capture buffers so that
longer sequences are computed over several steps (the keys of earlier chunks
are kept on the device). The tiny models have grouped query heads (2 query
heads, 1 key head); Gemma 2 and 3 a sliding window shorter than the
sequences, Gemma 2 logit soft-capping. Prefill rows ("all", "prompt") and decode rows ("generated",
"last": the final token's row) alike.
"""

import gc

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_hidden_states.points import MAX_PATTERN_POSITIONS
from vllm_hidden_states.tools.tiny_models import CORE_ARCHS, build_tiny_model

from .conftest import (
    COMMON_ENGINE_ARGS,
    MODELS,
    HFReference,
    assert_close,
    in_process_engine,
    shut_down_in_process,
    token_ids_of,
)

PROMPT = "Once upon a time there was a small robot who loved to count"
# Every architecture of the first matrix with vLLM's own attention module in every
# layer (the frontier families' patterns: test_families_*.py; OLMo 2
# runs on the Transformers backend: refused; the hybrids' attention layers
# are checked on test_architectures.py's engines, beside their Mamba2 mixers).
HYBRIDS = ("granitemoehybrid", "nemotron_h", "falcon_h1")
PATTERN_ARCHS = tuple(a for a in CORE_ARCHS if a != "olmo2" and a not in HYBRIDS)


@pytest.fixture(scope="module", params=PATTERN_ARCHS)
def engine(request):
    arch = request.param
    model_dir = build_tiny_model(MODELS / f"tiny-{arch}", arch=arch)
    hf = HFReference(model_dir)
    hf.model.set_attn_implementation("eager")  # the textbook weights, soft-capping included
    with in_process_engine():  # no EngineCore process to start per family
        llm = LLM(
            model=str(model_dir),
            enable_hidden_states=True,
            hidden_states_layers="-1",
            hidden_states_points="attn_pattern,attn_out.1",
            hidden_states_max_rows=24,
            enforce_eager=True,
            max_model_len=512,
            **COMMON_ENGINE_ARGS,
        )
    yield arch, llm, hf
    shut_down_in_process(llm)
    del llm
    gc.collect()


def hf_patterns(hf: HFReference, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """HF eager attention weights, one ``[heads, n, n]`` per layer."""
    with torch.inference_mode():
        out = hf.model(torch.tensor([ids]), output_attentions=True)
    return tuple(a[0] for a in out.attentions)


def patterns_of(llm, hf, positions, prompt=PROMPT, max_tokens=5, **kwargs):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_points=[f"attn_pattern.{i}" for i in range(hf.num_layers)],
        hidden_states_positions=positions,
        **kwargs,
    )
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0].hidden_states, token_ids_of(out), len(out.prompt_token_ids)


def assert_patterns(states, hf, ids, rows: slice, what: str):
    reference = hf_patterns(hf, ids)
    for i in range(hf.num_layers):
        got = states[f"attn_pattern.{i}"]
        expected = reference[i][:, rows]
        assert got.dtype == torch.float32, (what, i)
        assert got.shape == expected.shape, (what, i, got.shape, expected.shape)
        assert_close(got, expected, f"{what} attn_pattern.{i}")


def test_every_position_matches_hf_eager_at_every_layer(engine):
    arch, llm, hf = engine
    states, ids, _ = patterns_of(llm, hf, "all")
    assert_patterns(states, hf, ids, slice(None), f"{arch} all")


def test_last_is_the_final_tokens_row_over_every_key(engine):
    arch, llm, hf = engine
    states, ids, _ = patterns_of(llm, hf, "last")
    assert states["attn_pattern.0"].shape[1:] == (1, len(ids))
    assert_patterns(states, hf, ids, slice(-1, None), f"{arch} last")


def test_decode_rows_of_generated_positions(engine):
    arch, llm, hf = engine
    states, ids, prompt_len = patterns_of(llm, hf, "generated")
    assert states["attn_pattern.0"].shape[1] == len(ids) - prompt_len
    assert_patterns(states, hf, ids, slice(prompt_len, None), f"{arch} generated")


def test_prompt_rows(engine):
    arch, llm, hf = engine
    states, ids, prompt_len = patterns_of(llm, hf, "prompt")
    assert_patterns(states, hf, ids, slice(0, prompt_len), f"{arch} prompt")


def test_a_sequence_longer_than_the_capture_buffers_keeps_every_key(engine):
    """~60 prompt tokens, 24-row buffers: the extract runs in several steps."""
    arch, llm, hf = engine
    prompt = " ".join([PROMPT] * 5)
    states, ids, _ = patterns_of(llm, hf, {"start": 40, "end": 50}, prompt=prompt, max_tokens=2)
    assert len(ids) > 48
    assert_patterns(states, hf, ids, slice(40, 50), f"{arch} long window")


@pytest.mark.parametrize("positions", ["all", "last"])
def test_patterns_beside_layers_and_points_in_one_request(engine, positions):
    """~27 positions, 24-row buffers: the rows of every kind are cut to the
    same positions after a multi-step extract."""
    arch, llm, hf = engine
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_layers=[-1],
        hidden_states_points=["attn_out.1", "blocks.1.attn.hook_pattern"],
        hidden_states_positions=positions,
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    states, ids = out.outputs[0].hidden_states, token_ids_of(out)
    assert len(ids) > 24
    rows = slice(None) if positions == "all" else slice(-1, None)
    assert list(states) == [-1, "attn_out.1", "blocks.1.attn.hook_pattern"]
    assert_close(states[-1], hf.states(ids)[hf.num_layers][rows], f"{arch} layer -1")
    assert_close(states["attn_out.1"], hf.points(ids)["attn_out.1"][rows], f"{arch} attn_out.1")
    pattern = hf_patterns(hf, ids)[1][:, rows]
    assert_close(states["blocks.1.attn.hook_pattern"], pattern, f"{arch} pattern")


def test_a_pattern_request_that_could_pass_the_length_bound_is_refused(engine):
    _, llm, hf = engine
    with pytest.raises(VLLMValidationError, match=f"at most {MAX_PATTERN_POSITIONS} positions"):
        patterns_of(llm, hf, "last", max_tokens=MAX_PATTERN_POSITIONS)
