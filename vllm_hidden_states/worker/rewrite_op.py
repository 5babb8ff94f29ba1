# SPDX-License-Identifier: Apache-2.0
"""The rewrite ops: ``patch`` and ``sae_splice`` replace the stream at a
steerable point (rather than add to it), inside the forward, by custom ops
that write the tensor carrying the point (the residual, where vLLM keeps the
stream as two tensors: it becomes the replacement minus the other, which
earlier points at the same module still read). Called by the steering hooks
(``steering_op.steer_hook``), after the steering of the same point (other
requests' rows: a rewrite is alone at its point in its request).
docs/architecture.md, "Patching and splicing".
"""

import torch
import torch.nn.functional as F

from vllm_hidden_states.worker.capture_op import (
    count_readable_on_host,
    counts_on_host,
    register_custom_op,
)

PATCH_OP = "hidden_states_patch"
SPLICE_OP = "hidden_states_splice"

# SAE architectures by code (the op's ``arch`` argument).
SAE_ARCH_CODES = {"standard": 0, "jumprelu": 1, "topk": 2}


def _patch(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    table: torch.Tensor,
    scale: float,
    masked: bool = False,
) -> None:
    """For the ``n = counts[index]`` armed entries ``j`` (``r = rows[index,
    j]``, ``s = slots[index, j]``): ``target[r] = table[s] / scale -
    other[r]``, so the point's value ``(target + other) * scale`` is the
    patch row (bit for bit without ``other`` and with ``scale`` 1; within
    float32 rounding of the sum otherwise). ``other`` is left as it is: a
    point before this one at the same module reads it (a fused layer's
    ``attn_out`` is the ``other`` of its ``resid_mid``). ``table`` float32
    ``[rows, width]``, at least the target's width (its first columns are
    read; row 0 unused: an unarmed entry's slot). ``masked`` (attn_z, a
    per-head write): a NaN in the row keeps the target's own value there."""
    if count_readable_on_host(counts.device):
        n = int(counts_on_host(counts)[index])
        if not n:
            return
        r, s = rows[index, :n], slots[index, :n]
        flat = target.view(-1, target.shape[-1])
        values = table[:, : flat.shape[1]].index_select(0, s)
        if scale != 1.0:
            values = values / scale
        if other is not None:
            values = values - other.reshape(-1, other.shape[-1]).index_select(0, r).float()
        if masked:
            values = torch.where(values.isnan(), flat.index_select(0, r).float(), values)
        flat.index_copy_(0, r, values.to(flat.dtype))
        return
    from vllm_hidden_states.worker import rewrite_kernel

    n = min(rows.shape[1], target.reshape(-1, target.shape[-1]).shape[0])
    rewrite_kernel.patch(target, other, rows[index], slots[index], n, table, scale, masked)


def _patch_fake(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    table: torch.Tensor,
    scale: float,
    masked: bool = False,
) -> None:
    return None


def spliced(
    x: torch.Tensor,
    s: torch.Tensor,
    sae: list[torch.Tensor],
    sae_arch: list[int],
    edits: list[torch.Tensor],
) -> torch.Tensor:
    """The splice of rows ``x`` float32 ``[n, d_in]`` with slots ``s`` int64
    ``[n]``: ``decode(edit(f)) + keep * (x - decode(f))``, ``f =
    encode(x)``. ``sae``: ``[W_enc, b_enc, W_dec, b_dec]``, plus
    ``threshold`` for a JumpReLU SAE; ``sae_arch``: ``[architecture code
    (SAE_ARCH_CODES), k, apply_b_dec_to_input]``; ``edits``: per slot,
    ``edit_ids`` int64 ``[slots, E]`` (``d_sae`` where unused: an extra
    column, dropped), ``edit_mode`` float32 (1 sets, 0 scales),
    ``edit_vals`` float32, ``keep`` float32 ``[slots]`` (1: the error term
    added back). Returns float32 ``[n, d_in]``.

    A request edits a feature at most once, so ``edit(f) - f`` is nonzero
    at the edited features only: a top-k SAE's rows decode from their ``k``
    active features and the edits (no dense ``[n, d_sae]`` product), and on
    CPU rows that all keep their error term add the edits' deltas alone."""
    w_enc, b_enc, w_dec, b_dec = sae[:4]
    threshold = sae[4] if len(sae) > 4 else None
    arch, k, b_dec_to_input = sae_arch
    edit_ids, edit_mode, edit_vals, keep = edits
    ids = edit_ids.index_select(0, s)
    mode = edit_mode.index_select(0, s)
    vals = edit_vals.index_select(0, s)
    keep_rows = keep.index_select(0, s)[:, None]
    w = w_dec.float()
    if b_dec_to_input:
        pre = (x - b_dec.float()) @ w_enc.float() + b_enc.float()
    else:
        pre = x @ w_enc.float() + b_enc.float()
    d_sae = w.shape[0]
    valid = ids < d_sae
    at = ids.clamp(max=d_sae - 1)
    if arch == 2:
        top = pre.topk(k, dim=-1)
        active = torch.relu(top.values)  # [n, k]
        hit = top.indices[:, :, None] == ids[:, None, :]  # [n, k, E]
        current = (active[:, :, None] * hit).sum(dim=1)  # [n, E]: 0 where inactive
        new = torch.where(valid, mode * vals + (1 - mode) * vals * current, 0.0)
        deltas = F.embedding_bag(at, w, per_sample_weights=new - current, mode="sum")
        unedited = active * ~hit.any(dim=-1)
        decoded = F.embedding_bag(
            torch.cat([top.indices, at], dim=1),
            w,
            per_sample_weights=torch.cat([unedited, new], dim=1),
            mode="sum",
        )
        return torch.where(keep_rows == 1, x + deltas, decoded + b_dec.float())
    if arch == 1:
        assert threshold is not None
        f = torch.relu(pre) * (pre > threshold.float())
    else:
        f = torch.relu(pre)
    current = torch.where(valid, f.gather(1, at), 0.0)
    new = torch.where(valid, mode * vals + (1 - mode) * vals * current, 0.0)
    deltas = F.embedding_bag(at, w, per_sample_weights=new - current, mode="sum")
    if x.is_cpu and bool(keep_rows.min() == 1):  # a host read on CPU: no device to sync
        return x + deltas
    # decode(edited) + keep * (x - decode(f)) = decode(f) + deltas + keep * (x - decode(f))
    return (1 - keep_rows) * (f @ w + b_dec.float()) + deltas + keep_rows * x


def _splice(
    target: torch.Tensor,
    other: torch.Tensor | None,
    tables: list[torch.Tensor],
    index: int,
    scale: float,
    sae: list[torch.Tensor],
    sae_arch: list[int],
    edits: list[torch.Tensor],
) -> None:
    """The point's value at the armed rows replaced by its splice
    (:func:`spliced`): ``target[r] = out / scale - other[r]``. On CPU
    the count is read on the host (nobody splices: that read is the cost);
    elsewhere every entry is computed and the unarmed ones (slot 0) add a
    zero delta, so no host sync is needed. ``tables``: ``[rows, slots,
    counts]``; ``sae``, ``sae_arch``, ``edits``: as :func:`spliced`."""
    rows, slots, counts = tables
    flat = target.view(-1, target.shape[-1])
    other_flat = None if other is None else other.view(-1, other.shape[-1])
    if count_readable_on_host(counts.device):
        n = int(counts_on_host(counts)[index])
        if not n:
            return
        r, s = rows[index, :n], slots[index, :n]
    else:
        n = min(rows.shape[1], flat.shape[0])
        r, s = rows[index, :n], slots[index, :n]
    x = flat.index_select(0, r).float()
    if other_flat is not None:
        x = x + other_flat.index_select(0, r).float()
    if scale != 1.0:
        x = x * scale
    out = spliced(x, s, sae, sae_arch, edits)
    if scale != 1.0:
        out = out / scale
    if other_flat is not None:
        out = out - other_flat.index_select(0, r).float()  # other stays (see _patch)
    if count_readable_on_host(counts.device):
        flat.index_copy_(0, r, out.to(flat.dtype))
        return
    # Unarmed entries repeat row 0 with slot 0: their deltas are zeros, so
    # accumulating (not copying) keeps an armed row 0 right.
    armed = (s != 0)[:, None]
    delta = torch.where(armed, out - flat.index_select(0, r).float(), 0.0)
    flat.index_add_(0, r, delta.to(flat.dtype))


def _splice_fake(
    target: torch.Tensor,
    other: torch.Tensor | None,
    tables: list[torch.Tensor],
    index: int,
    scale: float,
    sae: list[torch.Tensor],
    sae_arch: list[int],
    edits: list[torch.Tensor],
) -> None:
    return None


def _patch_every_token(
    target: torch.Tensor,
    other: torch.Tensor | None,
    token_slots: torch.Tensor,
    index: int,
    table: torch.Tensor,
    scale: float,
    masked: bool = False,
) -> None:
    """The patch at every token of the forward, its table row
    ``token_slots[index, t]`` (0 where nobody patches: the token keeps its
    value; ``masked``: nor where the row holds NaN). A gather and selects
    only, so inductor fuses it into the forward's own loops (an opaque op
    here would be a Python dispatch per point, and its mutated inputs
    copied, on every forward)."""
    flat = target.view(-1, target.shape[-1])
    s = token_slots[index, : flat.shape[0]]
    values = table[:, : flat.shape[1]].index_select(0, s)
    keep = (s == 0)[:, None] | values.isnan() if masked else (s == 0)[:, None]
    if scale != 1.0:
        values = values / scale
    if other is not None:
        values = values - other.reshape(-1, other.shape[-1]).float()
    flat.copy_(torch.where(keep, flat, values.to(flat.dtype)))


def patch(
    target: torch.Tensor,
    other: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    table: torch.Tensor,
    scale: float,
    token_slots: torch.Tensor | None = None,
    masked: bool = False,
) -> None:
    """One point's patch write, by the route that costs least where the
    forward runs (as :func:`~.steering_op.steer` chooses): on CPU in eager
    mode the op's body (a count read); on CPU under torch.compile the write
    at every token as aten ops in the graph, each token's row read from the
    dense map ``token_slots`` (int64 ``[points, max_tokens]``); off CPU the
    registered op (its Triton kernel, replayed in CUDA graphs). ``masked``:
    the point is attn_z, whose rows keep the target's values where NaN."""
    if count_readable_on_host(counts.device):
        if not torch.compiler.is_compiling():
            _patch(target, other, rows, slots, counts, index, table, scale, masked)
            return
        if token_slots is not None:
            _patch_every_token(target, other, token_slots, index, table, scale, masked)
            return
    torch.ops.vllm.hidden_states_patch(
        target, other, rows, slots, counts, index, table, scale, masked
    )


def splice_rows(
    module: torch.nn.Module,
    target: torch.Tensor,
    other: torch.Tensor | None,
    index: int,
    scale: float,
) -> None:
    """The splice at the SAE's point, reading the SAE and the edit tables
    registered on ``module`` (``steering_tables.Steering._splice_buffers``)."""
    sae = [module._hs_sae_w_enc, module._hs_sae_b_enc, module._hs_sae_w_dec, module._hs_sae_b_dec]
    if hasattr(module, "_hs_sae_threshold"):
        sae.append(module._hs_sae_threshold)
    args = (
        target,
        other,
        [module._hs_rw_rows, module._hs_rw_slots, module._hs_rw_counts],
        index,
        scale,
        sae,
        [int(v) for v in module._hs_sae_arch],
        [module._hs_edit_ids, module._hs_edit_mode, module._hs_edit_vals, module._hs_keep],
    )
    if count_readable_on_host(target.device) and not torch.compiler.is_compiling():
        _splice(*args)
    else:
        torch.ops.vllm.hidden_states_splice(*args)


def register_ops() -> None:
    """Register ``torch.ops.vllm.hidden_states_patch`` and ``_splice`` once
    per process (both mutate ``target``)."""
    register_custom_op(PATCH_OP, _patch, _patch_fake, "target")
    register_custom_op(SPLICE_OP, _splice, _splice_fake, "target")
