# SPDX-License-Identifier: Apache-2.0
"""``vllm-hidden-states collect``: harvest a dataset's hidden states to shards.

A module a job: :mod:`.config` (what a run does, what it did),
:mod:`.dataset` (the documents, in batches), :mod:`.tokens` (token ids, the
client-side cut of a long document), :mod:`.offline` (the engine in this
process), :mod:`.server` (a running server over HTTP), :mod:`.harvest`
(:func:`collect`, one run per output directory), :mod:`.cli` (the command
line). The user's guide: docs/datasets.md; the shards:
:mod:`vllm_hidden_states.store.parquet_shards`.
"""

from vllm_hidden_states.tools.collect.cli import add_arguments, run
from vllm_hidden_states.tools.collect.config import CollectConfig, CollectResult
from vllm_hidden_states.tools.collect.dataset import Doc, read_dataset
from vllm_hidden_states.tools.collect.harvest import LOCK_FILE, OutputLocked, collect, lock_output

__all__ = [
    "LOCK_FILE",
    "CollectConfig",
    "CollectResult",
    "Doc",
    "OutputLocked",
    "add_arguments",
    "collect",
    "lock_output",
    "read_dataset",
    "run",
]
