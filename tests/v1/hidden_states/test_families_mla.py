# SPDX-License-Identifier: Apache-2.0
"""DeepSeek V2 and V3 (multi-head latent attention, a dense first layer,
routed and shared experts; V3's sigmoid routing with a correction bias; Kimi
K2 loads as V3), exact against HF at every layer and point
(family_matrix.py's eager checks). MLA has no attention pattern here
(refused, naming why). Compiled V3 passed once here and failed once on a
fresh clone (the last token after its first MoE layer, 19%): not in the
suite until that is understood."""

import pytest

from .family_matrix import (  # noqa: F401  (collected here)
    _last_engine_is_shut_down,
    test_add_at_every_layer_matches_hf_hooks,
    test_attention_patterns_are_those_of_the_steered_forward,
    test_every_layer_of_every_position_matches_hf,
    test_every_layer_of_the_last_token_matches_hf,
    test_every_point_of_every_position_matches_hf,
    test_every_point_of_the_last_token_matches_hf,
    test_every_steerable_kind_matches_hf_hooks,
    test_heads_are_patched_and_ablated_like_hf_hooks,
    test_patch_at_every_steerable_kind_matches_hf_hooks,
    test_points_are_captured_after_the_steering_at_them,
    test_points_satisfy_the_residual_identities,
)

MLA = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=MLA)
def arch(request) -> str:
    return request.param
