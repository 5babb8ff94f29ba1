# SPDX-License-Identifier: Apache-2.0
"""The capture op's write as one Triton kernel, for CUDA.

Off CPU the op cannot read how many rows are armed without a host sync (and
not at all inside CUDA-graph capture), so its PyTorch route gathers every
entry a forward of ``tokens`` tokens can have: ``min(max_rows, tokens)``
rows, with an index-select, an add for the fused residual and a copy, at every
capture point of every forward, whether or not anyone asked. Here it is one
kernel per capture point: one program per entry, which reads the point's
count on the device and returns at once past it. A forward where nobody asks
pays one near-empty launch per capture point (inside the CUDA graph); one
that asks copies only the armed rows.

Program ``j < count`` (row ``r = rows[j]``) writes ``out[j] = (hidden[r] +
residual[r]) * scale``: the sum in float32 rounded to ``out``'s dtype, then
the scale in float32 rounded again, the roundings of the PyTorch route
(:func:`vllm_hidden_states.worker.capture_points.gather_rows`). Entries past
the count are not written: buffers are read only up to the count.

Tested on CPU with Triton's interpreter (``TRITON_INTERPRET=1``,
``tests/unit/test_capture_points.py``); not yet run on a GPU.
"""

import torch
import triton
import triton.language as tl

BLOCK_H = 256


@triton.jit
def _capture_kernel(
    hidden,
    residual,
    rows,
    counts,
    out,
    index,
    width,
    hidden_stride,
    residual_stride,
    out_stride,
    scale,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
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
            flat,
            other,
            rows,
            counts,
            out,
            index,
            width,
            flat.stride(0),
            other.stride(0),
            out.stride(0),
            float(scale),
            HAS_RESIDUAL=residual is not None,
            HAS_SCALE=scale != 1.0,
            BLOCK=BLOCK_H,
        )
    return True
