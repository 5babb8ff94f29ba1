# SPDX-License-Identifier: Apache-2.0
"""Hold the engine still mid-generation, by construction, for tests.

"The client left while its request was still generating" must hold whatever
the machine's speed: a tiny model generates hundreds of tokens in the time an
HTTP ``/pause`` takes to land, so pausing after the first chunk is a race the
engine sometimes wins (seen in CI: 400 of 400 tokens generated).

:class:`HoldWhileFileExists` is a vLLM logits processor (start the server
with ``--logits-processors tests.support.request_gate:HoldWhileFileExists``).
A request that names a file, ``vllm_xargs={"hold_while_exists": "/path"}``,
gets its first token as usual; from its next step on, the worker waits inside
sampling for as long as that file exists. The test reads the first chunk,
disconnects, waits until the server has closed the stream (its abort is then
queued in the engine), and deletes the file: the engine finishes the held step
and drops the request. Requests that name no file cost one dict lookup per step.
"""

import os
import time

import torch

from vllm.logger import init_logger
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

logger = init_logger(__name__)

#: The ``vllm_xargs`` key naming the gate file.
GATE_ARG = "hold_while_exists"
#: The longest a step is held (s); below vLLM's 300 s execute-model timeout,
#: so a test that never deletes its file fails loudly instead of hanging.
MAX_HOLD_S = 240.0
POLL_S = 0.02


class HoldWhileFileExists(LogitsProcessor):
    """Holds every step after a gated request's first token while its file exists."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch index -> (gate file, the request's live output token ids)
        self._gated: dict[int, tuple[str, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        # False: vLLM skips argmax-invariant processors for greedy requests,
        # and the hold must apply to those too. Logits are returned unchanged.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._gated, batch_update, _gate_of)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._gated:
            for path, output_ids in list(self._gated.values()):
                if output_ids:
                    _wait_while_exists(path)
        return logits


def _gate_of(params, _prompt_ids, output_ids: list[int]):
    extra = params.extra_args or {}
    path = extra.get(GATE_ARG)
    return (str(path), output_ids) if path else None


def _wait_while_exists(path: str) -> None:
    deadline = time.monotonic() + MAX_HOLD_S
    while os.path.exists(path):
        if time.monotonic() > deadline:
            logger.warning("Gate %s still exists after %.0f s; releasing.", path, MAX_HOLD_S)
            return
        time.sleep(POLL_S)
