# SPDX-License-Identifier: Apache-2.0
"""Wire types between the front-end and the EngineCore.

Two msgspec structs travel over ZMQ:

* :class:`HiddenStatesSpec` rides on ``EngineCoreRequest.return_hidden_states``
  (and on the engine's ``Request.hidden_states_spec``): what a generation
  request asked for, resolved by :mod:`vllm_hidden_states.frontend.validate`.
* :class:`HiddenStatesExtractRequest` is the payload of the
  ``HIDDEN_STATES_EXTRACT`` core request type: the post-sampling prefill the
  front-end dispatches when a "last"/"all" request finishes.

Both are *defined* in the patched ``vllm.v1.engine`` (patch 0001), because vLLM
must decode them in every process, and a patched vLLM must import without this
package; they are re-exported here so the package has one place to name them.

The result comes back as ``EngineCoreOutput.hidden_states``: one CPU tensor of
shape ``[num_layers, num_positions, hidden_size]`` in the model dtype, layers in
the order of the extract's (or spec's) distinct absolute layers, ascending. A
typed tensor field, so msgspec sends it as a zero-copy ZMQ frame.
"""

from vllm.v1.engine import HiddenStatesExtractRequest, HiddenStatesSpec

__all__ = [
    "EXTRACT_ID_SUFFIX",
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


def distinct_layers(spec: HiddenStatesSpec) -> list[int]:
    """The absolute layers a capture produces, in result order (ascending)."""
    return sorted(set(spec.abs_layers))
