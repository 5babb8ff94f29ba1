# SPDX-License-Identifier: Apache-2.0
"""The capture op's write as one Triton kernel, for CUDA.

Off CPU the op cannot read the armed count without a host sync, so here each
capture point is one kernel of ``min(max_rows, tokens)`` programs that read the
count on the device and return at once past it: one near-empty launch per
point where nobody asked (inside the CUDA graph). Program ``j < count`` writes
``out[j] = (hidden[r] + residual[r]) * scale`` (``r = rows[j]``) with the
roundings of the PyTorch route (``capture_op.gather_rows``). Tested on CPU with
Triton's interpreter (``tests/unit/test_capture_points.py``); tests/gpu runs
it on CUDA. docs/architecture.md, "The capture op".
"""

import torch
import triton
import triton.language as tl

BLOCK_H = 256


@triton.jit
def _capture_kernel(
    src,  # (hidden, residual)
    strides,  # (hidden, residual, out) row strides
    armed,  # (rows, counts)
    out,
    index,
    width,
    scale,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    hidden, residual = src
    hidden_stride, residual_stride, out_stride = strides
    rows, counts = armed
    j = tl.program_id(0)
    n = tl.load(counts + index)
    if j < n:
        r = tl.load(rows + j)
        h_row = hidden + r * hidden_stride
        s_row = residual + r * residual_stride
        o_row = out + j * out_stride
        for h0 in range(0, width, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            mask = offs < width
            x = tl.load(h_row + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                x = x.to(tl.float32) + tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
            x = x.to(out.dtype.element_ty)
            if HAS_SCALE:
                x = (x.to(tl.float32) * scale).to(out.dtype.element_ty)
            tl.store(o_row + offs, x, mask=mask)


def gather(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
    scale: float,
) -> bool:
    """``out[:n] = ((hidden + residual) * scale)[rows[:n]]`` with ``n =
    counts[index]`` read by the kernel: ``hidden``/``residual`` ``[..., width]``
    (viewed as ``[tokens, width]``), ``rows`` int64 ``[max_rows]``, ``counts``
    int64 ``[points]``, ``out`` ``[max_rows, width]`` in the model dtype.
    Launches ``min(max_rows, tokens)`` programs: static per CUDA graph, as
    the token count is. Returns False, having launched nothing, when a tensor
    is not unit-stride along ``width`` (the caller's PyTorch route writes it)."""
    width = out.shape[-1]
    flat = hidden.reshape(-1, width)
    other = flat if residual is None else residual.reshape(-1, width)
    if flat.stride(-1) != 1 or other.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    grid = min(rows.shape[0], flat.shape[0])
    if grid:
        _capture_kernel[(grid,)](
            (flat, other),
            (flat.stride(0), other.stride(0), out.stride(0)),
            (rows, counts),
            out,
            index,
            width,
            float(scale),
            HAS_RESIDUAL=residual is not None,
            HAS_SCALE=scale != 1.0,
            BLOCK=BLOCK_H,
        )
    return True
