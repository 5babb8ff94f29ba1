# SPDX-License-Identifier: Apache-2.0
"""Wire types between the front-end and the EngineCore.

Three msgspec structs travel over ZMQ:

* :class:`HiddenStatesSpec` rides on ``EngineCoreRequest.return_hidden_states``
  (and on the engine's ``Request.hidden_states_spec``): what a generation
  request asked for, resolved by :mod:`vllm_hidden_states.frontend.validate`.
* :class:`HiddenStatesExtractRequest` is the payload of the
  ``HIDDEN_STATES_EXTRACT`` core request type: the post-sampling prefill the
  front-end dispatches when a "last"/"all" request finishes.
* :class:`CapturedRows` is what comes back, on ``EngineCoreOutput.captured``
  (and, per request, on ``ModelRunnerOutput.captured`` from the worker): every
  kind of captured data of one request over a run of positions.

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

import msgspec
import torch

from vllm.v1.engine import CapturedRows, HiddenStatesExtractRequest, HiddenStatesSpec

__all__ = [
    "EXTRACT_ID_SUFFIX",
    "POSITION_AXIS",
    "CapturedRows",
    "cat_rows",
    "num_positions",
    "slice_rows",
    "HiddenStatesExtractRequest",
    "HiddenStatesSpec",
    "distinct_layers",
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
_FIELDS = msgspec.structs.fields(CapturedRows)
assert {f.name for f in _FIELDS} == set(POSITION_AXIS), "a CapturedRows field lacks its axis"


def num_positions(rows: CapturedRows) -> int:
    """How many positions ``rows`` covers (every present field agrees)."""
    for f in _FIELDS:
        value = getattr(rows, f.name)
        if value is not None:
            return value.shape[POSITION_AXIS[f.name]]
    return 0


def cat_rows(parts: list[CapturedRows]) -> CapturedRows:
    """``parts`` (consecutive runs of positions, the same fields present in
    each) joined into one run."""
    if len(parts) == 1:
        return parts[0]
    fields = {}
    for f in _FIELDS:
        values = [getattr(p, f.name) for p in parts]
        if values[0] is not None:
            fields[f.name] = torch.cat(values, dim=POSITION_AXIS[f.name])
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
