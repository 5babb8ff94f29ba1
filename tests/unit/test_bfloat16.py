# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.bfloat16 against torch's own bfloat16."""

import numpy as np
import pytest
import torch

from vllm_hidden_states import bfloat16


def values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-20, 20, 4096)
    return torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, 1.0e-40])])


def test_narrow_rounds_as_torch_does():
    x = values()
    expected = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bfloat16.narrow(x.numpy()), expected)


@pytest.mark.parametrize("order", ["<", ">"])
def test_widen_is_exact_in_either_byte_order(order):
    x = values().to(torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16).astype(order + "u2")
    assert np.array_equal(bfloat16.widen(bits), x.float().numpy())
