# SPDX-License-Identifier: Apache-2.0
"""Attention patterns from captured queries and keys.

vLLM's paged attention never materializes the weights, so a pattern point
(``attn_pattern.i``) captures the ``query`` and ``key`` arguments of layer
``i``'s ``Attention`` module (after rotary embedding and q/k norms) like any
point. An extract recomputes every position; :class:`PatternHistory` keeps
queries and keys on the device across chunks, and :func:`attention_pattern`
turns them into the weights as HF's eager attention does (grouped heads,
soft-capping, causal and sliding-window masks, attention sinks). Only the query rows asked
leave the device: ``[heads, queries, keys]`` float32.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from vllm_hidden_states.wire import CaptureStep
    from vllm_hidden_states.worker.capture_points import CapturePoints
    from vllm_hidden_states.worker.host_rows import HostCopies


@dataclass
class PatternHistory:
    """One request's queries and keys at its pattern points, on the device.

    Attributes:
        num_tokens: positions of the sequence (rows of each tensor).
        queries, keys: capture id -> ``[num_tokens, heads x head_size]`` /
            ``[num_tokens, kv_heads x head_size]`` in the model dtype.
    """

    num_tokens: int
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)

    def write(self, capture_id: int, first: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rows of positions ``first .. first + len(q) - 1`` (device to device)."""
        if capture_id not in self.queries:
            self.queries[capture_id] = q.new_empty((self.num_tokens, q.shape[-1]))
            self.keys[capture_id] = k.new_empty((self.num_tokens, k.shape[-1]))
        self.queries[capture_id][first : first + q.shape[0]].copy_(q)
        self.keys[capture_id][first : first + k.shape[0]].copy_(k)

    def weights(
        self, ids: Sequence[int], modules: dict[int, nn.Module], lo: int, hi: int
    ) -> torch.Tensor:
        """The patterns of query positions ``lo .. hi - 1`` at each of
        ``ids`` (their ``Attention`` modules in ``modules``): float32
        ``[len(ids), heads, hi - lo, num_tokens]``."""
        return torch.stack(
            [attention_pattern(self.queries[k][lo:hi], self.keys[k], modules[k], lo) for k in ids]
        )


class PatternCaptures:
    """The pattern captures of one worker: queries and keys of those still
    running, on the device (by request id), and the finished ones' patterns,
    host tensors ``[points, heads, queries, keys]`` float32 with their query
    window ``(lo, hi)`` in positions, until they leave with the rows."""

    def __init__(self) -> None:
        self.running: dict[str, PatternHistory] = {}
        self.ready: dict[str, tuple[torch.Tensor, int, int]] = {}

    def keep(
        self,
        req_id: str,
        step: "CaptureStep",
        done: bool,
        inner: slice,
        points: "CapturePoints",
        copies: "HostCopies",
    ) -> None:
        """This forward's queries and keys of ``req_id`` (rows ``inner`` of
        the capture buffers) into its history; once its last position is
        computed (``done``), the patterns of its query window, copied to the
        host (not waited on)."""
        history = self.running.get(req_id)
        if history is None or step.start == 0:  # fresh (or recomputed) capture
            history = self.running[req_id] = PatternHistory(step.num_tokens)
        for k in step.patterns:
            q, key = points.read_pattern(k)
            history.write(k, step.first, q[inner], key[inner])
        if not done:
            return
        del self.running[req_id]
        n = step.num_tokens
        lo = step.query_start
        hi = n if step.query_stop is None else min(step.query_stop, n)
        patterns = history.weights(step.patterns, points.pattern_modules, lo, hi)
        host = copies.empty(tuple(patterns.shape), patterns.dtype)
        copies.copy(host, patterns)
        self.ready[req_id] = (host, lo, hi)

    def forget(self, req_id: str) -> None:
        self.running.pop(req_id, None)
        self.ready.pop(req_id, None)


def attention_pattern(
    q: torch.Tensor, k: torch.Tensor, attn: nn.Module, first_query: int
) -> torch.Tensor:
    """Attention weights of query rows ``q`` (positions ``first_query ..``)
    over keys ``k`` (positions ``0 .. len(k) - 1``): float32 ``[heads,
    len(q), len(k)]``.

    ``attn`` is vLLM's ``Attention`` module of the layer: head counts, head
    size and sliding window from it, scale, logit soft-cap and attention
    sinks (gpt-oss) from its backend implementation (every backend keeps
    them).
    """
    heads, kv_heads, head_size = attn.num_heads, attn.num_kv_heads, attn.head_size
    nq, nk = q.shape[0], k.shape[0]
    queries = q.float().view(nq, heads, head_size)
    keys = k.float().view(nk, kv_heads, head_size).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries, keys) * float(attn.impl.scale)
    cap = getattr(attn.impl, "logits_soft_cap", None)
    if cap:
        scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(first_query, first_query + nq, device=q.device)[:, None]
    k_pos = torch.arange(nk, device=q.device)[None, :]
    hidden = k_pos > q_pos  # causal
    window = getattr(attn, "sliding_window", None)
    if window:
        hidden |= q_pos - k_pos >= window
    scores.masked_fill_(hidden, float("-inf"))
    sinks = getattr(attn.impl, "sinks", None)
    if sinks is None:
        return scores.softmax(dim=-1)
    # Attention sinks (gpt-oss): one more logit per head in the softmax,
    # attached to no key; the weights over the keys then sum to less than 1.
    sink = sinks.float().view(heads, 1, 1).expand(heads, nq, 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
