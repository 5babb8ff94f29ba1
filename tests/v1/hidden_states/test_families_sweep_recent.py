# SPDX-License-Identifier: Apache-2.0
"""Recent families settled by the sweep (issue 54: every vLLM text
architecture settled), exact against HF at every layer and point
(family_matrix.py): Hy3 (HYV3: q/k norms, a dense first layer, then routed
experts, sigmoid with a correction bias, normalized and scaled, and a
shared MLP), A.X K1 (DeepSeek-V3's layers, MLA: no pattern, no attn_z; a
norm on each MoE block's output)."""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

SWEEP = ("hy_v3", "axk1")


@pytest.fixture(scope="module", params=SWEEP)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=())
def compiled_arch(request) -> str:
    return request.param
