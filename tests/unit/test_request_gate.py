# SPDX-License-Identifier: Apache-2.0
"""The test gate (tools/request_gate.py): which requests it holds, and when.

The hold itself (the worker waiting inside a step) is exercised by the
disconnect tests against real servers; here, the bookkeeping, which must
never hold a request that did not name a file, nor one before its first token.
"""

import threading

import torch

from tests.support.request_gate import GATE_ARG, HoldWhileFileExists
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality


def added(index: int, output_ids: list[int], gate=None) -> BatchUpdate:
    params = SamplingParams(extra_args={GATE_ARG: str(gate)} if gate else None)
    return BatchUpdate(
        batch_size=index + 1, removed=[], moved=[], added=[(index, params, [1, 2], output_ids)]
    )


def test_the_gate_leaves_logits_untouched_and_is_applied_to_greedy_requests():
    gate = HoldWhileFileExists(None, torch.device("cpu"), False)
    logits = torch.randn(2, 7)
    assert gate.apply(logits) is logits
    assert gate.is_argmax_invariant() is False


def test_a_request_naming_no_file_is_not_tracked():
    gate = HoldWhileFileExists(None, torch.device("cpu"), False)
    gate.update_state(added(0, [5]))
    assert gate._gated == {}


def test_a_gated_request_is_not_held_before_its_first_token(tmp_path):
    path = tmp_path / "hold"
    path.touch()
    gate = HoldWhileFileExists(None, torch.device("cpu"), False)
    gate.update_state(added(0, [], gate=path))
    gate.apply(torch.zeros(1, 3))  # returns: no token yet, though the file exists


def test_a_gated_request_is_not_held_once_its_file_is_gone(tmp_path):
    gate = HoldWhileFileExists(None, torch.device("cpu"), False)
    gate.update_state(added(0, [5], gate=tmp_path / "absent"))
    gate.apply(torch.zeros(1, 3))


def test_a_held_step_goes_on_when_the_file_is_removed(tmp_path):
    path = tmp_path / "hold"
    path.touch()
    gate = HoldWhileFileExists(None, torch.device("cpu"), False)
    gate.update_state(added(0, [5], gate=path))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (gate.apply(torch.zeros(1, 3)), done.set()))
    worker.start()
    assert not done.is_set()  # held (the file exists; nothing released it)
    path.unlink()
    worker.join(timeout=120)
    assert done.is_set()


def test_a_gated_request_follows_its_moves_and_leaves_on_removal(tmp_path):
    gate = HoldWhileFileExists(None, torch.device("cpu"), False)
    gate.update_state(added(0, [5], gate=tmp_path / "hold"))
    gate.update_state(
        BatchUpdate(
            batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.UNIDIRECTIONAL)]
        )
    )
    assert list(gate._gated) == [1]
    gate.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert gate._gated == {}
