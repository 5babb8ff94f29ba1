# SPDX-License-Identifier: Apache-2.0
"""``vllm_hidden_states._C``'s CUDA kernels on the GPU: the capture writes what
the aten gather writes, bit for bit, and the steering's add what aten adds;
inside a replayed CUDA graph both read the count armed before each replay.
The CPU tier compiles these kernels with nvcc only
(``tests/install/test_c_ops_build.py``)."""

import os
import shutil

import pytest
import torch

from vllm_hidden_states.worker import c_ops
from vllm_hidden_states.worker.capture_op import gather_rows

TOKENS, WIDTH, MAX_ROWS = 64, 4096 + 64, 48  # width not a multiple of the block


def test_c_has_cuda_kernels_where_nvcc_and_a_cuda_torch_built_it():
    if os.environ.get("VLLM_HIDDEN_STATES_BUILD_C") == "0":
        pytest.skip("VLLM_HIDDEN_STATES_BUILD_C=0: the build was turned off")
    if not shutil.which("nvcc"):
        pytest.skip("no nvcc on this machine: _C was built without CUDA kernels")
    assert c_ops.has_cuda_kernels(), c_ops.why_not() or "_C built without its CUDA kernels"


@pytest.fixture
def c():
    if not c_ops.has_cuda_kernels():
        pytest.skip(f"_C without CUDA kernels here ({c_ops.why_not() or 'built without nvcc'})")
    return torch.ops.vllm_hidden_states


def _capture_inputs(dtype, with_residual):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, device="cuda", generator=g).to(dtype)
    residual = (
        torch.randn(TOKENS, WIDTH, device="cuda", generator=g).to(dtype) if with_residual else None
    )
    rows = torch.zeros(MAX_ROWS, dtype=torch.int64, device="cuda")
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    out = torch.full((MAX_ROWS, WIDTH), 7.0, dtype=dtype, device="cuda")
    return hidden, residual, rows, counts, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("count", [0, 1, MAX_ROWS])
def test_capture_writes_the_armed_rows_bit_for_bit_as_the_aten_gather(
    c, dtype, with_residual, scale, count
):
    hidden, residual, rows, counts, out = _capture_inputs(dtype, with_residual)
    rows.copy_(torch.randperm(TOKENS, device="cuda")[:MAX_ROWS])
    counts[1] = count
    expected = out.clone()
    gather_rows(hidden, residual, rows[:count], expected[:count], scale)
    c.capture(hidden, residual, rows, counts, 1, out, scale)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)  # past the count: untouched


def test_in_a_replayed_cuda_graph_capture_reads_each_replays_count(c):
    hidden, residual, rows, counts, out = _capture_inputs(torch.bfloat16, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured with nothing armed
        c.capture(hidden, residual, rows, counts, 0, out, 1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 7.0)), "a replay with count 0 wrote rows"
    rows[:3] = torch.tensor([5, 0, 63], device="cuda")
    counts[0] = 3
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:3], (hidden + residual)[[5, 0, 63]])
    assert torch.equal(out[3:], torch.full_like(out[3:], 7.0))


def _steer_inputs(dtype, projects: bool):
    g = torch.Generator(device="cuda").manual_seed(1)
    target = torch.randn(TOKENS, WIDTH, device="cuda", generator=g).to(dtype)
    other = torch.randn(TOKENS, WIDTH, device="cuda", generator=g).to(dtype)
    adds = torch.zeros(4, WIDTH, device="cuda")
    dirs = torch.zeros_like(adds)
    adds[1] = torch.randn(WIDTH, device="cuda", generator=g)
    if projects:
        d = torch.randn(WIDTH, device="cuda", generator=g)
        dirs[2] = d / d.norm()
    rows = torch.zeros(1, TOKENS, dtype=torch.int64, device="cuda")
    slots = torch.zeros_like(rows)
    rows[0, :3] = torch.tensor([9, 2, 40], device="cuda")
    slots[0, :3] = torch.tensor([1, 2 if projects else 1, 1], device="cuda")
    counts = torch.tensor([3, int(projects)], device="cuda")
    return target, other, rows, slots, counts, adds, dirs


def _aten_steer(target, other, rows, slots, n, adds, dirs, scale):
    """The op's aten arithmetic (steering._apply / _delta) on the GPU."""
    r, s = rows[0, :n], slots[0, :n]
    x = (target[r].float() + other[r].float()) * scale
    d = dirs[s]
    delta = (adds[s] - (x * d).sum(-1, keepdim=True) * d) / scale
    out = target.clone()
    out.index_add_(0, r, delta.to(target.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_steer_adds_bit_for_bit_as_aten(c, dtype, scale):
    target, other, rows, slots, counts, adds, dirs = _steer_inputs(dtype, projects=False)
    expected = _aten_steer(target, other, rows, slots, 3, adds, dirs, scale)
    c.steer(target, other, rows, slots, counts, 0, adds, dirs, scale)
    torch.cuda.synchronize()
    assert torch.equal(target, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_steer_ablates_as_aten_up_to_the_dot_products_order(c, dtype):
    """The projection's dot product is a block reduction here, a different
    summation order than aten's: equal within float32 rounding of a sum of
    WIDTH terms (then the dtype's); the rows not armed untouched bit for bit."""
    target, other, rows, slots, counts, adds, dirs = _steer_inputs(dtype, projects=True)
    before = target.clone()
    expected = _aten_steer(target, other, rows, slots, 3, adds, dirs, 0.37)
    c.steer(target, other, rows, slots, counts, 0, adds, dirs, 0.37)
    torch.cuda.synchronize()
    armed = [9, 2, 40]
    untouched = [i for i in range(TOKENS) if i not in armed]
    assert torch.equal(target[untouched], before[untouched])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(target[armed].float(), expected[armed].float(), rtol=tol, atol=tol)


def test_in_a_replayed_cuda_graph_steer_reads_each_replays_count(c):
    target, other, rows, slots, counts, adds, dirs = _steer_inputs(torch.bfloat16, False)
    armed_counts = counts.clone()
    counts.zero_()
    before = target.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.steer(target, other, rows, slots, counts, 0, adds, dirs, 1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(target, before), "a replay with count 0 steered"
    counts.copy_(armed_counts)
    expected = _aten_steer(target, other, rows, slots, 3, adds, dirs, 1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(target, expected)
