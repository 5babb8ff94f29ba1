# SPDX-License-Identifier: Apache-2.0
"""The steering op as one Triton kernel, for CUDA.

Off CPU the op cannot read the armed count without a host sync, so each
steerable point is one kernel with a program per entry that reads the entry's
slot and returns at once when it is 0: one near-empty launch per point where
nobody steers (inside the CUDA graph). An armed entry reads ``x = (target[r] +
other[r]) * scale`` in float32 and writes the arithmetic of
``steering_op._steer``'s PyTorch path, rounded to the target's dtype once;
rows are distinct among armed entries, so programs never write the same row.
Tested on CPU with Triton's interpreter (``tests/unit/test_steering.py``); not
yet run on a GPU. docs/architecture.md, "The steering op".
"""

import torch
import triton
import triton.language as tl

BLOCK_H = 256


@triton.jit
def _steer_kernel(
    stream,  # (target, other)
    strides,  # (target, other) row strides
    entries,  # (rows, slots)
    tables,  # (adds, dirs, enc, dec, par)
    hidden,
    scale,
    HAS_OTHER: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    target, other = stream
    target_stride, other_stride = strides
    rows, slots = entries
    adds, dirs, enc, dec, par = tables
    j = tl.program_id(0)
    s = tl.load(slots + j)
    if s != 0:
        r = tl.load(rows + j)
        t_row = target + r * target_stride
        o_row = other + r * other_stride
        table = s * hidden
        dot_d = tl.zeros((BLOCK,), dtype=tl.float32)
        dot_e = tl.zeros((BLOCK,), dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            mask = offs < hidden
            x = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_OTHER:
                x += tl.load(o_row + offs, mask=mask, other=0.0).to(tl.float32)
            x = x * scale
            dot_d += x * tl.load(dirs + table + offs, mask=mask, other=0.0)
            if HAS_CLAMP:
                dot_e += x * tl.load(enc + table + offs, mask=mask, other=0.0)
        proj = tl.sum(dot_d, axis=0)
        coef = 0.0
        if HAS_CLAMP:
            pre = tl.sum(dot_e, axis=0) + tl.load(par + s * 3)
            threshold = tl.load(par + s * 3 + 1)
            act = tl.where(pre > threshold, tl.maximum(pre, 0.0), 0.0)
            coef = tl.load(par + s * 3 + 2) - act
        for h0 in range(0, hidden, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            mask = offs < hidden
            delta = tl.load(adds + table + offs, mask=mask, other=0.0)
            delta -= proj * tl.load(dirs + table + offs, mask=mask, other=0.0)
            if HAS_CLAMP:
                delta += coef * tl.load(dec + table + offs, mask=mask, other=0.0)
            t = tl.load(t_row + offs, mask=mask, other=0.0)
            out = t.to(tl.float32) + delta / scale
            tl.store(t_row + offs, out.to(t.dtype), mask=mask)


def steer(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    n: int,
    vectors: list[torch.Tensor],
    scale: float,
) -> None:
    """Launch the kernel over entries ``0 .. n-1`` of ``rows``/``slots``
    (int64 ``[n_max]``, one point's); ``target``/``other`` ``[tokens,
    hidden]`` with unit stride along ``hidden``; ``vectors``: ``[adds,
    dirs]``, float32 ``[slots, hidden]``, plus ``enc, dec`` (same) and
    ``par`` (``[slots, 3]``) with the clamp tables; contiguous."""
    if n == 0:
        return
    adds, dirs = vectors[0], vectors[1]
    enc, dec, par = vectors[2:] if len(vectors) == 5 else (None, None, None)
    hidden = target.shape[-1]
    flat = target.view(-1, hidden)
    clamp = enc is not None and dec is not None and par is not None
    other_flat = flat if other is None else other.view(-1, hidden)
    _steer_kernel[(n,)](
        (flat, other_flat),
        (flat.stride(0), other_flat.stride(0)),
        (rows, slots),
        (adds, dirs, enc if clamp else adds, dec if clamp else adds, par if clamp else adds),
        hidden,
        float(scale),
        HAS_OTHER=other is not None,
        HAS_CLAMP=clamp,
        BLOCK=BLOCK_H,
    )
