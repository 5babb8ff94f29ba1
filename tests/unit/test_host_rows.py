# SPDX-License-Identifier: Apache-2.0
"""Captured rows to the host (worker/host_rows.py): a capture spanning several
steps is filled chunk by chunk in place, never concatenated on the CPU."""

import pytest
import torch

from vllm_hidden_states.worker.host_rows import HostCopies, HostRows

CPU = torch.device("cpu")


def chunk(first: int, count: int, layers: int = 3, hidden: int = 8):
    """Device rows of positions first..first+count-1: one [count, hidden] per
    layer, each value naming (layer, position)."""
    pos = torch.arange(first, first + count, dtype=torch.float32)[:, None]
    return [(100 * i + pos).expand(count, hidden).contiguous() for i in range(layers)]


def test_chunks_written_in_place_equal_the_whole_capture():
    copies = HostCopies(CPU)
    rows = HostRows.allocate(copies, first=2, num_rows=10, layers=chunk(2, 4), features=None)
    for first, count in [(2, 4), (6, 5), (11, 1)]:
        rows.write(copies, first, chunk(first, count), None)
    want = torch.stack(chunk(2, 10))
    assert rows.states.shape == (3, 10, 8)
    assert torch.equal(rows.states, want)


def test_the_host_rows_do_not_alias_the_device_buffers():
    copies = HostCopies(CPU)
    device_rows = chunk(0, 2)
    rows = HostRows.allocate(copies, 0, 2, device_rows, None)
    rows.write(copies, 0, device_rows, None)
    device_rows[0].fill_(-1)  # the next forward rewrites the buffers
    assert rows.states[0].min() >= 0


def test_sae_features_keep_their_dtypes_and_fill_like_the_states():
    copies = HostCopies(CPU)
    ids = torch.arange(12, dtype=torch.int32).reshape(6, 2)
    values = torch.linspace(0, 1, 12).reshape(6, 2)
    rows = HostRows.allocate(copies, 0, 6, [], (ids[:3], values[:3]))
    rows.write(copies, 0, [], (ids[:3], values[:3]))
    rows.write(copies, 3, [], (ids[3:], values[3:]))
    assert rows.states is None and rows.num_rows == 6
    assert rows.features[0].dtype == torch.int32 and torch.equal(rows.features[0], ids)
    assert rows.features[1].dtype == torch.float32 and torch.equal(rows.features[1], values)


def test_a_chunk_outside_the_capture_is_an_error_naming_the_positions():
    copies = HostCopies(CPU)
    rows = HostRows.allocate(copies, first=4, num_rows=3, layers=chunk(4, 1), features=None)
    with pytest.raises(RuntimeError, match="rows 6..7 fall outside the capture's positions 4..6"):
        rows.write(copies, 6, chunk(6, 2), None)


def test_on_the_cpu_copies_are_plain_and_there_is_nothing_to_wait_for():
    copies = HostCopies(CPU)
    assert not copies.asynchronous
    copies.record()
    assert copies.take_event() is None
    copies.wait()


@pytest.mark.parametrize("on_host", [True, False], ids=["stack on the CPU", "copy per layer"])
def test_gather_puts_each_layers_rows_in_its_slot_of_one_host_tensor(on_host):
    """Both branches of ``HostCopies.gather``: on the CPU one stack; off it
    (run here on CPU tensors) one copy per layer into a host tensor."""
    copies = HostCopies(CPU)
    copies.on_host = on_host
    rows = [torch.randn(3, 8) for _ in range(2)]
    host = copies.gather(rows)
    assert host.shape == (2, 3, 8)
    for i, layer in enumerate(rows):
        torch.testing.assert_close(host[i], layer)
    rows[0].fill_(0.0)  # the host tensor is its own memory, not a view
    assert host[0].abs().sum() > 0


def test_points_of_their_own_widths_fill_one_host_tensor_each():
    """An mlp_post (16 wide) and an attn_z (6 wide) in one capture: one
    ``[rows, width]`` host tensor per point, filled chunk by chunk."""
    copies = HostCopies(CPU)

    def wide(first: int, count: int) -> list[torch.Tensor]:
        return [chunk(first, count, layers=1, hidden=w)[0] for w in (16, 6)]

    rows = HostRows.allocate(copies, 0, 5, [], None, neurons=wide(0, 2))
    rows.write(copies, 0, [], None, neurons=wide(0, 2))
    rows.write(copies, 2, [], None, neurons=wide(2, 3))
    assert rows.num_rows == 5 and rows.states is None
    captured = rows.captured()
    assert [t.shape for t in captured.neurons] == [(5, 16), (5, 6)]
    assert all(torch.equal(got, want) for got, want in zip(captured.neurons, wide(0, 5)))
