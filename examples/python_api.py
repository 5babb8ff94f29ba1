# SPDX-License-Identifier: Apache-2.0
"""Hidden states from the Python API, checked against HF transformers.

.venv/bin/python examples/python_api.py
"""

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU

import torch
from transformers import AutoModelForCausalLM

from vllm import LLM, SamplingParams
from vllm_hidden_states.tools.tiny_models import build_tiny_model

if __name__ == "__main__":
    model = str(build_tiny_model(".models/tiny-qwen3"))  # 4 layers, hidden 128
    llm = LLM(
        model=model,
        enable_hidden_states=True,
        dtype="float32",
        gpu_memory_utilization=0.2,
        max_model_len=1024,
    )
    params = SamplingParams(
        max_tokens=16,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_layers=[-1, -2, 0],
        hidden_states_positions="last",
    )
    out = llm.generate(["A beautiful sunset over the ocean"], params)[0]
    completion = out.outputs[0]
    for layer, state in completion.hidden_states.items():
        print(f"layer {layer:>2}: shape {tuple(state.shape)}, dtype {state.dtype}")

    # The same vectors from HF transformers, on the same token ids.
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = list(out.prompt_token_ids) + list(completion.token_ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer, state in completion.hidden_states.items():
        err = (state - ref[layer][0, -1:]).abs().max() / ref[layer][0, -1:].abs().max()
        print(f"layer {layer:>2}: relative error vs HF {err:.1e}")
