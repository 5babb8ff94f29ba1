# SPDX-License-Identifier: Apache-2.0
"""``vllm_hidden_states._C`` on CPU: its capture and steering ops write what
the aten routes write, bit for bit (float32, float16, bfloat16; counts 0, 1
and the most; with and without the residual; scale 1 and 0.37), eagerly and
under torch.compile, and CPU eager forwards use them.

The CUDA kernels: ``tests/install/test_c_ops_build.py`` compiles them with
nvcc; ``tests/gpu/test_c_ops_gpu.py`` runs them on a GPU.
"""

import importlib.util
import os
import shutil
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from vllm_hidden_states.worker import c_ops, capture_op, capture_points, steering_op
from vllm_hidden_states.worker.capture_op import gather_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOKENS, WIDTH, MAX_ROWS = 11, 300, 8  # WIDTH: not a multiple of any vector width
ARMED = {"0": [], "1": [7], "max": [10, 0, 3, 9, 5, 1, 2, 6]}


def test_c_is_built_where_cmake_and_a_compiler_are_found():
    """`make setup` builds _C here unless told not to; a missing _C is then a
    failed build, not a reason to skip the tests below."""
    if os.environ.get("VLLM_HIDDEN_STATES_BUILD_C") == "0":
        pytest.skip("VLLM_HIDDEN_STATES_BUILD_C=0: the build was turned off")
    if not (shutil.which("cmake") and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("no cmake or C++ compiler on this machine: _C is not built")
    assert c_ops.load(), c_ops.why_not()


@pytest.fixture
def c():
    if not c_ops.load():
        pytest.skip(f"no _C: {c_ops.why_not()}")
    return torch.ops.vllm_hidden_states


@contextmanager
def python_body():
    """The ops' Python bodies (the aten route), even where _C is built."""
    c_ops.disable(True)
    try:
        yield
    finally:
        c_ops.disable(False)


def _stream(dtype, seed=0):
    return torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _capture_inputs(dtype, with_residual, armed):
    hidden = _stream(dtype, 0)
    residual = _stream(dtype, 1) if with_residual else None
    rows = torch.zeros(MAX_ROWS, dtype=torch.int64)
    rows[: len(armed)] = torch.tensor(armed, dtype=torch.int64)
    counts = torch.tensor([0, len(armed), 0])
    out = torch.full((MAX_ROWS, WIDTH), 7.0, dtype=dtype)
    return hidden, residual, rows, counts, out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("count", list(ARMED))
def test_capture_writes_the_armed_rows_bit_for_bit_as_the_aten_gather(
    c, dtype, with_residual, scale, count
):
    hidden, residual, rows, counts, out = _capture_inputs(dtype, with_residual, ARMED[count])
    n = len(ARMED[count])
    expected = out.clone()
    gather_rows(hidden, residual, rows[:n], expected[:n], scale)
    c.capture(hidden, residual, rows, counts, 1, out, scale)
    assert torch.equal(out, expected)  # rows past the count untouched (7.0)


def test_capture_reads_a_query_sliced_out_of_a_fused_projection(c):
    qkv = torch.randn(TOKENS, 3 * WIDTH, dtype=torch.bfloat16)
    hidden = qkv[:, :WIDTH]  # rows strided by 3 x WIDTH
    _, residual, rows, counts, out = _capture_inputs(torch.bfloat16, True, ARMED["max"])
    expected = out.clone()
    gather_rows(hidden, residual, rows, expected, 0.37)
    c.capture(hidden, residual, rows, counts, 1, out, 0.37)
    assert torch.equal(out, expected)


def test_capture_of_a_row_past_the_forwards_tokens_is_an_index_error(c):
    hidden, residual, rows, counts, out = _capture_inputs(torch.float32, True, [2, TOKENS])
    with pytest.raises(IndexError, match=f"row {TOKENS} .*outside the forward's {TOKENS} tokens"):
        c.capture(hidden, residual, rows, counts, 1, out, 1.0)


# -- steering -------------------------------------------------------------------

SLOTS, POINTS = 6, 2


def _tables(clamp: bool):
    g = torch.Generator().manual_seed(3)
    adds, dirs = torch.zeros(SLOTS, WIDTH), torch.zeros(SLOTS, WIDTH)
    adds[1] = torch.randn(WIDTH, generator=g)  # add
    d = torch.randn(WIDTH, generator=g)
    dirs[2] = d / d.norm()  # ablate
    adds[3], dirs[3] = torch.randn(WIDTH, generator=g), dirs[2]  # composed
    enc = dec = par = None
    if clamp:
        enc, dec, par = torch.zeros(SLOTS, WIDTH), torch.zeros(SLOTS, WIDTH), torch.zeros(SLOTS, 3)
        enc[4] = torch.randn(WIDTH, generator=g) / WIDTH**0.5
        dec[4] = torch.randn(WIDTH, generator=g)
        par[4] = torch.tensor([0.1, 0.05, 3.0])
    return adds, dirs, enc, dec, par


def _steer_inputs(count: str, kind: str):
    """Point 1 armed with ``count`` entries of ``kind``'s slots."""
    armed = ARMED[count]
    slot_of = {"add": [1], "project": [1, 2, 3], "clamp": [1, 2, 3, 4]}[kind]
    rows = torch.zeros(POINTS, TOKENS, dtype=torch.int64)
    slots = torch.zeros_like(rows)
    rows[1, : len(armed)] = torch.tensor(armed, dtype=torch.int64)
    slots[1, : len(armed)] = torch.tensor(
        [slot_of[i % len(slot_of)] for i in range(len(armed))], dtype=torch.int64
    )
    counts = torch.tensor([0, len(armed), 0, int(kind != "add")])
    return rows, slots, counts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_other", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("count", list(ARMED))
@pytest.mark.parametrize("kind", ["add", "project", "clamp"])
def test_steer_writes_bit_for_bit_what_the_python_body_writes(
    c, dtype, with_other, scale, count, kind
):
    adds, dirs, enc, dec, par = _tables(kind == "clamp")
    rows, slots, counts = _steer_inputs(count, kind)
    target = _stream(dtype, 0)
    other = _stream(dtype, 1) if with_other else None
    expected = target.clone()
    with python_body():
        vectors = [adds, dirs] if enc is None else [adds, dirs, enc, dec, par]
        steering_op._steer(expected, other, [rows, slots, counts], 1, vectors, scale)
    got = target.clone()
    c.steer(got, other, rows, slots, counts, 1, adds, dirs, scale, enc, dec, par)
    assert torch.equal(got, expected)
    assert torch.equal(got, target) == (count == "0")


def test_steer_with_a_slot_past_the_table_is_an_index_error(c):
    adds, dirs, *_ = _tables(False)
    rows, slots, counts = _steer_inputs("1", "add")
    slots[1, 0] = SLOTS
    with pytest.raises(IndexError, match=f"slot {SLOTS} outside the {SLOTS} table slots"):
        c.steer(_stream(torch.float32), None, rows, slots, counts, 1, adds, dirs, 1.0)


# -- under torch.compile: traced through the Meta kernels -----------------------


def _graph_targets(fn, *args):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=keep, fullgraph=True)
    compiled(*args)
    return [str(node.target) for gm in graphs for node in gm.graph.nodes]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_capture_traces_the_op_and_writes_as_eager(c, dtype):
    hidden, residual, rows, counts, out = _capture_inputs(dtype, True, ARMED["max"])

    def forward(x, out):
        x = x * 2.0  # an intermediate, as in a model
        c.capture(x, residual, rows, counts, 1, out, 0.37)
        return x + 1.0

    assert any("vllm_hidden_states.capture" in t for t in _graph_targets(forward, hidden, out))
    expected = out.clone()
    gather_rows(hidden * 2.0, residual, rows, expected, 0.37)
    got = out.clone()
    result = torch.compile(forward, backend="aot_eager", fullgraph=True)(hidden, got)
    assert torch.equal(got, expected)
    assert torch.equal(result, hidden * 2.0 + 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_steer_traces_the_op_and_steers_as_eager(c, dtype):
    adds, dirs, enc, dec, par = _tables(True)
    rows, slots, counts = _steer_inputs("max", "clamp")
    other = _stream(dtype, 1)

    def forward(x):
        x = x * 2.0
        c.steer(x, other, rows, slots, counts, 1, adds, dirs, 0.37, enc, dec, par)
        return x + 1.0

    assert any("vllm_hidden_states.steer" in t for t in _graph_targets(forward, _stream(dtype)))
    expected = _stream(dtype) * 2.0
    with python_body():
        vectors = [adds, dirs] if enc is None else [adds, dirs, enc, dec, par]
        steering_op._steer(expected, other, [rows, slots, counts], 1, vectors, 0.37)
    got = torch.compile(forward, backend="aot_eager", fullgraph=True)(_stream(dtype))
    assert torch.equal(got, expected + 1.0)


# -- the route CPU eager forwards take ------------------------------------------


def test_cpu_eager_capture_writes_with_c_not_the_python_body(c, monkeypatch):
    def python_gather(*args, **kwargs):
        raise AssertionError("the Python body ran where _C is built")

    monkeypatch.setattr(capture_op, "gather_rows", python_gather)
    hidden, residual, rows, counts, out = _capture_inputs(torch.float32, True, ARMED["1"])
    capture_op.capture(hidden, residual, rows, counts, 1, out, 1.0)
    assert torch.equal(out[0], hidden[7] + residual[7])
    assert "vllm_hidden_states._C (C++)" in capture_op.write_route(torch.device("cpu"))


def test_without_c_cpu_eager_writes_with_the_python_body_and_the_log_says_why(c):
    hidden, residual, rows, counts, out = _capture_inputs(torch.float32, True, ARMED["1"])
    with python_body():
        capture_op.capture(hidden, residual, rows, counts, 1, out, 1.0)
        route = capture_op.write_route(torch.device("cpu"))
    assert torch.equal(out[0], hidden[7] + residual[7])
    assert "the op's Python body (turned off" in route


def test_cuda_keeps_triton_until_a_gpu_has_timed_c():
    if capture_op._off_cpu_route is not None:
        pytest.skip("the off-CPU route was chosen explicitly in this process")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: the off-CPU route is aten's")
    assert capture_op.off_cpu_route() == "triton"
    assert "kept until" in capture_op.write_route(torch.device("cuda"))


def test_eager_points_nobody_asked_never_call_an_op(monkeypatch):
    """A forward where nobody asked returns after the count read, before any
    op (neither _C nor aten) or argument read."""
    from tests.unit.test_capture_points import Layer, make_points
    from vllm_hidden_states import layers

    # The toy layer has vLLM's fused-residual convention (test_capture_points).
    monkeypatch.setitem(
        layers.LAYER_CLASSES, layers.class_name(Layer), layers.LayerClass("fused", ("toy",))
    )

    model, points = make_points()
    calls = []
    monkeypatch.setattr(capture_points, "capture", lambda *a, **k: calls.append(a))
    with torch.inference_mode():
        model(torch.randn(5, 8))
        assert not calls
        points.arm(np.array([1], dtype=np.int64))
        model(torch.randn(5, 8))
    assert len(calls) == len(points.layers)
