# SPDX-License-Identifier: Apache-2.0
"""Where a step's requests sit among the forward's token rows, for either
model runner: the one view capture and steering arm their rows from.

Model Runner V1 keeps a persistent ``InputBatch`` (``req_id_to_index``,
``num_computed_tokens_cpu``) and ``query_start_loc``; Model Runner V2 builds
a new ``InputBatch`` every step (``req_ids`` in batch order,
``query_start_loc_np``, ``num_computed_tokens_np``). Either is read here
only in a step that arms something.
"""

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class StepBatch:
    """This step's batch, as the rows of the forward see it.

    Attributes:
        index_of: request id -> its index in the batch.
        query_start: int32 ``[num_reqs + 1]`` (or longer, padded): the first
            token row of each batch index; ``query_start[i + 1] -
            query_start[i]`` tokens are scheduled for it.
        num_computed: int ``[num_reqs]`` (or longer): per batch index, the
            tokens computed before this step, i.e. the sequence position of
            its first scheduled token.
    """

    index_of: Mapping[str, int]
    query_start: np.ndarray
    num_computed: np.ndarray

    @classmethod
    def of(cls, runner: Any, input_batch: Any = None) -> "StepBatch":
        """The batch of the step about to run: Model Runner V2 passes its
        step's ``input_batch``; Model Runner V1 keeps its own on the runner."""
        if input_batch is None:  # V1: persistent batch, index kept by vLLM
            batch = runner.input_batch
            return cls(
                batch.req_id_to_index, runner.query_start_loc.np, batch.num_computed_tokens_cpu
            )
        return cls(
            {req_id: i for i, req_id in enumerate(input_batch.req_ids)},
            input_batch.query_start_loc_np,
            input_batch.num_computed_tokens_np,
        )


def expand_stretches(
    firsts: np.ndarray, counts: np.ndarray, slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Batch rows and their slots of stretches starting at batch rows
    ``firsts``, ``counts`` rows long, each with one slot."""
    total = int(counts.sum())
    if total == len(counts):  # a row each (decode, patches): no ranges to expand
        return firsts, slots
    offsets = np.cumsum(counts) - counts
    return np.repeat(firsts - offsets, counts) + np.arange(total), np.repeat(slots, counts)


def ranges(starts: "np.ndarray | list[int]", counts: "np.ndarray | list[int]") -> np.ndarray:
    """int64 ``[sum(counts)]``: ``starts[i], starts[i] + 1, ...`` for
    ``counts[i]`` values each, concatenated."""
    if len(counts) == sum(counts):  # a row each: a decode step
        return np.asarray(starts, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64)
    n = np.asarray(counts, dtype=np.int64)
    total = int(n.sum())
    offsets = np.cumsum(n) - n
    return np.repeat(first - offsets, n) + np.arange(total, dtype=np.int64)


def inference_mode_once() -> contextlib.AbstractContextManager:
    """Inference mode, entered only where the caller is not in it already
    (``execute_model`` is; entering costs microseconds, every step)."""
    return contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()
