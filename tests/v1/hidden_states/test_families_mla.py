# SPDX-License-Identifier: Apache-2.0
"""DeepSeek V2 and V3 (multi-head latent attention, a dense first layer,
routed and shared experts; V3's sigmoid routing with a correction bias; Kimi
K2 loads as V3), exact against HF at every layer and point
(family_matrix.py); V3 also compiled. MLA has no attention pattern here
(refused, naming why)."""

import pytest

from .family_matrix import *  # noqa: F403  (the checks, collected here)

MLA = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=MLA)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=("deepseek_v3",))
def compiled_arch(request) -> str:
    return request.param
