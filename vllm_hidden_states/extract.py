# SPDX-License-Identifier: Apache-2.0
"""Front-end side: validate requests, hold finished outputs, dispatch extracts.

Flow owned here (all in the front-end process, next to the OutputProcessor):

1. :func:`resolve_request` runs in ``InputProcessor.process_inputs`` and turns
   ``SamplingParams.return_hidden_states`` & co. into a validated
   :class:`HiddenStatesSpec` on ``EngineCoreRequest.return_hidden_states``.
2. When such a request finishes (EOS, stop token, stop string, length), the
   OutputProcessor hands its final output to :meth:`HiddenStatesDispatcher.on_output`,
   which holds it (positions "last"/"all") instead of emitting it. (Positions
   "prompt" are captured during the request's own prefill and arrive on an
   earlier output; those requests are never held.) Only the front-end knows the final token list (stop strings
   are matched and trimmed here), so only it can say which token is "last".
3. The held request becomes a :class:`HiddenStatesExtractRequest`, sent to the
   EngineCore as a ``HIDDEN_STATES_EXTRACT`` core request by the engine loop
   (``LLMEngine.step`` / ``AsyncLLM`` output handler).
4. The extract's EngineCoreOutput carries the states; :meth:`release` attaches
   them to the request state and hands the held output back to the
   OutputProcessor, which emits it as usual.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm_hidden_states.config import ENABLE_HINT, HiddenStatesConfig
from vllm_hidden_states.request import (
    POSITIONS,
    HiddenStatesExtractRequest,
    HiddenStatesSpec,
    extract_id_for,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest

logger = init_logger(__name__)


def resolve_request(
    vllm_config: "VllmConfig",
    params: "SamplingParams | None",
    prompt_len: int,
    has_mm: bool,
    has_prompt_embeds: bool,
    resumable: bool = False,
) -> HiddenStatesSpec | None:
    """Validate a request's hidden-state fields; the spec, or None if not asked.

    Raises ``VLLMValidationError`` (an HTTP 400 on the server) naming what is
    allowed. May lower ``params.max_tokens`` by one: the final token's state
    needs one more position, so prompt + output must stay below max_model_len.
    """
    from vllm.exceptions import VLLMValidationError

    if params is None:
        return None
    if not params.return_hidden_states:
        if params.hidden_states_layers is not None:
            raise VLLMValidationError(
                "hidden_states_layers was given but return_hidden_states is not "
                "set; pass return_hidden_states=True",
                parameter="hidden_states_layers",
            )
        return None

    cfg = HiddenStatesConfig.from_vllm_config(vllm_config)
    if cfg is None:
        raise VLLMValidationError(
            f"hidden states are not enabled on this engine; {ENABLE_HINT}",
            parameter="return_hidden_states",
        )
    if resumable:
        raise VLLMValidationError(
            "return_hidden_states is not supported on streaming-input "
            "(resumable) requests yet",
            parameter="return_hidden_states",
        )
    if has_mm or has_prompt_embeds:
        raise VLLMValidationError(
            "hidden states for multimodal or prompt-embeds prompts are not "
            "supported yet; send token or text prompts",
            parameter="return_hidden_states",
        )
    positions = params.hidden_states_positions
    if positions not in POSITIONS:
        raise VLLMValidationError(
            f"hidden_states_positions must be one of {list(POSITIONS)}, "
            f"got {positions!r}",
            parameter="hidden_states_positions",
        )
    layers = params.hidden_states_layers
    if layers is None:
        layers = [-1]
    if not isinstance(layers, (list, tuple)) or not layers:
        raise VLLMValidationError(
            f"hidden_states_layers must be a non-empty list of integers, "
            f"got {layers!r}",
            parameter="hidden_states_layers",
        )
    try:
        abs_layers = [cfg.resolve(k) for k in layers]
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter="hidden_states_layers") from None

    if positions == "prompt":
        # Captured during the request's own prefill, so every prompt position
        # must be computed there: cached blocks hold KV, not hidden states.
        params.skip_reading_prefix_cache = True
        return HiddenStatesSpec(
            layers=[int(k) for k in layers], abs_layers=abs_layers, positions=positions
        )

    max_model_len = vllm_config.model_config.max_model_len
    room = max_model_len - 1 - prompt_len
    if room < 1:
        raise VLLMValidationError(
            f"the prompt has {prompt_len} tokens; with return_hidden_states the "
            f"prompt plus at least one generated token must stay below "
            f"max_model_len={max_model_len}",
            parameter="return_hidden_states",
        )
    if params.max_tokens is not None and params.max_tokens > room:
        # The final token's state is computed by a prefill over prompt + output,
        # which needs that token's position to exist: cap output one short of
        # max_model_len rather than return a state for the wrong token.
        params.max_tokens = room
    return HiddenStatesSpec(
        layers=[int(k) for k in layers], abs_layers=abs_layers, positions=positions
    )


@dataclass
class TrackedRequest:
    """Per-request hidden-state state kept on the OutputProcessor's RequestState."""

    spec: HiddenStatesSpec
    cache_salt: str | None
    priority: int
    states: dict[int, torch.Tensor] | None = None
    error: str | None = None


@dataclass
class HeldOutput:
    """A finished request's final output, held until its hidden states arrive.

    ``args`` are the arguments the OutputProcessor would have emitted the output
    with; it emits them unchanged on release.
    """

    req_state: Any
    engine_core_output: "EngineCoreOutput"
    args: tuple


class HiddenStatesDispatcher:
    """Holds finished outputs and produces HIDDEN_STATES_EXTRACT requests.

    One per OutputProcessor. All methods run on the output-processing path, so
    everything is keyed by dict lookups; requests that did not ask never reach
    this class (the OutputProcessor checks ``req_state.hidden_states``).
    """

    def __init__(self) -> None:
        self._held: dict[str, HeldOutput] = {}  # extract id -> held output
        self._outgoing: list[HiddenStatesExtractRequest] = []

    @staticmethod
    def track(request: "EngineCoreRequest") -> TrackedRequest | None:
        spec = request.return_hidden_states
        if spec is None:
            return None
        return TrackedRequest(spec, request.cache_salt, request.priority)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def on_output(self, req_state: Any, engine_core_output: "EngineCoreOutput",
                  *args) -> bool:
        """Per output of a request that asked; True if its output is now held.

        ``args`` are the OutputProcessor's emit arguments (``args[2]`` is the
        finish reason). ``"prompt"`` states arrive on the output of the step
        that completed the prefill and are kept until the request finishes;
        ``"last"``/``"all"`` finish by holding the output and queueing an extract.
        """
        tracked: TrackedRequest = req_state.hidden_states
        if engine_core_output.hidden_states is not None:
            tracked.states = self._by_key(tracked, engine_core_output.hidden_states)
        if args[2] is None or tracked.spec.positions == "prompt":
            return False
        self.hold(req_state, engine_core_output, *args)
        return True

    @staticmethod
    def _by_key(tracked: TrackedRequest, data: torch.Tensor) -> dict[int, torch.Tensor]:
        """``[num_distinct_layers, positions, hidden]`` -> {layer as requested: rows}."""
        extracted = sorted(set(tracked.spec.abs_layers))
        row = {k: i for i, k in enumerate(extracted)}
        return {key: data[row[k]]
                for key, k in zip(tracked.spec.layers, tracked.spec.abs_layers)}

    def hold(self, req_state: Any, engine_core_output: "EngineCoreOutput", *args):
        """Hold the final output of ``req_state`` and queue its extract."""
        tracked: TrackedRequest = req_state.hidden_states
        spec = tracked.spec
        assert req_state.detokenizer is not None
        # The sequence as vLLM reports it: prompt + output after stop trimming.
        token_ids = list(req_state.prompt_token_ids) + list(
            req_state.detokenizer.output_token_ids
        )
        extract_id = extract_id_for(req_state.request_id)
        self._held[extract_id] = HeldOutput(req_state, engine_core_output, args)
        self._outgoing.append(
            HiddenStatesExtractRequest(
                request_id=extract_id,
                token_ids=token_ids,
                layers=sorted(set(spec.abs_layers)),
                positions=spec.positions,
                arrival_time=time.time(),
                lora_request=req_state.lora_request,
                cache_salt=tracked.cache_salt,
                priority=tracked.priority,
            )
        )

    def take_extracts(self) -> list[HiddenStatesExtractRequest]:
        """The extracts queued since the last call, for the engine loop to send."""
        if not self._outgoing:
            return []
        out, self._outgoing = self._outgoing, []
        return out

    def release(self, engine_core_output: "EngineCoreOutput") -> HeldOutput | None:
        """Attach an extract's states to its request; the held output, if any.

        Returns None for outputs that belong to no held request (e.g. an
        extract whose request was aborted meanwhile).
        """
        if not engine_core_output.finished:
            return None  # extracts emit exactly one (final) output
        held = self._held.pop(engine_core_output.request_id, None)
        if held is None:
            return None
        tracked: TrackedRequest = held.req_state.hidden_states
        data = engine_core_output.hidden_states
        if data is None or data.shape[0] != len(set(tracked.spec.abs_layers)):
            tracked.error = (
                "hidden-state extraction failed in the engine "
                f"(finish_reason={engine_core_output.finish_reason})"
            )
            logger.error(
                "Request %s: %s", held.req_state.request_id, tracked.error
            )
        else:
            tracked.states = self._by_key(tracked, data)
        return held

    def abort(self, req_state: Any) -> str | None:
        """Forget a held request; the extract id to abort in the engine, if any."""
        extract_id = extract_id_for(req_state.request_id)
        if self._held.pop(extract_id, None) is None:
            return None
        return extract_id
