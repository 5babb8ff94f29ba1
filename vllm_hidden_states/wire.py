# SPDX-License-Identifier: Apache-2.0
"""Wire types between the front-end and the EngineCore.

Three msgspec structs travel over ZMQ:

* :class:`HiddenStatesSpec` rides on ``EngineCoreRequest.hidden_states_spec``
  (and on the engine's ``Request.hidden_states_spec``): what a generation
  request asked for, resolved by :mod:`vllm_hidden_states.frontend.validate`.
* :class:`HiddenStatesExtractRequest` is the payload of the
  ``HIDDEN_STATES_EXTRACT`` core request type: the post-sampling prefill
  that completes a finished "last"/"all" request (:func:`extract_for`),
  queued by the engine itself when the request finished there without stop
  strings, otherwise sent by the front-end.
* :class:`CapturedRows` is what comes back: every kind of captured data of
  one request over a run of positions, or of a *group* of requests (its
  ``req_ids`` own consecutive runs of ``counts`` positions). A step's rows
  travel grouped, one tensor per field for many requests, from the worker
  (``ModelRunnerOutput.captured``) through the scheduler to the client
  (``EngineCoreOutputs.captured``), which hands each output its own view
  (``EngineCoreOutput.captured``, :func:`hand_out_captured`) right after
  decoding. Per-request tensors would cost a pickle and a msgpack frame each
  per step, which is most of an "all" request's cost on a small model.

All three are *defined* in the patched ``vllm.v1.engine`` (patch 0001), because vLLM
must decode them in every process, and a patched vLLM must import without this
package; they are re-exported here so the package has one place to name them.

``CapturedRows.hidden`` is one CPU tensor ``[num_layers, num_positions,
hidden_size]`` in the model dtype, layers in the order of the extract's (or
spec's) distinct absolute layers, ascending; ``sae_ids`` / ``sae_values`` are
int32 / float32 ``[num_positions, k]``. Typed tensor fields, so msgspec sends
each as a zero-copy ZMQ frame. :func:`cat_rows`, :func:`slice_rows` and
:func:`num_positions` are the one path that joins and cuts them: a new kind of
captured data is a new field and its entry in :data:`POSITION_AXIS`.
"""

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from vllm.v1.engine import CapturedRows, HiddenStatesExtractRequest, HiddenStatesSpec

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutputs

__all__ = [
    "EXTRACT_ID_SUFFIX",
    "POSITION_AXIS",
    "CapturedRows",
    "cat_rows",
    "group_rows",
    "hand_out_captured",
    "num_positions",
    "slice_rows",
    "split_group",
    "without",
    "HiddenStatesExtractRequest",
    "HiddenStatesSpec",
    "distinct_layers",
    "ends_before_final_token",
    "extract_for",
    "extract_id_for",
    "original_id_of",
]

# Suffix of the engine-internal id of a HIDDEN_STATES_EXTRACT request. The
# scheduler treats a duplicate request id as a streaming continuation, so the
# extract must never reuse the id of the request it extracts for.
EXTRACT_ID_SUFFIX = "-hs"


def extract_id_for(request_id: str) -> str:
    """The engine-internal id of the extract that serves ``request_id``."""
    return request_id + EXTRACT_ID_SUFFIX


def original_id_of(extract_id: str) -> str:
    """The id of the request an extract serves (inverse of :func:`extract_id_for`)."""
    return extract_id.removesuffix(EXTRACT_ID_SUFFIX)


def ends_before_final_token(spec: HiddenStatesSpec, num_tokens: int) -> bool:
    """Whether an inline window ends before the final token of a sequence of
    ``num_tokens`` (position ``num_tokens - 1``, which only an extract
    computes): its inline rows then complete it without an extract."""
    return spec.inline and spec.end is not None and spec.end < num_tokens


def extract_for(
    spec: HiddenStatesSpec,
    request_id: str,
    token_ids: list[int],
    *,
    lora_request: Any = None,
    cache_salt: str | None = None,
    priority: int = 0,
    steering: list[dict[str, Any]] | None = None,
    client_index: int = 0,
) -> HiddenStatesExtractRequest:
    """The extract that completes the capture of ``request_id`` (a finished
    "last"/"all" request) over ``token_ids`` (its prompt + output).

    "last", and inline "all" (only the final token is missing): the final
    position. "all" without inline capture: every position recomputed, cut
    to the window. Attention patterns need every key, so their extract
    recomputes every position ("all") and returns the query window asked
    ("last": the final position). LoRA, cache salt, priority and steering
    are the request's own (the extract replays its steered forward).
    """
    num_tokens = len(token_ids)
    positions, start, end = ("last" if spec.inline else spec.positions), 0, None
    if spec.pattern_ids:
        positions = "all"
        if spec.positions == "last":
            start = num_tokens - 1
        else:
            start, end = min(spec.start, num_tokens), spec.end
    return HiddenStatesExtractRequest(
        request_id=extract_id_for(request_id),
        token_ids=token_ids,
        layers=distinct_layers(spec),
        positions=positions,
        arrival_time=time.time(),
        lora_request=lora_request,
        cache_salt=cache_salt,
        priority=priority,
        client_index=client_index,
        sae_top_k=spec.sae_top_k,
        patterns=list(spec.pattern_ids),
        start=start,
        end=end,
        neurons=list(spec.neuron_ids),
        steering=steering,
    )


def result_keys(spec: HiddenStatesSpec) -> list[int | str]:
    """The keys of a request's ``hidden_states``: its layers as given, then
    its point addresses as given (``spec.abs_layers`` holds their capture ids,
    in the same order)."""
    return [*spec.layers, *spec.points]


def distinct_layers(spec: HiddenStatesSpec) -> list[int]:
    """The capture ids a capture produces, in result order (ascending)."""
    return sorted(set(spec.abs_layers))


# The positions axis of each CapturedRows field.
POSITION_AXIS: dict[str, int] = {
    "hidden": 1,
    "sae_ids": 0,
    "sae_values": 0,
    "patterns": 2,
    "neurons": 1,
}
# The fields that name a group's owners; every other field is data.
_GROUP_FIELDS = ("req_ids", "counts")
_FIELDS = [f for f in msgspec.structs.fields(CapturedRows) if f.name not in _GROUP_FIELDS]
assert {f.name for f in _FIELDS} == set(POSITION_AXIS), "a CapturedRows field lacks its axis"


def num_positions(rows: CapturedRows) -> int:
    """How many positions ``rows`` covers (every present field agrees)."""
    for f in _FIELDS:
        value = getattr(rows, f.name)
        if value is not None:
            return value.shape[POSITION_AXIS[f.name]]
    return 0


def cat_rows(parts: list[CapturedRows], grouped: bool = False) -> CapturedRows:
    """``parts`` (consecutive runs of positions, the same fields present in
    each) joined into one run; ``grouped``: the parts are groups, and so is
    the result (their requests in order)."""
    if len(parts) == 1:
        return parts[0]
    fields: dict = {}
    for f in _FIELDS:
        values = [getattr(p, f.name) for p in parts]
        if values[0] is not None:
            fields[f.name] = torch.cat(values, dim=POSITION_AXIS[f.name])
    if grouped:
        fields["req_ids"] = [r for p in parts for r in p.req_ids]
        fields["counts"] = [c for p in parts for c in p.counts]
    return CapturedRows(**fields)


def slice_rows(rows: CapturedRows, start: int, stop: int | None = None) -> CapturedRows:
    """Positions ``start:stop`` of ``rows`` (views, no copy)."""
    fields = {}
    for f in _FIELDS:
        value = getattr(rows, f.name)
        if value is not None:
            axis = POSITION_AXIS[f.name]
            fields[f.name] = value[(slice(None),) * axis + (slice(start, stop),)]
    return CapturedRows(**fields)


def group_rows(rows: CapturedRows, req_id: str) -> CapturedRows:
    """One request's ``rows`` as a group of one (in place)."""
    rows.req_ids, rows.counts = [req_id], [num_positions(rows)]
    return rows


def split_group(group: CapturedRows) -> Iterator[tuple[str, CapturedRows]]:
    """``(req_id, rows)`` of each request of ``group``, in order (views: one
    ``split`` per field, no copy)."""
    parts = {}
    for f in _FIELDS:
        value = getattr(group, f.name)
        if value is not None:
            parts[f.name] = value.split(group.counts, dim=POSITION_AXIS[f.name])
    for i, req_id in enumerate(group.req_ids):
        yield req_id, CapturedRows(**{name: views[i] for name, views in parts.items()})


def hand_out_captured(outputs: "EngineCoreOutputs") -> None:
    """Right after the client decoded a step's outputs: each output whose
    request captured rows gets them as ``EngineCoreOutput.captured``.

    The scheduler grouped only rows whose request has an output in
    ``outputs`` (:meth:`~vllm_hidden_states.engine.planner.CapturePlanner.attach`).
    """
    groups, outputs.captured = outputs.captured, None
    if not groups:
        return
    by_id = {eco.request_id: eco for eco in outputs.outputs}
    for group in groups:
        for req_id, rows in split_group(group):
            # Always there (see above); were one missing, its rows are
            # dropped here and its tracker fails the request visibly, rather
            # than this client's output thread dying on a KeyError.
            if (eco := by_id.get(req_id)) is not None:
                eco.captured = rows


def without(group: CapturedRows, req_ids: set[str]) -> CapturedRows | None:
    """``group`` less the rows of ``req_ids`` (a new group of views; None
    when nothing is left)."""
    kept = [(req_id, rows) for req_id, rows in split_group(group) if req_id not in req_ids]
    if not kept:
        return None
    return cat_rows([group_rows(rows, req_id) for req_id, rows in kept], grouped=True)
