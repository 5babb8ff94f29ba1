# SPDX-License-Identifier: Apache-2.0
"""Wire types for hidden-state requests.

Two msgspec structs travel between the front-end and the EngineCore:

* :class:`HiddenStatesSpec` rides on ``EngineCoreRequest.return_hidden_states``:
  what a generation request asked for, already validated against the engine.
* :class:`HiddenStatesExtractRequest` is the payload of the
  ``HIDDEN_STATES_EXTRACT`` core request type: the post-sampling prefill the
  front-end dispatches when a request that asked for hidden states finishes.

The result comes back as ``EngineCoreOutput.hidden_states``: one CPU tensor of
shape ``[num_layers, num_positions, hidden_size]`` in the model dtype, layers
in the order of ``HiddenStatesExtractRequest.layers``. A typed tensor field, so
msgspec sends it as a zero-copy ZMQ frame, never as a list of floats.

This module imports nothing from vLLM except the LoRA request type, because
patched vLLM modules import it while vLLM itself is still importing.
"""

from typing import Literal

import msgspec

from vllm.lora.request import LoRARequest

Positions = Literal["last", "all", "prompt"]
POSITIONS: tuple[str, ...] = ("last", "all", "prompt")
# Positions served by a post-sampling HIDDEN_STATES_EXTRACT prefill. "prompt" is
# captured during the request's own prefill instead: no extract, one pass.
EXTRACT_POSITIONS: tuple[str, ...] = ("last", "all")

# Suffix of the engine-internal id of a HIDDEN_STATES_EXTRACT request. The
# scheduler treats a duplicate request id as a streaming continuation, so the
# extract must never reuse the id of the request it extracts for.
EXTRACT_ID_SUFFIX = "-hs"


class HiddenStatesSpec(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    frozen=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    """What one request asked for, validated by the InputProcessor.

    ``layers`` are the keys exactly as the request gave them (e.g. ``[-1, 16]``);
    ``abs_layers`` the same layers as absolute HF indices in ``0..L``
    (``L = num_hidden_layers``), index for index.
    """

    layers: list[int]
    abs_layers: list[int]
    positions: str = "last"


class HiddenStatesExtractRequest(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,
):  # type: ignore[call-arg]
    """A post-sampling prefill that returns hidden states instead of tokens.

    Attributes:
        request_id: engine-internal id of the extract (never a live request id).
        token_ids: the full sequence, prompt + generated token ids, whose
            states are wanted. Positions index this list.
        layers: distinct absolute HF layer indices (``0..L``) to capture, in the
            order the result tensor's first dimension will have.
        positions: ``"last"`` (only ``token_ids[-1]``) or ``"all"``
            (``"prompt"`` never needs an extract).
        lora_request, cache_salt: copied from the original request, so the
            prefill reproduces its activations and hits its prefix-cache blocks.
    """

    request_id: str
    token_ids: list[int]
    layers: list[int]
    positions: str = "last"
    arrival_time: float = 0.0
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    priority: int = 0
    client_index: int = 0


def extract_id_for(request_id: str) -> str:
    """The engine-internal id of the extract that serves ``request_id``."""
    return request_id + EXTRACT_ID_SUFFIX
