# SPDX-License-Identifier: Apache-2.0
"""The patch op as one Triton kernel, for CUDA.

As the steering kernel (``steer_kernel.py``): a program per entry that reads
the entry's slot and returns at once when it is 0 (no host sync, one
near-empty launch per point where nobody patches, inside the CUDA graph). An
armed entry writes its patch row (divided by the point's scale, rounded to
the target's dtype) minus ``other[r]`` into ``target[r]`` (``other`` is
read, not written: see ``rewrite_op._patch``); rows are distinct among armed
entries. At attn_z (``masked``) a NaN in the row keeps the target's value.
Tested on CPU with Triton's interpreter (``tests/unit/test_rewrite_op.py``);
not yet run on a GPU.
"""

import torch
import triton
import triton.language as tl

BLOCK_H = 256


@triton.jit
def _patch_kernel(
    stream,  # (target, other)
    strides,  # (target, other, table) row strides
    entries,  # (rows, slots)
    table,
    hidden,
    scale,
    HAS_OTHER: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    target, other = stream
    target_stride, other_stride, table_stride = strides
    rows, slots = entries
    j = tl.program_id(0)
    s = tl.load(slots + j)
    if s != 0:
        r = tl.load(rows + j)
        t_row = target + r * target_stride
        o_row = other + r * other_stride
        for h0 in range(0, hidden, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            mask = offs < hidden
            value = tl.load(table + s * table_stride + offs, mask=mask, other=0.0) / scale
            if HAS_OTHER:
                value -= tl.load(o_row + offs, mask=mask, other=0.0).to(tl.float32)
            t = tl.load(t_row + offs, mask=mask, other=0.0)
            out = value.to(t.dtype)
            if MASKED:  # NaN in the row: the target keeps its value there
                out = tl.where(value != value, t, out)
            tl.store(t_row + offs, out, mask=mask)


def patch(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    n: int,
    table: torch.Tensor,
    scale: float,
    masked: bool = False,
) -> None:
    """Launch the kernel over entries ``0 .. n-1`` of ``rows``/``slots``
    (int64 ``[n_max]``, one point's); ``target``/``other`` ``[tokens,
    hidden]`` with unit stride along ``hidden``; ``table`` float32 ``[rows,
    width >= hidden]``, contiguous (its first ``hidden`` columns read);
    ``masked``: NaN in a row keeps the target's value (attn_z)."""
    if n == 0:
        return
    hidden = target.shape[-1]
    flat = target.view(-1, hidden)
    other_flat = flat if other is None else other.view(-1, hidden)
    _patch_kernel[(n,)](
        (flat, other_flat),
        (flat.stride(0), other_flat.stride(0), table.stride(0)),
        (rows, slots),
        table,
        hidden,
        float(scale),
        HAS_OTHER=other is not None,
        MASKED=bool(masked),
        BLOCK=BLOCK_H,
    )
