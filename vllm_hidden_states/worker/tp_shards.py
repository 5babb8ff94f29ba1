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

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vllm_hidden_states.points import point_of_id

if TYPE_CHECKING:
    from vllm_hidden_states.steering_config import SteeringConfig
    from vllm_hidden_states.worker.capture_points import CapturePoints


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


def is_share(local_width: int, full_width: int, what: str) -> bool:
    """Whether this rank holds a ``1 / tp`` share of a point ``full_width``
    wide (its heads or neurons: True) or all of it (a module vLLM does not
    shard: False); RuntimeError for anything else, which no gather or cut
    would put right."""
    tp = tp_rank_and_size()[1]
    if tp > 1 and local_width * tp == full_width:
        return True
    if local_width == full_width:
        return False
    raise RuntimeError(
        f"vllm-hidden-states: {what} is {local_width} wide on this rank, neither all "
        f"{full_width} of it nor a 1/{tp} share; it cannot be captured or written "
        "under this tensor parallelism (leave it out of --hidden-states-points / "
        "--steering-points)"
    )


def linear_local_width(module: nn.Module) -> int:
    """The input width of a vLLM linear layer on this rank
    (``input_size_per_partition``; a plain ``nn.Linear``'s ``in_features``)."""
    return int(getattr(module, "input_size_per_partition", 0) or module.in_features)


def linear_full_width(module: nn.Module) -> int:
    """The input width of a vLLM linear layer over every rank (``input_size``;
    a plain ``nn.Linear``'s ``in_features``)."""
    return int(getattr(module, "input_size", 0) or module.in_features)


def sharded_ids(points: "CapturePoints", num_layers: int, model_config: Any) -> set[int]:
    """The wide ids whose rows this rank holds a share of (to gather after
    the forward), of ``points``' ids past ``num_layers``: mlp_post / attn_z
    at the down / output projection (its ``input_size`` over every rank),
    q / k / v at vLLM's ``Attention`` (the layer's query heads, or the
    model's KV heads, from ``model_config``, times the head size)."""
    from vllm_hidden_states.steering_config import z_shapes_of

    shapes = z_shapes_of(model_config, num_layers)
    kv_heads = int(model_config.get_total_num_kv_heads())
    out = set()
    for k, module in points.neuron_modules.items():
        point = point_of_id(k, num_layers)
        assert point is not None  # wide ids lie past L
        kind, layer = point
        if kind == "q":
            full = shapes[layer][0] * int(module.head_size)
        elif kind == "k":
            full = kv_heads * int(module.head_size)
        elif kind == "v":
            full = kv_heads * int(getattr(module, "head_size_v", module.head_size))
        else:
            full = linear_full_width(module)
        if is_share(points.neuron_buffers[k].shape[-1], full, f"{kind}.{layer}"):
            out.add(k)
    return out


def z_full_width(config: "SteeringConfig", capture_id: int, module: nn.Module) -> int:
    """The full width of attn_z id ``capture_id`` (every head's: heads *
    head_dim, as the front-end checks rows), read at its output
    projection ``module`` (over every tensor-parallel rank); ValueError
    where it is not the config's."""
    point = point_of_id(capture_id, config.num_layers)
    assert point is not None
    width = linear_full_width(module)
    heads, head_dim = config.z_shapes[point[1]]
    if width != heads * head_dim:
        raise ValueError(
            f"attn_z.{point[1]}: {type(module).__name__} takes {width} values per token "
            f"(over every tensor-parallel rank), not {heads} heads x {head_dim} (the "
            "config's); leave attn_z out of --steering-points"
        )
    return width


def z_is_share(config: "SteeringConfig", capture_id: int, module: nn.Module) -> bool:
    """Whether this rank's output projection ``module`` of attn_z id
    ``capture_id`` reads only its heads (a ``1 / tp`` share)."""
    point = point_of_id(capture_id, config.num_layers)
    assert point is not None
    what = f"attn_z.{point[1]}"
    return is_share(linear_local_width(module), linear_full_width(module), what)


class WideRows:
    """This step's device rows of the wide ids (mlp_post, attn_z, q, k, v:
    ``[rows, width]``, from the capture buffers), every head's, in HF's
    order.

    Under tensor parallelism each rank's buffer of a sharded id holds its
    heads (neurons) only: the first read of an id in a step gathers the
    whole buffer across the ranks (every rank reads the same ids in the same
    order: they run the same plan), in head order, the full width as with
    one rank. Ids of a module vLLM does not shard are whole on every rank.
    q / k of a layer whose heads vLLM holds in halves order (Llama 4) are
    put back per head (``CapturePoints.hf_order``).
    """

    def __init__(self, points: "CapturePoints", config: Any, runner: Any) -> None:
        self.points = points
        self.sharded: set[int] = set()
        if tp_rank_and_size()[1] > 1:
            self.sharded = sharded_ids(points, config.num_layers, runner.vllm_config.model_config)
        self.gathered: dict[int, torch.Tensor] = {}  # this step's, cleared after it

    def rows(self, k: int, inner: slice) -> torch.Tensor:
        """Wide id ``k``'s rows ``inner`` of the last forward, ``[rows, full width]``."""
        if k not in self.sharded:
            rows = self.points.read_neurons(k)[inner]
        else:
            gathered = self.gathered.get(k)
            if gathered is None:
                gathered = self.gathered[k] = gather_columns(self.points.read_neurons(k))
            rows = gathered[inner]
        return self.points.hf_order(k, rows)
