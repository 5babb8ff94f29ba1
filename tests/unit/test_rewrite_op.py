# SPDX-License-Identifier: Apache-2.0
"""The rewrite ops (patch, sae_splice) on CPU tensors: the rows they replace,
what they leave alone, the splice's arithmetic against a float64 reference,
and the CUDA patch kernel through Triton's interpreter."""

import numpy as np
import pytest
import torch

from vllm_hidden_states.patch_rows import decode_rows, encode_rows
from vllm_hidden_states.worker.rewrite_op import _patch, _splice, spliced

H, T, POINTS = 8, 6, 2


def armed(entries: list[tuple[int, int]], index: int = 0):
    rows = torch.zeros(POINTS, T, dtype=torch.int64)
    slots = torch.zeros_like(rows)
    counts = torch.zeros(POINTS, dtype=torch.int64)
    for j, (r, s) in enumerate(entries):
        rows[index, j], slots[index, j] = r, s
    counts[index] = len(entries)
    return rows, slots, counts


def test_a_patch_replaces_the_point_at_its_rows_bit_for_bit_on_one_tensor():
    table = torch.randn(4, H)
    rows, slots, counts = armed([(1, 2), (4, 3)])
    target = torch.randn(T, H)
    before = target.clone()
    _patch(target, None, rows, slots, counts, 0, table, 1.0)
    assert torch.equal(target[1], table[2]) and torch.equal(target[4], table[3])
    untouched = [0, 2, 3, 5]
    assert torch.equal(target[untouched], before[untouched])


def test_a_patch_of_a_stream_kept_as_two_tensors_writes_the_residual_and_keeps_the_other():
    """The other tensor (a fused layer's attention output, read by attn_out
    at the same module) is left alone; the sum is the row within rounding."""
    table = torch.randn(4, H)
    rows, slots, counts = armed([(1, 2), (4, 3)])
    target, other = torch.randn(T, H), torch.randn(T, H)
    before_t, before_o = target.clone(), other.clone()
    _patch(target, other, rows, slots, counts, 0, table, 1.0)
    assert torch.equal(other, before_o)
    assert torch.allclose(target[1] + other[1], table[2], rtol=0, atol=1e-6)
    assert torch.allclose(target[4] + other[4], table[3], rtol=0, atol=1e-6)
    untouched = [0, 2, 3, 5]
    assert torch.equal(target[untouched], before_t[untouched])


def test_a_patch_divides_by_the_points_scale():
    table = torch.ones(2, H) * 3.0
    rows, slots, counts = armed([(0, 1)])
    target = torch.zeros(T, H)
    _patch(target, None, rows, slots, counts, 0, table, 0.5)
    assert torch.equal(target[0] * 0.5, table[1])


def test_a_masked_patch_keeps_the_targets_values_where_its_row_is_nan():
    """attn_z's per-head rows: NaN columns (the heads not written) keep the
    target's values bit for bit; the others are the row's."""
    table = torch.randn(3, H)
    table[2, : H // 2] = float("nan")
    rows, slots, counts = armed([(1, 2)])
    target = torch.randn(T, H)
    before = target.clone()
    _patch(target, None, rows, slots, counts, 0, table, 1.0, masked=True)
    assert torch.equal(target[1, : H // 2], before[1, : H // 2])
    assert torch.equal(target[1, H // 2 :], table[2, H // 2 :])
    assert torch.equal(target[[0, 2, 3, 4, 5]], before[[0, 2, 3, 4, 5]])


def test_a_patch_reads_the_first_columns_of_a_wider_table():
    """The table is as wide as the widest patchable point (attn_z may be
    wider than hidden_size): a narrower point reads its own width."""
    table = torch.randn(3, H + 5)
    rows, slots, counts = armed([(4, 1)])
    target = torch.randn(T, H)
    _patch(target, None, rows, slots, counts, 0, table, 1.0)
    assert torch.equal(target[4], table[1, :H])


def test_a_patch_with_nothing_armed_at_its_point_changes_nothing():
    table = torch.randn(3, H)
    rows, slots, counts = armed([(2, 1)], index=1)
    target = torch.randn(T, H)
    before = target.clone()
    _patch(target, None, rows, slots, counts, 0, table, 1.0)
    assert torch.equal(target, before)


def sae(d_sae: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "W_enc": torch.randn(H, d_sae, generator=g) / H**0.5,
        "b_enc": torch.randn(d_sae, generator=g) * 0.1,
        "W_dec": torch.randn(d_sae, H, generator=g) / d_sae**0.5,
        "b_dec": torch.randn(H, generator=g) * 0.1,
        "threshold": torch.rand(d_sae, generator=g) * 0.1,
    }


def reference_splice(x, w, arch, k, edits, keep_error):
    x = x.double()
    w = {key: v.double() for key, v in w.items()}
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    if arch == "topk":
        top = pre.topk(k, dim=-1)
        f = torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
    elif arch == "jumprelu":
        f = torch.relu(pre) * (pre > w["threshold"])
    else:
        f = torch.relu(pre)
    g = f.clone()
    for feature, how, value in edits:
        g[:, feature] = value if how == "set" else f[:, feature] * value
    out = g @ w["W_dec"] + w["b_dec"]
    if keep_error:
        out = out + x - (f @ w["W_dec"] + w["b_dec"])
    return out


def edit_tables(d_sae, edits, keep_error, slots=3, slot=1):
    ids = torch.full((slots, 16), d_sae, dtype=torch.int64)
    mode = torch.zeros(slots, 16)
    vals = torch.ones(slots, 16)
    keep = torch.ones(slots)
    for j, (feature, how, value) in enumerate(edits):
        ids[slot, j], mode[slot, j], vals[slot, j] = feature, 1.0 if how == "set" else 0.0, value
    keep[slot] = 1.0 if keep_error else 0.0
    return ids, mode, vals, keep


@pytest.mark.parametrize("arch, code, k", [("standard", 0, 0), ("jumprelu", 1, 0), ("topk", 2, 3)])
@pytest.mark.parametrize("keep_error", [False, True])
def test_a_splice_is_decode_of_the_edited_encoding_plus_the_error_term_if_kept(
    arch, code, k, keep_error
):
    w = sae()
    x = torch.randn(5, H)
    edits = [(1, "set", 2.5), (4, "scale", 3.0)]
    ids, mode, vals, keep = edit_tables(12, edits, keep_error)
    s = torch.ones(5, dtype=torch.int64)
    tables = [w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], w["threshold"]]
    got = spliced(x, s, tables, [code, k, True], [ids, mode, vals, keep])
    expected = reference_splice(x, w, arch, k, edits, keep_error)
    assert (got.double() - expected).abs().max() / expected.abs().max() < 1e-5


@pytest.mark.parametrize("arch, code, k", [("standard", 0, 0), ("jumprelu", 1, 0), ("topk", 2, 3)])
def test_rows_keeping_and_dropping_the_error_term_splice_each_as_their_own_request(arch, code, k):
    w = sae()
    x = torch.randn(6, H)
    edits = [(1, "set", 2.5), (4, "scale", 3.0)]
    ids, mode, vals, keep = edit_tables(12, edits, True, slot=1)
    ids2, mode2, vals2, _ = edit_tables(12, edits, False, slot=2)
    ids[2], mode[2], vals[2], keep[2] = ids2[2], mode2[2], vals2[2], 0.0
    s = torch.tensor([1, 2, 1, 2, 2, 1])
    tables = [w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], w["threshold"]]
    got = spliced(x, s, tables, [code, k, True], [ids, mode, vals, keep]).double()
    for slot, keep_error in ((1, True), (2, False)):
        rows = s == slot
        expected = reference_splice(x[rows], w, arch, k, edits, keep_error)
        assert (got[rows] - expected).abs().max() / expected.abs().max() < 1e-5, slot


def test_a_splice_without_edits_keeping_the_error_gives_back_the_stream():
    w = sae()
    x = torch.randn(4, H)
    ids, mode, vals, keep = edit_tables(12, [], True)
    s = torch.ones(4, dtype=torch.int64)
    tables = [w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"]]
    got = spliced(x, s, tables, [0, 0, True], [ids, mode, vals, keep])
    assert torch.allclose(got, x, atol=1e-5)


def test_the_splice_op_rewrites_only_its_armed_rows():
    w = sae()
    ids, mode, vals, keep = edit_tables(12, [(2, "set", 1.0)], False)
    rows, slots, counts = armed([(3, 1)])
    target, other = torch.randn(T, H), torch.randn(T, H)
    x = (target[3] + other[3]).clone()
    before_t, before_o = target.clone(), other.clone()
    tables = [w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"]]
    _splice(
        target, other, [rows, slots, counts], 0, 1.0, tables, [0, 0, True], [ids, mode, vals, keep]
    )
    expected = reference_splice(x[None], w, "standard", 0, [(2, "set", 1.0)], False)[0]
    assert torch.equal(other, before_o)
    assert ((target[3] + other[3]).double() - expected).abs().max() < 1e-5
    untouched = [0, 1, 2, 4, 5]
    assert torch.equal(target[untouched], before_t[untouched])
    assert torch.equal(other[untouched], before_o[untouched])


# -- rows: the typed-array form ------------------------------------------------


def test_typed_rows_round_trip_float32_bit_for_bit():
    rows = np.random.default_rng(0).standard_normal((3, H)).astype(np.float32)
    assert np.array_equal(decode_rows(encode_rows(rows), H), rows)


def test_float16_rows_widen_to_float32():
    rows = np.random.default_rng(1).standard_normal((2, H)).astype(np.float16)
    assert np.array_equal(decode_rows(encode_rows(rows, "float16"), H), rows.astype(np.float32))


def test_attn_z_rows_come_as_captured_or_flat_and_go_on_the_wire_flat():
    """attn_z (``heads`` given): ``[n, heads, head_dim]``, as captured, and
    the flat ``[n, heads * head_dim]`` decode to the same flat rows."""
    heads = 4
    rows = np.random.default_rng(2).standard_normal((3, heads, H // heads)).astype(np.float32)
    flat = rows.reshape(3, H)
    assert np.array_equal(decode_rows(rows, H, "heads * head_dim", heads), flat)
    assert np.array_equal(decode_rows(encode_rows(rows), H, "heads * head_dim", heads), flat)
    assert np.array_equal(decode_rows(flat, H, "heads * head_dim", heads), flat)
    with pytest.raises(ValueError, match=rf"\[n, {H}\] or \[n, 4, {H // 4}\] \(as captured\)"):
        decode_rows(rows[:, :2], H, "heads * head_dim", heads)
    with pytest.raises(ValueError, match=rf"must be \[n, {H}\] \(n >= 1"):
        decode_rows(rows, H)  # a point without heads takes no 3-D rows


@pytest.mark.parametrize(
    "value, message",
    [
        ({"dtype": "float64", "shape": [1, H], "data": ""}, "dtype must be one of"),
        ({"dtype": "float32", "shape": [1, H], "data": "!!"}, "not valid base64"),
        ({"dtype": "float32", "shape": [2, H], "data": encode_rows(np.ones((1, H)))["data"]},
         "needs 64"),
        ([[1.0] * (H - 1)], f"must be \\[n, {H}\\]"),
        ([[float("nan")] * H], "must be finite"),
        ("rows", "must be"),
    ],
)  # fmt: skip
def test_bad_rows_name_what_is_wrong_and_what_is_allowed(value, message):
    with pytest.raises(ValueError, match=message):
        decode_rows(value, H)


# -- the CUDA kernel, through Triton's interpreter ------------------------------

_PATCH_KERNEL_CHECK = r"""
import torch
from vllm_hidden_states.worker import rewrite_kernel
from vllm_hidden_states.worker.rewrite_op import _patch


def check(dtype_name, other_kind, scale_text, columns="full"):
    torch.manual_seed(0)
    H, T = 300, 7  # H not a multiple of the kernel's block
    dtype = getattr(torch, dtype_name)
    # "heads": attn_z's per-head rows, NaN where the target keeps its value,
    # in a table wider than the target (the widest point's width).
    masked = columns == "heads"
    table = torch.randn(4, H + 40) if masked else torch.randn(4, H)
    if masked:
        table[:, 100:250] = float("nan")
    target = torch.randn(T, H).to(dtype)
    other = torch.randn(T, H).to(dtype) if other_kind == "other" else None
    scale = float(scale_text)
    rows = torch.tensor([[2, 0, 5, 0, 0, 0, 0]])
    slots = torch.tensor([[1, 3, 2, 0, 0, 0, 0]])
    counts = torch.tensor([3])
    expected_t = target.clone()
    expected_o = None if other is None else other.clone()
    _patch(expected_t, expected_o, rows, slots, counts, 0, table, scale, masked)
    if masked:
        assert torch.equal(expected_t[2, 100:250], target[2, 100:250]), "torch path: NaN written"
    got_t = target.clone()
    got_o = None if other is None else other.clone()
    rewrite_kernel.patch(got_t, got_o, rows[0], slots[0], T, table, scale, masked)
    # float32 bit for bit; bfloat16 within its rounding (the interpreter's
    # conversion may truncate where torch rounds to nearest).
    tol = 0.0 if dtype == torch.float32 else 1e-2
    err = (got_t.float() - expected_t.float()).abs().max().item()
    assert err <= tol * expected_t.float().abs().max().item(), f"target differs by {err}"
    if other is not None:
        assert torch.equal(got_o, expected_o), "kernel vs torch path: other differs"
    return "equal"
"""

PATCH_KERNEL_CASES = [
    ("float32", "none", "1.0"),
    ("float32", "other", "0.5"),
    ("bfloat16", "other", "1.0"),
    ("float32", "none", "1.0", "heads"),
    ("bfloat16", "none", "1.0", "heads"),
]


@pytest.fixture(scope="module")
def patch_kernel_results(triton_interpreted) -> dict[tuple[str, ...], str]:
    return triton_interpreted(_PATCH_KERNEL_CHECK, PATCH_KERNEL_CASES)


@pytest.mark.parametrize("args", PATCH_KERNEL_CASES, ids=lambda a: "-".join(a))
def test_the_cuda_patch_kernel_writes_what_the_torch_path_does(args, patch_kernel_results):
    """The Triton kernel (CUDA's path, entries past the count left with slot
    0, row 0) against the op's PyTorch path, bit for bit."""
    result = patch_kernel_results.get(args, "not run")
    assert result.startswith("ok"), result[-2000:]


def test_compiled_on_cpu_a_patch_is_aten_ops_in_the_graph_and_writes_as_eager():
    """Under torch.compile on CPU the patch is selects over every token, each
    token's row read from the dense map (no opaque op: a Python dispatch per
    point, its mutated inputs copied, on every forward), and it writes what
    the op's body writes."""
    from vllm_hidden_states.worker.rewrite_op import patch, register_ops

    register_ops()
    table = torch.randn(4, H)
    entries = [(1, 2), (4, 3)]
    rows, slots, counts = armed(entries)
    token_slots = torch.zeros(POINTS, T, dtype=torch.int64)
    for r, s in entries:
        token_slots[0, r] = s
    graphs = []

    def keep_graph(gm: torch.fx.GraphModule, example_inputs: list):
        graphs.append(gm)
        return gm.forward

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x * 2.0, y * 1.0  # patch intermediates, as in a model
        patch(x, y, rows, slots, counts, 0, table, 1.0, token_slots=token_slots)
        return x + y

    x, y = torch.randn(T, H), torch.randn(T, H)
    compiled = torch.compile(forward, backend=keep_graph, fullgraph=True)(x, y)
    ex, ey = x * 2.0, y * 1.0
    _patch(ex, ey, rows, slots, counts, 0, table, 1.0)
    assert torch.equal(compiled, ex + ey)
    ops = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert not any("hidden_states_patch" in op for op in ops), ops


def test_compiled_on_cpu_a_masked_patch_writes_as_eager():
    """attn_z's per-head write under torch.compile on CPU (NaN columns of
    the row keep the token's values) equals the op's body."""
    from vllm_hidden_states.worker.rewrite_op import patch, register_ops

    register_ops()
    table = torch.randn(4, H + 3)
    table[2:, 2:6] = float("nan")
    entries = [(1, 2), (4, 3), (5, 1)]
    rows, slots, counts = armed(entries)
    token_slots = torch.zeros(POINTS, T, dtype=torch.int64)
    for r, s in entries:
        token_slots[0, r] = s

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = x * 2.0
        patch(x, None, rows, slots, counts, 0, table, 1.0, token_slots=token_slots, masked=True)
        return x + 1.0

    x = torch.randn(T, H)
    compiled = torch.compile(forward, backend="eager", fullgraph=True)(x)
    ex = x * 2.0
    _patch(ex, None, rows, slots, counts, 0, table, 1.0, masked=True)
    assert torch.equal(compiled, ex + 1.0)
    assert not compiled.isnan().any()
