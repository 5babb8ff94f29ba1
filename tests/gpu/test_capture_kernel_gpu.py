# SPDX-License-Identifier: Apache-2.0
"""The capture op's CUDA route on the GPU: the Triton kernel writes what the
aten gather writes, bit for bit, and inside a replayed CUDA graph it reads
the count armed before each replay (the CPU tier runs the same kernel only
through Triton's interpreter)."""

import pytest
import torch

from vllm_hidden_states.worker import capture_kernel
from vllm_hidden_states.worker.capture_op import _gather_every_entry

TOKENS, WIDTH, MAX_ROWS = 64, 4096 + 64, 48  # width not a multiple of the block


def _inputs(dtype: torch.dtype, with_residual: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, device="cuda", generator=g).to(dtype)
    residual = (
        torch.randn(TOKENS, WIDTH, device="cuda", generator=g).to(dtype) if with_residual else None
    )
    rows = torch.zeros(MAX_ROWS, dtype=torch.int64, device="cuda")
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    out = torch.full((MAX_ROWS, WIDTH), 7.0, dtype=dtype, device="cuda")
    return hidden, residual, rows, counts, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_the_kernel_writes_the_armed_rows_bit_for_bit_as_the_aten_gather(
    dtype, with_residual, scale
):
    hidden, residual, rows, counts, out = _inputs(dtype, with_residual)
    armed = torch.randperm(TOKENS, device="cuda")[:MAX_ROWS]
    rows.copy_(armed)
    counts[1] = MAX_ROWS
    expected = out.clone()
    _gather_every_entry(hidden, residual, rows, expected, scale)
    assert capture_kernel.gather(hidden, residual, rows, counts, 1, out, scale)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_in_a_replayed_cuda_graph_the_kernel_reads_each_replays_count():
    hidden, residual, rows, counts, out = _inputs(torch.bfloat16, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured with nothing armed
        capture_kernel.gather(hidden, residual, rows, counts, 0, out, 1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 7.0)), "a replay with count 0 wrote rows"
    rows[:3] = torch.tensor([5, 0, 63], device="cuda")
    counts[0] = 3
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:3], (hidden + residual)[[5, 0, 63]])
    assert torch.equal(out[3:], torch.full_like(out[3:], 7.0))
