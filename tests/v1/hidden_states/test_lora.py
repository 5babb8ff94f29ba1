# SPDX-License-Identifier: Apache-2.0
"""LoRA: a request served with an adapter is captured with the adapter,
its final token's extract included (the extract carries the request's
``lora_request``), beside plain requests in the same batch.

The adapter is random (rank 4 on q/v/o and the MLP's down projection, PEFT's
file layout), written by the test; the reference is HF transformers with the
same low-rank update merged into its weights by hand, ``W += (alpha / r) B A``.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from vllm import SamplingParams

from .conftest import (
    COMMON_ENGINE_ARGS,
    HFReference,
    assert_close,
    llm_in_process,
    shut_down_in_process,
    token_ids_of,
)

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
PROMPT = "Once upon a time there was a small robot who loved to count"
LAYERS = [1, -1]
POINTS = ["attn_out.2", "mlp_out.1"]


def _module(layer, name: str):
    return getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)


@pytest.fixture(scope="module")
def adapter(qwen3_dir, tmp_path_factory):
    """``(directory, HF with the adapter merged)``."""
    hf = HFReference(qwen3_dir)
    directory = tmp_path_factory.mktemp("lora-adapter")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i, layer in enumerate(hf.model.model.layers):
        for name in TARGETS:
            module = _module(layer, name)
            out_features, in_features = module.weight.shape
            a = torch.randn(RANK, in_features, generator=g) * 0.1
            b = torch.randn(out_features, RANK, generator=g) * 0.1
            block = "self_attn" if hasattr(layer.self_attn, name) else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = b
            with torch.no_grad():
                module.weight += (ALPHA / RANK) * b @ a
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(qwen3_dir),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory, hf


@pytest.fixture(scope="module")
def llm_lora(qwen3_dir):
    engine = llm_in_process(
        model=str(qwen3_dir),
        enable_hidden_states=True,
        hidden_states_points="attn_out,mlp_out",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        enforce_eager=True,
        max_model_len=512,
        **COMMON_ENGINE_ARGS,
    )
    yield engine
    shut_down_in_process(engine)


def params(positions: str) -> SamplingParams:
    return SamplingParams(
        max_tokens=6,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_layers=LAYERS,
        hidden_states_points=POINTS,
        hidden_states_positions=positions,
    )


def assert_matches(out, hf: HFReference, positions: str, what: str) -> None:
    """Every layer and point of ``out`` equals ``hf``'s on its token ids."""
    ids = token_ids_of(out)
    layers, points = hf.states(ids), hf.points(ids)
    rows = slice(None) if positions == "all" else slice(-1, None)
    states = out.outputs[0].hidden_states
    assert list(states) == [*LAYERS, *POINTS], what
    for key, tensor in states.items():
        expected = layers[key] if isinstance(key, int) else points[key]
        assert_close(tensor, expected[rows], f"{what} {positions} {key}")


@pytest.mark.parametrize("positions", ["last", "all"])
def test_a_lora_request_is_captured_with_its_adapter(llm_lora, adapter, hf_qwen3, positions):
    from vllm.lora.request import LoRARequest

    directory, hf_lora = adapter
    lora = LoRARequest("random", 1, str(directory))
    (out,) = llm_lora.generate([PROMPT], params(positions), lora_request=lora, use_tqdm=False)
    assert_matches(out, hf_lora, positions, "with the adapter")
    # The adapter changes the stream: this is not plain vs plain.
    ids = token_ids_of(out)
    plain, merged = hf_qwen3.states(ids)[-1], hf_lora.states(ids)[-1]
    assert (plain - merged).abs().max() / plain.abs().max() > 1e-2


def test_lora_and_plain_requests_in_one_batch_each_keep_their_own_weights(
    llm_lora, adapter, hf_qwen3
):
    """Two requests on the same prompt, one with the adapter: each final
    token's extract runs with its own request's adapter (or none)."""
    from vllm.lora.request import LoRARequest

    directory, hf_lora = adapter
    lora = LoRARequest("random", 1, str(directory))
    with_lora, plain = llm_lora.generate(
        [PROMPT, PROMPT], params("last"), lora_request=[lora, None], use_tqdm=False
    )
    assert_matches(with_lora, hf_lora, "last", "with the adapter beside a plain request")
    assert_matches(plain, hf_qwen3, "last", "plain beside a request with the adapter")
