# SPDX-License-Identifier: Apache-2.0
"""The multimodal inputs of finished requests, held for their extracts.

A HIDDEN_STATES_EXTRACT replays ``prompt + output`` token ids. For a prompt
with images those ids are placeholders: without the images the extract would
embed them as text and serve wrong states at every position after them. So
when a request with multimodal inputs finishes and its capture needs an
extract, its ``mm_features`` (vLLM's, data included) are held here until the
extract is queued, which then carries them: vLLM schedules their encoder
(or finds its output in the encoder cache), its prefix-cache hashes equal
the request's own, and M-RoPE positions are the request's. An extract whose
request's inputs are no longer held is refused, never run without them.
"""

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

# How long a finished request's multimodal inputs wait for its extract, in
# seconds (the front-end sends it as soon as it sees the finished output).
HOLD_SECONDS = 30.0
# Request ids whose inputs expired, remembered so that a late extract is
# refused rather than run on placeholders; bounded.
MAX_FORGOTTEN = 65536


class HeldMMInputs:
    """``mm_features`` of finished requests, by request id, oldest first."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, tuple[list[Any], float]] = OrderedDict()
        self._forgotten: OrderedDict[str, None] = OrderedDict()

    def hold(self, request: "Request") -> None:
        """Keep the multimodal inputs of ``request``, which finished (any way:
        the front-end may still send its extract after a stop string)."""
        if request.mm_features:
            self._held[request.request_id] = (list(request.mm_features), time.monotonic())
        self.expire()

    def take(self, request_id: str) -> tuple[list[Any] | None, bool]:
        """``(mm_features, forgotten)`` of a finished request: its inputs (None
        for a text prompt), and whether they expired before its extract came."""
        entry = self._held.pop(request_id, None)
        if entry is not None:
            return entry[0], False
        return None, request_id in self._forgotten

    def expire(self) -> None:
        deadline = time.monotonic() - HOLD_SECONDS
        while self._held:
            request_id, (_, held_at) = next(iter(self._held.items()))
            if held_at > deadline:
                break
            del self._held[request_id]
            self._forgotten[request_id] = None
            if len(self._forgotten) > MAX_FORGOTTEN:
                self._forgotten.popitem(last=False)
