# SPDX-License-Identifier: Apache-2.0
"""Points that tensor parallelism shards by heads (or MLP neurons).

vLLM splits the query heads, the KV heads (where there are at least as many
as ranks) and the MLP's intermediate neurons into contiguous blocks, rank
``r`` holding block ``r``: the input of the attention's output projection
(attn_z), the attention module's query, key and value (q, k, v) and the
input of the MLP's down projection (mlp_post) are, on each rank, that
rank's columns of the full point. Captured rows are put back together after
the forward, outside any compiled graph, with vLLM's own collective over the
tensor-parallel group; rows written into such a point (patch rows,
ablate_heads) are cut to the rank's columns before they reach its table.
"""

import torch


def tp_rank_and_size() -> tuple[int, int]:
    """``(rank, world size)`` of this worker in its tensor-parallel group;
    ``(0, 1)`` where vLLM's model parallelism is not initialized (one
    process, nothing sharded)."""
    from vllm.distributed import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return 0, 1
    group = get_tp_group()
    return group.rank_in_group, group.world_size


def gather_columns(rows: torch.Tensor) -> torch.Tensor:
    """``[count, size * width]``: every rank's ``rows`` (``[count, width]``,
    this rank's columns of a sharded point), side by side in rank order,
    which is head (neuron) order. A collective: every rank of the group
    calls it, with the same ``count``, at the same point of its step."""
    from vllm.distributed import get_tp_group

    return get_tp_group().all_gather(rows.contiguous(), dim=-1)


def rank_columns(full_width: int) -> slice:
    """The columns of a sharded point of ``full_width`` (every head's) that
    this rank holds: block ``rank`` of ``size`` equal blocks."""
    rank, size = tp_rank_and_size()
    local = full_width // size
    return slice(rank * local, (rank + 1) * local)
