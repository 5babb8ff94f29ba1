# SPDX-License-Identifier: Apache-2.0
"""The frontier families' matrix: test_architectures.py's checks, imported.

Each ``test_families_*.py`` module imports this and defines its own ``arch``
(and ``compiled_arch``) fixture over a group of families, so that pytest's
``--dist loadfile`` runs the groups in parallel processes, each with one
engine alive at a time (test_architectures.py, ``engine_for``). Every family
gets every check of the first matrix: every layer ("last", "all"), every
point and its residual identities, steering at every layer and every kind
(add, ablate) against HF forward hooks, capture after steering, and
attention patterns of the steered forward, per-head patch and ablate_heads
at attn_z (or their refusal where the family has no attn_z).
"""

from .test_architectures import (  # noqa: F401  (collected by the importing module)
    _last_engine_is_shut_down,
    test_add_at_every_layer_matches_hf_hooks,
    test_attention_patterns_are_those_of_the_steered_forward,
    test_compiled_engine_attention_patterns_match_hf_eager,
    test_compiled_engine_matches_hf_at_every_layer,
    test_compiled_engine_matches_hf_at_every_point,
    test_compiled_engine_patches_and_ablates_heads_like_hf_hooks,
    test_compiled_engine_patches_like_hf_hooks,
    test_compiled_engine_steers_like_hf_hooks,
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
