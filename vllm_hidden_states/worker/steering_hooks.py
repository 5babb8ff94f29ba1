# SPDX-License-Identifier: Apache-2.0
"""The steering tables' hooks: at model load, each steerable point's module
gets the tables as buffers and one forward hook that writes its points
(``steering_op.steer_hook``), before any capture hook there."""

from typing import Any, Protocol

import torch
from torch import nn

from vllm.logger import init_logger
from vllm_hidden_states.steering_config import SteeringConfig
from vllm_hidden_states.worker import c_ops
from vllm_hidden_states.worker.capture_op import count_readable_on_host, off_cpu_route
from vllm_hidden_states.worker.rewrite_op import SAE_ARCH_CODES, register_ops
from vllm_hidden_states.worker.steering_op import SteerTap, steer_hook

logger = init_logger(__name__)


class SteeringTables(Protocol):
    """What the hooks read of the runner's steering state
    (``steering_tables.Steering``): the config, the device tables the ops
    read in the graph, and where each steerable id's row lies."""

    config: SteeringConfig
    device: torch.device
    hidden_size: int
    index_of: dict[int, int]  # steerable id -> its row in the tables
    # steer: [points, max_tokens] int64 rows and slots, [2 * points] counts,
    # [slots, hidden] float32 vectors
    rows: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor
    token_slots: torch.Tensor | None
    adds: torch.Tensor
    dirs: torch.Tensor
    enc: torch.Tensor | None
    dec: torch.Tensor | None
    par: torch.Tensor | None
    # patch and splice: the same per point, plus the splice's row
    rewrites: bool
    splice_index: int
    rw_rows: torch.Tensor
    rw_slots: torch.Tensor
    rw_counts: torch.Tensor
    patch_table: torch.Tensor
    patch_token_slots: torch.Tensor | None
    edit_ids: torch.Tensor
    edit_mode: torch.Tensor
    edit_vals: torch.Tensor
    keep: torch.Tensor


def install_hooks(steering: SteeringTables, taps: dict[int, SteerTap], sae: Any) -> None:
    """Register ``steering``'s tables on each tap's module and one hook per
    module and side (pre / post), its points in network order."""
    config, device = steering.config, steering.device
    hooks: dict[tuple[int, str], list[tuple[SteerTap, int]]] = {}
    modules: dict[int, nn.Module] = {}
    if steering.rewrites:
        register_ops()
    for k, tap in taps.items():
        module = tap.module
        if steering.rewrites and not hasattr(module, "_hs_rw_rows"):
            module.register_buffer("_hs_rw_rows", steering.rw_rows, persistent=False)
            module.register_buffer("_hs_rw_slots", steering.rw_slots, persistent=False)
            module.register_buffer("_hs_rw_counts", steering.rw_counts, persistent=False)
            module.register_buffer("_hs_patch_table", steering.patch_table, persistent=False)
            if steering.patch_token_slots is not None:
                module.register_buffer(
                    "_hs_patch_token_slots", steering.patch_token_slots, persistent=False
                )
        if splices(config, sae) and k == config.sae_id:
            _splice_buffers(steering, module, sae)
        if not hasattr(module, "_hs_steer_rows"):
            module.register_buffer("_hs_steer_rows", steering.rows, persistent=False)
            module.register_buffer("_hs_steer_slots", steering.slots, persistent=False)
            module.register_buffer("_hs_steer_counts", steering.counts, persistent=False)
            module.register_buffer("_hs_steer_adds", steering.adds, persistent=False)
            module.register_buffer("_hs_steer_dirs", steering.dirs, persistent=False)
            if steering.token_slots is not None:
                module.register_buffer(
                    "_hs_steer_token_slots", steering.token_slots, persistent=False
                )
            if steering.enc is not None:
                module.register_buffer("_hs_steer_enc", steering.enc, persistent=False)
                module.register_buffer("_hs_steer_dec", steering.dec, persistent=False)
                module.register_buffer("_hs_steer_par", steering.par, persistent=False)
        hooks.setdefault((id(module), tap.when), []).append((tap, steering.index_of[k]))
        modules[id(module)] = module
    for (module_id, when), entries in hooks.items():
        entries.sort(key=lambda e: e[0].order)
        host_counts = steering.counts.numpy() if count_readable_on_host(device) else None
        on_host = steering.rewrites and count_readable_on_host(device)
        rw_host_counts = steering.rw_counts.numpy() if on_host else None
        sae_index = (
            steering.index_of.get(config.sae_id)
            if config.sae_id is not None and splices(config, sae)
            else None
        )
        hook = steer_hook(
            [(t.pair, i, t.scale, t.heads) for t, i in entries],
            when == "post",
            host_counts,
            patches=config.max_patch_rows > 0,
            rw_host_counts=rw_host_counts,
            splice=(sae_index, steering.splice_index) if sae_index is not None else None,
        )
        module = modules[module_id]
        # prepend: steer before any capture hook at the same module.
        if when == "pre":
            module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
        else:
            module.register_forward_hook(hook, with_kwargs=True, prepend=True)
    if count_readable_on_host(device):
        route = "eager: " + (
            "vllm_hidden_states._C (C++)"
            if c_ops.load()
            else f"the op's Python body ({c_ops.why_not()})"
        )
    else:
        route = "vllm_hidden_states._C CUDA" if off_cpu_route() == "c" else "Triton"
    logger.info(
        "vllm-hidden-states: %d steerable points (%s), %d vector slots of %d; writes: %s",
        len(taps),
        config.describe_points(),
        steering.adds.shape[0],
        steering.hidden_size,
        route,
    )


def splices(config: SteeringConfig, sae: Any) -> bool:
    """Whether requests may splice the engine's SAE here."""
    return sae is not None and config.sae_splice_problem is None and (config.sae_id in config.ids)


def _splice_buffers(steering: SteeringTables, module: nn.Module, sae: Any) -> None:
    """The SAE's weights and the edit tables, where the splice op reads
    them (its point's module)."""
    module.register_buffer("_hs_sae_w_enc", sae.W_enc, persistent=False)
    module.register_buffer("_hs_sae_b_enc", sae.b_enc, persistent=False)
    module.register_buffer("_hs_sae_w_dec", sae.W_dec, persistent=False)
    module.register_buffer("_hs_sae_b_dec", sae.b_dec, persistent=False)
    if sae.threshold is not None:
        module.register_buffer("_hs_sae_threshold", sae.threshold, persistent=False)
    module.register_buffer("_hs_edit_ids", steering.edit_ids, persistent=False)
    module.register_buffer("_hs_edit_mode", steering.edit_mode, persistent=False)
    module.register_buffer("_hs_edit_vals", steering.edit_vals, persistent=False)
    module.register_buffer("_hs_keep", steering.keep, persistent=False)
    module._hs_sae_arch = (
        SAE_ARCH_CODES[sae.architecture],
        int(sae.k or 0),
        bool(sae.apply_b_dec_to_input),
    )
