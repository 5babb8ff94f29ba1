# SPDX-License-Identifier: Apache-2.0
"""Multimodal prompts' bookkeeping: the image rows marked from vLLM's
placeholders, and a finished request's images held for its extract."""

from types import SimpleNamespace

import torch

from vllm.multimodal.inputs import PlaceholderRange
from vllm_hidden_states.engine import held_mm_inputs
from vllm_hidden_states.engine.held_mm_inputs import HeldMMInputs
from vllm_hidden_states.frontend.dispatcher import mm_positions_of


def feature(modality: str, offset: int, length: int, is_embed=None):
    return SimpleNamespace(
        modality=modality, mm_position=PlaceholderRange(offset, length, is_embed=is_embed)
    )


def finished(request_id: str, features: list) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, mm_features=features)


def test_a_text_prompt_marks_no_positions():
    assert mm_positions_of(None) is None
    assert mm_positions_of([]) is None


def test_image_positions_are_each_placeholders_range_by_modality():
    marked = mm_positions_of([feature("image", 3, 2), feature("image", 10, 3)])
    assert marked == {"image": [3, 4, 10, 11, 12]}


def test_only_the_embedding_rows_of_a_placeholder_are_marked():
    """Pixtral's break tokens sit inside the range as text."""
    mask = torch.tensor([True, True, False, True])
    assert mm_positions_of([feature("image", 5, 4, mask)]) == {"image": [5, 6, 8]}


def test_an_extract_takes_its_requests_held_images_once():
    held = HeldMMInputs()
    images = [feature("image", 1, 4)]
    held.hold(finished("r1", images))
    assert held.take("r1") == (images, False)
    assert held.take("r1") == (None, False)


def test_a_text_request_holds_nothing():
    held = HeldMMInputs()
    held.hold(finished("r1", []))
    assert held.take("r1") == (None, False)


def test_images_that_waited_too_long_are_forgotten_and_their_extract_is_told(monkeypatch):
    held = HeldMMInputs()
    now = [100.0]
    monkeypatch.setattr(held_mm_inputs.time, "monotonic", lambda: now[0])
    held.hold(finished("old", [feature("image", 0, 2)]))
    now[0] += held_mm_inputs.HOLD_SECONDS + 1
    held.hold(finished("new", [feature("image", 0, 2)]))
    assert held.take("old") == (None, True)
    assert held.take("new")[0] is not None
