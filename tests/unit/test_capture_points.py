# SPDX-License-Identifier: Apache-2.0
"""Capture points on a small torch stack, by each of the write's routes.

* "host count": CPU in eager mode, where the write reads the armed row count.
* "sync-free": the opaque op as it runs on CUDA, gathering every entry of the
  persistent row index without a sync, run here on CPU
  (``count_readable_on_host`` answering False), where an out-of-range index
  raises instead of asserting on the device.
* "compiled": CPU under torch.compile, where the same sync-free gather is
  aten ops traced into the graph.
"""

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from vllm_hidden_states import layers
from vllm_hidden_states.worker import capture_op, capture_points
from vllm_hidden_states.worker.capture_points import CapturePoints

HIDDEN = 8
NUM_LAYERS = 3


class Layer(nn.Module):
    """A decoder layer with vLLM's fused-residual signature."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden_states, residual):
        stream = hidden_states if residual is None else hidden_states + residual
        return self.proj(stream), stream


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(NUM_LAYERS))

    def forward(self, hidden):
        """``hidden`` [tokens, HIDDEN]; returns the stream entering each layer."""
        positions = torch.arange(hidden.shape[0])
        residual = None
        entering = []
        for layer in self.layers:
            entering.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual)
        return entering


@pytest.fixture(autouse=True)
def _layer_is_fused(monkeypatch):
    """The toy layer has vLLM's fused-residual convention: known as such,
    as vLLM's own layer classes are (an unknown class gets no reader)."""
    monkeypatch.setitem(
        layers.LAYER_CLASSES, layers.class_name(Layer), layers.LayerClass("fused", ("toy",))
    )


def pretend_off_cpu(monkeypatch) -> None:
    """The op's and the points' view of the device: counts not readable on
    the host, as on a GPU."""
    for module in (capture_op, capture_points):
        monkeypatch.setattr(module, "count_readable_on_host", lambda device: False)


@pytest.fixture(params=["host count", "sync-free", "compiled"])
def mode(request, monkeypatch):
    if request.param == "sync-free":
        pretend_off_cpu(monkeypatch)
    return request.param


def run(model: nn.Module, hidden: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """``model(hidden)``, compiled (whole graph, dynamic token count) in the
    "compiled" mode."""
    if mode == "compiled":
        return torch.compile(model, fullgraph=True, dynamic=True)(hidden)
    return model(hidden)


def make_points(
    max_rows: int = 16, ids: tuple[int, ...] = (0, 2), layout: str | None = None
) -> tuple[Stack, CapturePoints]:
    """A seeded stack with capture points at capture ids ``ids``."""
    torch.manual_seed(0)
    model = Stack()
    points = CapturePoints(
        model,
        list(ids),
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        max_rows=max_rows,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layout=layout,
    )
    return model, points


@torch.inference_mode()
def test_armed_rows_are_the_stream_entering_each_captured_layer(mode):
    model, points = make_points()
    rows = np.array([7, 0, 3, 9], dtype=np.int64)
    points.arm(rows)
    entering = run(model, torch.randn(10, HIDDEN), mode)
    for k in points.layers:
        torch.testing.assert_close(points.read(k), entering[k][torch.from_numpy(rows)])


@torch.inference_mode()
def test_forward_nobody_armed_never_reads_rows_armed_for_a_larger_batch(mode):
    """Defect seen on an H100: disarm left the index of a 10-token capture in
    place, and the next 4-token forward gathered rows 4..9 (index out of
    bounds, a device-side assert that killed the engine)."""
    model, points = make_points()
    points.arm(np.arange(10, dtype=np.int64))
    run(model, torch.randn(10, HIDDEN), mode)
    points.disarm()
    points.rest()  # as the worker does before a forward that arms nothing
    run(model, torch.randn(4, HIDDEN), mode)  # IndexError if a stale index is gathered
    assert points.count == 0
    assert not points.counts.any()
    assert not points.rows.any()  # for the writes that gather without a count


@torch.inference_mode()
def test_smaller_capture_after_larger_one_reads_only_its_own_rows(mode):
    model, points = make_points()
    points.arm(np.arange(10, dtype=np.int64))
    run(model, torch.randn(10, HIDDEN), mode)
    points.disarm()
    points.arm(np.array([1, 2], dtype=np.int64))
    entering = run(model, torch.randn(3, HIDDEN), mode)
    assert points.read(2).shape == (2, HIDDEN)
    torch.testing.assert_close(points.read(2), entering[2][1:3])


def test_arming_more_rows_than_the_buffers_hold_is_refused():
    _, points = make_points(max_rows=4)
    with pytest.raises(ValueError, match="5 rows asked in one step; the buffers hold 4"):
        points.arm(np.arange(5, dtype=np.int64))


@torch.inference_mode()
def test_sync_free_forward_gathers_at_most_one_row_per_token(monkeypatch):
    """Off CPU the op cannot read the count; it gathers min(max_rows, tokens)
    entries of the index, so a small decode step copies a few rows, not the
    whole buffer."""
    pretend_off_cpu(monkeypatch)
    model, points = make_points(max_rows=16)
    for buffer in points.buffers.values():
        buffer.fill_(float("nan"))
    model(torch.randn(3, HIDDEN))
    for buffer in points.buffers.values():
        assert not buffer[:3].isnan().any()
        assert buffer[3:].isnan().all()


def test_row_ranges_of_several_requests_concatenate_in_order():
    from vllm_hidden_states.worker.step_batch import ranges

    assert ranges([5], [3]).tolist() == [5, 6, 7]
    assert ranges([10, 0, 7], [2, 3, 1]).tolist() == [10, 11, 0, 1, 2, 7]


def test_row_ranges_of_a_decode_step_are_its_starts():
    from vllm_hidden_states.worker.step_batch import ranges

    assert ranges([4, 9, 2], [1, 1, 1]).tolist() == [4, 9, 2]


@torch.inference_mode()
def test_only_the_layers_asked_are_written(mode):
    model, points = make_points()
    for buffer in points.buffers.values():
        buffer.fill_(float("nan"))
    points.arm(np.array([1, 2], dtype=np.int64), layers=[2])
    entering = run(model, torch.randn(4, HIDDEN), mode)
    torch.testing.assert_close(points.read(2), entering[2][1:3])
    if mode == "host count":  # the other routes gather at every point (no count read)
        assert points.buffers[0].isnan().all()


@torch.inference_mode()
def test_post_hook_points_of_a_fused_layer_read_its_output(mode):
    """mlp_out / resid_mid are a fused-residual layer's own output items and
    the last layer's resid_post their sum, in both op modes."""
    from vllm_hidden_states.points import point_id

    ids = {
        "mlp_out.1": point_id("mlp_out", 1, NUM_LAYERS),
        "resid_mid.1": point_id("resid_mid", 1, NUM_LAYERS),
        "resid_post.2": point_id("resid_post", 2, NUM_LAYERS),
    }
    model, points = make_points(ids=tuple(ids.values()), layout="fused")
    outputs = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: outputs.append(o)) for layer in model.layers
    ]
    rows = np.array([4, 1], dtype=np.int64)
    points.arm(rows)
    run(model, torch.randn(6, HIDDEN), mode)
    for hook in hooks:
        hook.remove()
    index = torch.from_numpy(rows)
    torch.testing.assert_close(points.read(ids["mlp_out.1"]), outputs[1][0][index])
    torch.testing.assert_close(points.read(ids["resid_mid.1"]), outputs[1][1][index])
    last = outputs[2][0] + outputs[2][1]
    torch.testing.assert_close(points.read(ids["resid_post.2"]), last[index])


@torch.inference_mode()
def test_compiled_on_cpu_a_capture_point_is_aten_ops_in_the_graph_not_the_opaque_op():
    """On CPU no CUDA graph replays the step, so an opaque-op call would be a
    Python dispatch per point on every forward, asked or not; the compiled
    graph holds the gather as aten ops instead."""
    model, points = make_points()
    graphs = []

    def keep_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    points.arm(np.array([2, 0], dtype=np.int64))
    entering = torch.compile(model, backend=keep_graph, fullgraph=True, dynamic=True)(
        torch.randn(5, HIDDEN)
    )
    targets = [node.target for gm in graphs for node in gm.graph.nodes]
    assert torch.ops.vllm.hidden_states_capture not in targets
    assert torch.ops.vllm.hidden_states_capture.default not in targets
    assert any("index_select" in str(t) for t in targets)
    for k in points.layers:
        torch.testing.assert_close(points.read(k), entering[k][torch.tensor([2, 0])])


@torch.inference_mode()
def test_compiled_on_cpu_a_forward_nobody_asked_copies_the_floor_not_a_row_per_token():
    """Under torch.compile on CPU the gathers read the armed index, whose
    length is a dynamic size of the graph: a 12-token forward where nobody
    asked (the worker rests the index before it) writes ARMED_FLOOR scratch
    rows per point, not 12."""
    model, points = make_points()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    points.arm(np.array([3, 1, 4], dtype=np.int64))
    compiled(torch.randn(6, HIDDEN))  # compiled while rows are armed
    points.disarm()
    points.rest()
    for buffer in points.buffers.values():
        buffer.fill_(float("nan"))
    compiled(torch.randn(12, HIDDEN))
    for buffer in points.buffers.values():
        assert not buffer[: capture_points.ARMED_FLOOR].isnan().any()
        assert buffer[capture_points.ARMED_FLOOR :].isnan().all()


def test_on_cpu_disarm_zeroes_the_armed_index_and_keeps_its_length_until_rest():
    """A decode step arming as many rows as the step before resizes nothing
    (disarm zeroes the entries, a write past the count gathers row 0);
    rest() puts the index back to its floor."""
    model, points = make_points()
    points.arm(np.array([3, 1, 4], dtype=np.int64))
    points.disarm()
    assert points.armed is not None
    assert points.armed.tolist() == [0, 0, 0] and points.count == 0
    points.rest()
    assert points.armed.tolist() == [0] * capture_points.ARMED_FLOOR


@torch.inference_mode()
def test_compiled_on_cpu_one_graph_captures_every_armed_count():
    """The armed length changes per step without a recompile (vLLM drops
    Dynamo's guards, so a graph specialized to one count would be wrong at
    the next), each step reading its own rows."""
    model, points = make_points()
    compiles = []

    def count_compiles(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiles.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=count_compiles, fullgraph=True, dynamic=True)
    for rows in ([2, 0], [9, 8, 7, 6, 5], [4], list(range(10))):
        points.arm(np.array(rows, dtype=np.int64))
        entering = compiled(torch.randn(10, HIDDEN))
        for k in points.layers:
            torch.testing.assert_close(points.read(k), entering[k][torch.tensor(rows)])
        points.disarm()
    assert len(compiles) == 1


def test_a_point_the_layer_does_not_have_is_a_lookup_error_naming_the_module():
    from vllm_hidden_states.points import point_id

    with pytest.raises(LookupError, match="post_attention_layernorm"):
        make_points(ids=(point_id("attn_out", 0, NUM_LAYERS),), layout="fused")


# --------------------------------------------------------------------------
# the CUDA route's Triton kernel, run by Triton's interpreter on CPU tensors

_KERNEL_CHECK = r"""
import torch
from vllm_hidden_states.worker import capture_kernel
from vllm_hidden_states.worker.capture_op import _gather_every_entry


def check(mode):
    torch.manual_seed(0)
    T, W, MAX_ROWS = 9, 300, 6  # W not a multiple of the kernel's block; fewer rows than tokens
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for with_residual in (False, True):
            for scale in (1.0, 0.37):
                qkv = torch.randn(T, 3 * W).to(dtype)
                # a query sliced out of a fused projection: rows strided by 3 W
                hidden = qkv[:, :W] if mode == "strided" else torch.randn(T, W).to(dtype)
                residual = torch.randn(T, W).to(dtype) if with_residual else None
                counts = torch.tensor([0, 0, 0])
                rows = torch.zeros(MAX_ROWS, dtype=torch.int64)
                armed = {"none": [], "one": [7], "max": [8, 0, 3, 3, 5, 1]}.get(mode, [4, 2])
                rows[: len(armed)] = torch.tensor(armed, dtype=torch.int64)
                counts[1] = len(armed)
                out = torch.full((MAX_ROWS, W), 7.0, dtype=dtype)
                expected = out.clone()
                _gather_every_entry(hidden, residual, rows, expected, scale)
                assert capture_kernel.gather(hidden, residual, rows, counts, 1, out, scale)
                n = len(armed)
                if dtype == torch.bfloat16 and (with_residual or scale != 1.0):
                    # Rounded from float32 in the kernel: on a GPU to nearest even,
                    # as PyTorch rounds; Triton's interpreter truncates instead.
                    # The same arithmetic with truncation, then.
                    def truncated(x):
                        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)

                    value = hidden[rows[:n]].float()
                    if residual is not None:
                        value = truncated(value + residual[rows[:n]].float()).float()
                    expected[:n] = truncated(value * scale) if scale != 1.0 else value.to(dtype)
                differ = (dtype, with_residual, scale, "rows differ")
                assert torch.equal(out[:n], expected[:n]), differ
                assert torch.equal(out[n:], torch.full_like(out[n:], 7.0)), "wrote past the count"
"""

KERNEL_MODES = ["none", "one", "max", "strided"]


@pytest.fixture(scope="module")
def kernel_results(triton_interpreted) -> dict[tuple[str, ...], str]:
    return triton_interpreted(_KERNEL_CHECK, [(mode,) for mode in KERNEL_MODES])


@pytest.mark.parametrize("armed", KERNEL_MODES)
def test_the_cuda_kernel_writes_the_armed_rows_bit_for_bit_as_the_torch_route(
    armed, kernel_results
):
    """The Triton kernel (the op's CUDA route) on CPU tensors through Triton's
    interpreter, against the aten gather, for float32, bfloat16 and float16,
    with and without the fused residual and a scale: the armed rows equal bit
    for bit (the same roundings; for bfloat16 from float32, the interpreter's
    truncation where a GPU rounds as PyTorch does), and nothing past the count
    is written, so a forward nobody asked for writes nothing at all."""
    result = kernel_results.get((armed,), "not run")
    assert result.startswith("ok"), result[-2000:]


def test_a_tensor_strided_along_its_width_is_left_to_the_torch_route():
    from vllm_hidden_states.worker import capture_kernel

    hidden = torch.randn(HIDDEN, 4).t()  # [4, HIDDEN], stride 1 along tokens
    out = torch.zeros(2, HIDDEN)
    rows, counts = torch.zeros(2, dtype=torch.int64), torch.tensor([1])
    assert not capture_kernel.gather(hidden, None, rows, counts, 0, out, 1.0)
    assert torch.equal(out, torch.zeros(2, HIDDEN))


class Attention(nn.Module):
    """vLLM's attention module as the q / k / v taps see it: its query, key
    and value arguments flat, its head counts and size as attributes."""

    num_heads, num_kv_heads, head_size = 4, 2, 6

    def forward(self, query, key, value):
        return query


class AttentionLayer(nn.Module):
    """A fused-residual layer whose ``self_attn.attn`` takes q, k, v: the
    projections of its input by ``weights`` (kind -> [width, HIDDEN])."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights = weights
        self.self_attn = nn.Module()
        self.self_attn.attn = Attention()

    def forward(self, positions, hidden_states, residual):
        q, k, v = (hidden_states @ self.weights[kind].T for kind in ("q", "k", "v"))
        self.self_attn.attn(q, k, v)
        return hidden_states, residual


class AttentionStack(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AttentionLayer(weights) for _ in range(NUM_LAYERS))

    def forward(self, hidden):
        residual = None
        for layer in self.layers:
            hidden, residual = layer(None, hidden, residual)


def vllm_llama4_weight(weight: torch.Tensor, kind: str, heads: int) -> torch.Tensor:
    """HF's ``{kind}_proj`` weight of Llama 4 as vLLM's loader loads it (its
    own ``permute_qk_weight_for_rotary``: q and k permuted, v as it is)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.llama4 import Llama4ForCausalLM

    loader = SimpleNamespace(
        config=SimpleNamespace(num_attention_heads=heads, num_key_value_heads=heads)
    )
    name = f"model.layers.0.self_attn.{kind}_proj.weight"
    return Llama4ForCausalLM.permute_qk_weight_for_rotary(loader, name, weight.clone())[1]


@pytest.mark.parametrize("halves", [True, False], ids=["qk_halves", "hf_order"])
@torch.inference_mode()
def test_llama4_queries_and_keys_are_read_back_in_hf_order(monkeypatch, halves):
    """vLLM's Llama 4 loader permutes each q_proj / k_proj head's rows (HF's
    even dimensions first, then its odd ones, for neox-style rotary); at a
    layer class with ``qk_halves`` the captured q and k rows leave the
    worker (``CapturePoints.hf_order``) as HF's weights give them, and v
    as it came; a class without it is read as it came."""
    from vllm_hidden_states.points import point_id

    monkeypatch.setitem(
        layers.LAYER_CLASSES,
        layers.class_name(AttentionLayer),
        layers.LayerClass("fused", ("toy",), qk_halves=halves),
    )
    a = Attention
    heads = {"q": a.num_heads, "k": a.num_kv_heads, "v": a.num_kv_heads}
    torch.manual_seed(0)
    hf = {kind: torch.randn(n * a.head_size, HIDDEN) for kind, n in heads.items()}
    loaded = {kind: vllm_llama4_weight(w, kind, heads[kind]) for kind, w in hf.items()}
    assert not torch.equal(loaded["q"], hf["q"]) and not torch.equal(loaded["k"], hf["k"])
    assert torch.equal(loaded["v"], hf["v"])
    model = AttentionStack(loaded if halves else hf)
    ids = {kind: point_id(kind, 1, NUM_LAYERS) for kind in heads}
    points = CapturePoints(
        model,
        list(ids.values()),
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        max_rows=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    x = torch.randn(5, HIDDEN)
    rows = np.array([3, 0, 4], dtype=np.int64)
    points.arm(rows)
    model(x)
    for kind, k in ids.items():
        read = points.hf_order(k, points.read_neurons(k)[1:])
        torch.testing.assert_close(read, (x @ hf[kind].T)[rows[1:]], msg=kind)
