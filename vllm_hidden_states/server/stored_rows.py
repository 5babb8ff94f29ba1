# SPDX-License-Identifier: Apache-2.0
"""A patch's store reference (its ``stored`` field): rows an earlier
response stored in the activation store, resolved in the API server into the
patch's ``rows`` (the store answers: ``activation_store.stored_rows``).

``{"op": "patch", "point": "resid_pre.3", "positions": {"start": 2, "end":
6}, "stored": {"request_id": "cmpl-...", "choice": 0, "point":
"resid_pre.3", "positions": {"start": 2, "end": 6}}}``: the reference's point
and positions default to the patch's own (and the patch's positions to the
reference's). The store must keep hidden states (``--activation-store DIR
--activation-store-hidden-states``) and the earlier request must have asked
for those rows. Read off the event loop (a thread); a reference that does not
resolve is a 400 naming what the store holds.
"""

import asyncio
from typing import Any

import numpy as np

from vllm.logger import init_logger
from vllm_hidden_states.points import Window, parse_point
from vllm_hidden_states.request_fields import check_positions
from vllm_hidden_states.server.errors import invalid_request
from vllm_hidden_states.store import choice_writer

logger = init_logger(__name__)

STEERING_PARAM = "steering"
STORED_KEYS = ("request_id", "choice", "point", "positions")
# How long a reference waits for the store's writer to write what it holds
# (the earlier request's rows are queued when its response is sent).
FLUSH_TIMEOUT_S = 30.0


def has_store_refs(value: Any) -> bool:
    return isinstance(value, list) and any(
        isinstance(item, dict) and item.get("stored") is not None for item in value
    )


async def resolve_store_refs(value: list[Any], num_layers: int) -> list[Any]:
    """``value`` with every patch's ``stored`` replaced by the stored rows
    (float32 ``[n, hidden]``); :class:`ApiError` (400) when one does not
    resolve."""
    store, keeps_hidden = choice_writer.opened()
    if store is None or not keeps_hidden:
        raise invalid_request(
            "steering: a patch's 'stored' reads the activation store; start the server "
            "with --activation-store DIR --activation-store-hidden-states (or give 'rows')",
            STEERING_PARAM,
        )
    out = []
    for i, item in enumerate(value):
        if not (isinstance(item, dict) and item.get("stored") is not None):
            out.append(item)
            continue
        where = f"steering[{i}].stored"
        ref = item["stored"]
        if not isinstance(ref, dict) or set(ref) - set(STORED_KEYS):
            raise invalid_request(
                f"{where}: must be an object with keys {list(STORED_KEYS)} (point and "
                "positions default to the patch's)",
                STEERING_PARAM,
            )
        request_id = ref.get("request_id")
        choice = ref.get("choice", 0)
        if not isinstance(request_id, str) or not isinstance(choice, int) or choice < 0:
            raise invalid_request(
                f"{where}: request_id must be a response id (a string) and choice an "
                f"integer >= 0; got {request_id!r}, {choice!r}",
                STEERING_PARAM,
            )
        point = ref.get("point", item.get("point"))
        positions = ref.get("positions", item.get("positions"))
        try:
            kind, layer = parse_point(point, num_layers)
            window = check_positions(positions)
        except ValueError as e:
            raise invalid_request(f"{where}: {e}", STEERING_PARAM) from None
        if not isinstance(window, Window) or window.end is None:
            raise invalid_request(
                f"{where}: positions must be a window {{'start': s, 'end': e}} (the "
                f"reference's or the patch's); got {positions!r}",
                STEERING_PARAM,
            )
        start, end = window.start, window.end
        rows = await asyncio.to_thread(
            _read, store, request_id, choice, f"{kind}.{layer}", _layer_of(kind, layer, num_layers),
            start, end,
        )  # fmt: skip
        if isinstance(rows, str):
            raise invalid_request(f"{where}: {rows}", STEERING_PARAM)
        resolved = {k: v for k, v in item.items() if k != "stored"}
        resolved["rows"] = rows
        resolved.setdefault("positions", {"start": start, "end": end})
        out.append(resolved)
    return out


def _layer_of(kind: str, layer: int, num_layers: int) -> int | None:
    """The layer whose stored rows are this point's too (HF's indexing):
    ``resid_pre.i`` is layer ``i``, ``resid_post.i`` layer ``i + 1`` below
    the last layer (whose output the final norm follows)."""
    if kind == "resid_pre":
        return layer
    if kind == "resid_post" and layer + 1 < num_layers:
        return layer + 1
    return None


def _read(
    store: Any,
    request_id: str,
    choice: int,
    point: str,
    layer: int | None,
    start: int,
    end: int,
) -> np.ndarray | str:
    """The stored rows ``start .. end - 1`` (float32 ``[n, hidden]``), once
    the store's writer has written what it holds, or why not (in words)."""
    from vllm_hidden_states.store.activation_store import RowsNotStored, stored_rows

    if not store.flush(FLUSH_TIMEOUT_S):
        return "the activation store did not write its queue in time; retry"
    try:
        return stored_rows(store.root, request_id, choice, point, layer, start, end)
    except RowsNotStored as e:
        return str(e)
