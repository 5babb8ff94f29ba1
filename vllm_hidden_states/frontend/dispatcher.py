# SPDX-License-Identifier: Apache-2.0
"""Hold finished outputs, dispatch HIDDEN_STATES_EXTRACT requests, release.

Runs in the front-end process, inside vLLM's OutputProcessor (patch 0004):

1. ``OutputProcessor.add_request``: a request whose ``EngineCoreRequest``
   carries ``return_hidden_states`` gets a :class:`HiddenStatesTracker` on its
   ``RequestState.hidden_states_tracker``; the OutputProcessor's
   :class:`ExtractDispatcher` is made then (``ExtractDispatcher.of``).
2. Each output of such a request passes :meth:`ExtractDispatcher.on_output`.
   "prompt" states arrive on the output of the step that completed the
   prefill and are kept until the request finishes. Inline "all" rows arrive
   with every output (the positions its forwards computed since the last one)
   and are appended. When a "last"/"all" request finishes (EOS, stop token,
   stop string, length), its final :class:`OutputEmission` is *held* instead
   of emitted, and a :class:`HiddenStatesExtractRequest` over prompt + output
   token ids is queued: "last" (also for inline "all": only the final token is
   missing) or "all" (without inline capture: everything recomputed).
   Only the front-end knows the final token list (stop strings are matched and
   trimmed here), so only it can say which token is "last".
3. The engine loop (``LLMEngine.step`` / the ``AsyncLLM`` output handler)
   sends the queued extracts (:meth:`ExtractDispatcher.take_extracts`) as a
   ``HIDDEN_STATES_EXTRACT`` core request.
4. The extract's ``EngineCoreOutput`` (id ``<request id>-hs``, which has no
   ``RequestState``) reaches :meth:`ExtractDispatcher.release`: its
   ``hidden_states`` tensor goes onto the tracker, and the held emission goes
   back to the OutputProcessor, which emits it unchanged. That output's
   ``CompletionOutput.hidden_states`` is then ``{layer as requested: rows}``.
5. With ``RequestOutputKind.DELTA``, inline "all" outputs each carry the rows
   that arrived since the previous output (:meth:`HiddenStatesTracker.for_output`);
   concatenated, they are the final result of the same request.

SAE features (``sae_top_k`` on the spec) travel beside the rows: ``(ids,
values)`` from ``EngineCoreOutput.sae_feature_ids`` / ``sae_feature_values``,
accumulated, cut and delta-emitted exactly like them; patch 0004 fills
``CompletionOutput.sae_features`` from
:meth:`HiddenStatesTracker.sae_features_for_output` as it fills
``hidden_states`` from :meth:`HiddenStatesTracker.for_output`.

Requests that did not ask never reach this module.
"""

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.v1.engine import FinishReason
from vllm_hidden_states.wire import (
    HiddenStatesExtractRequest,
    HiddenStatesSpec,
    distinct_layers,
    extract_id_for,
)

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import (
        OutputEmission,
        OutputProcessor,
        RequestState,
    )

logger = init_logger(__name__)


# (ids int32 [positions, k], values float32 [positions, k])
Features = tuple[torch.Tensor, torch.Tensor]


def _cat_features(parts: list[Features]) -> Features:
    if len(parts) == 1:
        return parts[0]
    return torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])


def features_of(engine_core_output: "EngineCoreOutput") -> Features | None:
    ids = engine_core_output.sae_feature_ids
    return None if ids is None else (ids, engine_core_output.sae_feature_values)


@dataclass
class HiddenStatesTracker:
    """One request's hidden-state bookkeeping, on ``RequestState.hidden_states_tracker``.

    Attributes:
        spec: what the request asked for.
        cache_salt, priority: copied onto its extract.
        chunks: inline "all": ``[num_distinct_layers, rows, hidden]`` tensors
            in position order, as they arrived.
        complete: every row the request gets, ``[num_distinct_layers,
            positions, hidden]``, once known.
        error: why the capture failed, if it did; the request then finishes
            with ``finish_reason`` "error" and this message in its
            ``stop_reason`` (HTTP: a 500).
        feature_chunks, complete_features: the same for SAE features
            (``sae_top_k``): ``(ids, values)`` pairs ``[rows, k]``.
    """

    spec: HiddenStatesSpec
    cache_salt: str | None
    priority: int
    chunks: list[torch.Tensor] = field(default_factory=list)
    complete: torch.Tensor | None = None
    error: str | None = None
    _emitted_chunks: int = 0  # DELTA: chunks already given to outputs
    _emitted_rows: int = 0
    feature_chunks: list[Features] = field(default_factory=list)
    complete_features: Features | None = None
    _emitted_feature_chunks: int = 0
    _emitted_feature_rows: int = 0

    def fail(self, reason: str) -> None:
        """The capture failed: the request finishes with an error that says
        ``reason`` (``finish_reason`` "error", ``RequestOutput.error``)."""
        if self.error is None:
            self.error = reason

    @property
    def has_everything(self) -> bool:
        """Every kind of data the request asked for is complete."""
        return (not self.spec.layers or self.complete is not None) and (
            not self.spec.sae_top_k or self.complete_features is not None
        )

    @property
    def states(self) -> dict[int, torch.Tensor] | None:
        """``{layer as requested: [positions, hidden_size]}`` once complete."""
        return None if self.complete is None else self._keyed(self.complete)

    def _keyed(self, data: torch.Tensor) -> dict[int, torch.Tensor]:
        row = {k: i for i, k in enumerate(distinct_layers(self.spec))}
        return {key: data[row[k]] for key, k in zip(self.spec.layers, self.spec.abs_layers)}

    def receive(self, data: torch.Tensor | None, features: Features | None = None) -> None:
        """Rows (and SAE features) that rode on one of the request's own outputs."""
        if self.spec.inline:
            if data is not None:
                self.chunks.append(data)
            if features is not None:
                self.feature_chunks.append(features)
        else:
            self.complete = data  # "prompt": every prompt position at once
            self.complete_features = features

    def finish(
        self, data: torch.Tensor | None, num_tokens: int, features: Features | None = None
    ) -> None:
        """The extract's rows: everything, or (inline) the final token's row,
        appended to the inline rows cut to ``num_tokens - 1`` positions (a
        stop string may have trimmed the output after they were computed)."""
        if not self.spec.inline:
            self.complete = data
            self.complete_features = features
            return
        if features is not None:
            ids, values = (
                _cat_features(self.feature_chunks)
                if self.feature_chunks
                else (features[0][:0], features[1][:0])
            )
            if ids.shape[0] < num_tokens - 1:
                self.fail(
                    f"{ids.shape[0]} inline SAE positions arrived for a "
                    f"sequence of {num_tokens} tokens"
                )
                return
            self.complete_features = (
                torch.cat([ids[: num_tokens - 1], features[0]]),
                torch.cat([values[: num_tokens - 1], features[1]]),
            )
        if data is None:
            return
        earlier = torch.cat(self.chunks, dim=1) if self.chunks else data[:, :0]
        if earlier.shape[1] < num_tokens - 1:
            self.fail(
                f"{earlier.shape[1]} inline positions arrived for a sequence of {num_tokens} tokens"
            )
            return
        self.complete = torch.cat([earlier[:, : num_tokens - 1], data], dim=1)

    def for_output(self, finished: bool, delta: bool):
        """``CompletionOutput.hidden_states`` of the output being made.

        Cumulative and final-only outputs: everything, on the final output.
        DELTA outputs of inline "all": the rows that arrived since the previous
        output (the final one: the rest, final token included). None for a
        features-only request (``sae_top_k`` without layers).
        """
        return self._states_for_output(finished, delta) if self.spec.layers else None

    def sae_features_for_output(self, finished: bool, delta: bool) -> dict[str, Any] | None:
        """``CompletionOutput.sae_features`` of the output being made, the
        same way: ``{"layer": absolute layer, "ids": int32 [positions, k],
        "values": float32 [positions, k]}``, or None (also for requests
        without ``sae_top_k``)."""
        if not self.spec.sae_top_k:
            return None
        features = self._features_for_output(finished, delta)
        if features is None:
            return None
        return {"layer": self.spec.sae_layer, "ids": features[0], "values": features[1]}

    def _features_for_output(self, finished: bool, delta: bool) -> Features | None:
        if not delta or not self.spec.inline:
            return self.complete_features if finished else None
        if finished:
            if self.complete_features is None:
                return None
            start = self._emitted_feature_rows
            new = (self.complete_features[0][start:], self.complete_features[1][start:])
        else:
            pending = self.feature_chunks[self._emitted_feature_chunks :]
            if not pending:
                return None
            new = _cat_features(pending)
            self._emitted_feature_chunks = len(self.feature_chunks)
        self._emitted_feature_rows += new[0].shape[0]
        return new

    def _states_for_output(self, finished: bool, delta: bool):
        if not delta or not self.spec.inline:
            return self.states if finished else None
        if finished:
            if self.complete is None:
                return None
            new = self.complete[:, self._emitted_rows :]
        else:
            pending = self.chunks[self._emitted_chunks :]
            if not pending:
                return None
            new = torch.cat(pending, dim=1) if len(pending) > 1 else pending[0]
            self._emitted_chunks = len(self.chunks)
        self._emitted_rows += new.shape[1]
        return self._keyed(new)


def merge_delta(completion: Any, following: Any) -> None:
    """``RequestOutput.add`` (patch 0001), DELTA outputs merged because the
    consumer had not taken the first yet (vLLM's ``RequestOutputCollector``):
    append ``following``'s rows and SAE features to ``completion``'s, so a
    merged output still carries every position since the previous one."""
    states = following.hidden_states
    if states is not None:
        if completion.hidden_states is None:
            completion.hidden_states = states
        else:
            completion.hidden_states = {
                key: torch.cat([rows, states[key]])
                for key, rows in completion.hidden_states.items()
            }
    features = following.sae_features
    if features is not None:
        if completion.sae_features is None:
            completion.sae_features = features
        else:
            ours = completion.sae_features
            completion.sae_features = {
                "layer": ours["layer"],
                "ids": torch.cat([ours["ids"], features["ids"]]),
                "values": torch.cat([ours["values"], features["values"]]),
            }


# RequestOutput.error.code of a request whose hidden states could not be captured.
CAPTURE_FAILED = "hidden_states_capture_failed"


def failed_emission(emission: "OutputEmission", reason: str) -> "OutputEmission":
    """``emission`` turned into a failure the caller sees instead of
    ``hidden_states=None``: ``finish_reason`` "error" (vLLM's request-level
    error, which its OpenAI server answers with a 500) and ``stop_reason``
    saying why (``"hidden_states_capture_failed: <reason>"``; vLLM's
    ``RequestOutput`` has no error field, only its pooling output does)."""
    from vllm.outputs import RequestError

    return emission._replace(
        finish_reason=FinishReason.ERROR,
        stop_reason=f"{CAPTURE_FAILED}: {reason}",
        request_error=RequestError(code=CAPTURE_FAILED, message=reason),
    )


@dataclass
class HeldOutput:
    """A finished request's final output, held until its hidden states arrive."""

    req_state: "RequestState"
    engine_core_output: "EngineCoreOutput"
    emission: "OutputEmission"
    num_tokens: int  # prompt + output after stop trimming


class ExtractDispatcher:
    """Holds finished outputs and produces HIDDEN_STATES_EXTRACT requests.

    One per OutputProcessor (``OutputProcessor.extract_dispatcher``). All
    methods run on the output-processing path and cost dict lookups.
    """

    def __init__(self) -> None:
        self._held: dict[str, HeldOutput] = {}  # extract id -> held output
        self._outgoing: list[HiddenStatesExtractRequest] = []

    @classmethod
    def of(cls, processor: "OutputProcessor") -> "ExtractDispatcher":
        """The processor's dispatcher, made on first use."""
        if processor.extract_dispatcher is None:
            processor.extract_dispatcher = cls()
        return processor.extract_dispatcher

    @staticmethod
    def track(request: "EngineCoreRequest") -> HiddenStatesTracker:
        """The tracker of a request that asked (``return_hidden_states`` set)."""
        assert request.return_hidden_states is not None
        return HiddenStatesTracker(
            request.return_hidden_states, request.cache_salt, request.priority
        )

    @property
    def num_held(self) -> int:
        return len(self._held)

    def on_output(
        self,
        req_state: "RequestState",
        engine_core_output: "EngineCoreOutput",
        emission: "OutputEmission",
    ) -> "OutputEmission | None":
        """Per output of a request that asked: the emission to emit now, or
        None when it is held until the request's extract returns.

        A finished "prompt" request whose prefill delivered no rows is emitted
        as a failure (:func:`failed_emission`), never with a silent None.
        """
        tracker: HiddenStatesTracker = req_state.hidden_states_tracker
        if engine_core_output.hidden_states is not None or (
            engine_core_output.sae_feature_ids is not None
        ):
            tracker.receive(engine_core_output.hidden_states, features_of(engine_core_output))
        if emission.finish_reason is None:
            return emission
        if tracker.spec.positions == "prompt":
            if emission.finish_reason != FinishReason.ABORT and not tracker.has_everything:
                tracker.fail("the engine delivered no prompt rows for this request")
                logger.error("Request %s: %s", req_state.request_id, tracker.error)
                return failed_emission(emission, tracker.error)
            return emission
        self._hold(req_state, engine_core_output, emission)
        return None

    def _hold(
        self,
        req_state: "RequestState",
        engine_core_output: "EngineCoreOutput",
        emission: "OutputEmission",
    ) -> None:
        tracker: HiddenStatesTracker = req_state.hidden_states_tracker
        assert req_state.detokenizer is not None
        # The sequence as vLLM reports it: prompt + output after stop trimming.
        token_ids = list(req_state.prompt_token_ids) + list(req_state.detokenizer.output_token_ids)
        extract_id = extract_id_for(req_state.request_id)
        self._held[extract_id] = HeldOutput(req_state, engine_core_output, emission, len(token_ids))
        self._outgoing.append(
            HiddenStatesExtractRequest(
                request_id=extract_id,
                token_ids=token_ids,
                layers=distinct_layers(tracker.spec),
                # Inline "all" misses only the final token.
                positions="last" if tracker.spec.inline else tracker.spec.positions,
                arrival_time=time.time(),
                lora_request=req_state.lora_request,
                cache_salt=tracker.cache_salt,
                priority=tracker.priority,
                sae_top_k=tracker.spec.sae_top_k,
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
        if not self._held or not engine_core_output.finished:
            return None  # extracts emit exactly one (final) output
        held = self._held.pop(engine_core_output.request_id, None)
        if held is None:
            return None
        tracker: HiddenStatesTracker = held.req_state.hidden_states_tracker
        data = engine_core_output.hidden_states
        features = features_of(engine_core_output)
        if (
            tracker.spec.layers
            and (data is None or data.shape[0] != len(distinct_layers(tracker.spec)))
        ) or (tracker.spec.sae_top_k and features is None):
            reason = engine_core_output.stop_reason
            tracker.fail(
                "hidden-state extraction failed in the engine "
                f"(finish_reason={engine_core_output.finish_reason}"
                + (f": {reason}" if isinstance(reason, str) else "")
                + ")"
            )
        else:
            tracker.finish(data, held.num_tokens, features)
        if tracker.error is not None:
            logger.error("Request %s: %s", held.req_state.request_id, tracker.error)
            held.emission = failed_emission(held.emission, tracker.error)
        return held

    def abort(self, req_state: Any) -> str | None:
        """Forget a held request; the extract id to abort in the engine, if any."""
        extract_id = extract_id_for(req_state.request_id)
        if self._held.pop(extract_id, None) is None:
            return None
        return extract_id
