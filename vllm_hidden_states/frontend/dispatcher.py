# SPDX-License-Identifier: Apache-2.0
"""Hold finished outputs, dispatch HIDDEN_STATES_EXTRACT requests, release.

Runs in the front-end process, called from vLLM's OutputProcessor (patch 0004,
one-line call-outs): ``add_request`` gives a request that asked a
:class:`HiddenStatesTracker`; :meth:`ExtractDispatcher.takes_output` takes a
finished output that still waits for its final token's states, and queues
its extract unless the engine queued it; :meth:`ExtractDispatcher.take_extracts`
hands the queued extracts to the engine loop; :meth:`ExtractDispatcher.release`
receives the extract's rows and emits the held output. The story (hold,
dispatch, release, DELTA rows) is told in docs/architecture.md, steps 6-12.

Requests that did not ask never reach this module.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vllm.logger import init_logger
from vllm.v1.engine import FinishReason
from vllm_hidden_states.contract import Intervention, OpResults, ProbeFiring, as_interventions
from vllm_hidden_states.frontend.firings import record_firings
from vllm_hidden_states.probe_actions import STEER, steer_action_of, steered_from
from vllm_hidden_states.wire import (
    CapturedRows,
    HiddenStatesExtractRequest,
    HiddenStatesSpec,
    cat_rows,
    distinct_layers,
    ends_before_final_token,
    extract_for,
    extract_id_for,
    has_rows,
    num_positions,
    on_firings,
    result_keys,
    slice_rows,
)

if TYPE_CHECKING:
    from vllm.outputs import PoolingRequestOutput, RequestError, RequestOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState
    from vllm.v1.metrics.stats import IterationStats

logger = init_logger(__name__)


# ``output_fields`` of an output that carries nothing of ours (vLLM's
# defaults, None, stand); unpacked by the caller, never changed.
_NO_FIELDS: dict[str, Any] = {}


@dataclass
class HiddenStatesTracker:
    """One request's hidden-state bookkeeping, on ``RequestState.hidden_states_tracker``.

    Attributes:
        spec: what the request asked for.
        cache_salt, priority: copied onto its extract.
        steering: the request's steering (wire form), replayed by its extract.
        mm_positions: a multimodal prompt's ``{modality: positions whose rows
            are that modality's embeddings}`` (:func:`mm_positions_of`), None
            for a text prompt; on every output that carries rows.
        chunks: inline "all": the :class:`CapturedRows` that rode on the
            request's own outputs, in position order.
        complete: every position the request gets, once known.
        error: why the capture failed, if it did; the request then finishes
            with ``finish_reason`` "error" and this message in its
            ``stop_reason`` (HTTP: a 500).
        request_id: the engine request's id (for the store's firing rows).
        firings: its probe actions' firings as the engine reported them.
    """

    spec: HiddenStatesSpec
    cache_salt: str | None
    priority: int
    steering: list[Intervention] | None = None
    mm_positions: dict[str, list[int]] | None = None
    chunks: list[CapturedRows] = field(default_factory=list)
    complete: CapturedRows | None = None
    error: str | None = None
    request_id: str = ""
    firings: list[ProbeFiring] = field(default_factory=list)
    _emitted_firings: int = 0
    _steered: set[int] = field(default_factory=set)  # steer actions that fired
    _emitted_chunks: int = 0  # DELTA: chunks already given to outputs
    _emitted_rows: int = 0

    def fail(self, reason: str) -> None:
        """The capture failed: the request finishes with an error that says
        ``reason`` (``finish_reason`` "error", ``RequestOutput.error``)."""
        if self.error is None:
            self.error = reason

    @property
    def has_everything(self) -> bool:
        """Every kind of data the request asked for is complete."""
        return self.complete is not None

    @property
    def states(self) -> dict[int | str, torch.Tensor] | None:
        """``{layer or point as requested: [positions, hidden_size]}`` once complete."""
        return None if self.complete is None else self._keyed(self.complete.hidden)

    def _keyed(self, data: torch.Tensor | None) -> dict[int | str, torch.Tensor] | None:
        if data is None:
            return None
        row = {k: i for i, k in enumerate(distinct_layers(self.spec))}
        return {key: data[row[k]] for key, k in zip(result_keys(self.spec), self.spec.abs_layers)}

    def problem_with(self, rows: CapturedRows | None) -> str | None:
        """What ``rows`` lacks of what the request asked for, or None."""
        if rows is None:
            return "no rows"
        if self.spec.abs_layers and (
            rows.hidden is None or rows.hidden.shape[0] != len(distinct_layers(self.spec))
        ):
            return "no hidden states for the layers asked"
        if self.spec.pattern_ids and (
            rows.patterns is None or rows.patterns.shape[0] != len(self.spec.pattern_ids)
        ):
            return "no attention patterns"
        if self.spec.neuron_ids and (
            rows.neurons is None or len(rows.neurons) != len(self.spec.neuron_ids)
        ):
            return "no MLP neurons or heads' outputs"
        for a, t, heads in zip(self.spec.neurons, rows.neurons or (), self.spec.neuron_heads):
            if heads and t.shape[-1] % heads:
                return f"{a}: {t.shape[-1]} values per row, not a whole number of {heads} heads"
        if self.spec.sae_top_k and rows.sae_ids is None:
            return "no SAE features"
        if self.spec.probes and rows.probe_scores is None:
            return "no probe scores"
        return None

    def _steer_from(self, firings: list[ProbeFiring]) -> None:
        """Steer actions that fired: the steering an extract replays is on
        from the position after each firing (as the worker's was)."""
        if not self.steering:
            return
        fired: dict[int, int] = {}
        for firing in firings:
            if firing.then != STEER:
                continue
            i = steer_action_of(self.spec.probe_actions, firing, set(fired) | self._steered)
            if i is not None:
                fired[i] = firing.position
        if fired:
            self._steered |= set(fired)
            self.steering = steered_from(self.steering, fired)

    def receive(self, rows: CapturedRows) -> None:
        """Rows that rode on one of the request's own outputs (and what its
        ops decided in that step)."""
        if rows.op_results is not None:
            self.firings.extend(rows.op_results.firings)  # recorded by hand_out_captured
            self._steer_from(rows.op_results.firings)
            if not has_rows(rows):
                return
        if self.spec.returns == "none":
            return  # server monitors only: their scores are not returned
        if self.spec.inline:
            self.chunks.append(rows)
        else:
            self.complete = rows  # "prompt": every prompt position at once

    def _inline_rows_owed(self, num_tokens: int) -> int:
        """Inline rows the request is owed before its final token: positions
        ``spec.start .. min(spec.end, num_tokens - 1) - 1``."""
        stop = num_tokens - 1 if self.spec.end is None else min(self.spec.end, num_tokens - 1)
        return max(stop - self.spec.start, 0)

    def needs_final_token(self, num_tokens: int) -> bool:
        """Whether the final token (position ``num_tokens - 1``, which only an
        extract computes) is in what the request asked. Inline windows that
        end before it complete from their inline rows alone."""
        if not ends_before_final_token(self.spec, num_tokens):
            return True
        if self.spec.returns == "none":
            return False  # server monitors only: nothing to return
        return not self.chunks  # no rows to cut from: the extract gives the shape

    def finish_inline(self, num_tokens: int) -> None:
        """An inline window that ends before the final token: its rows, cut to
        the window (a stop string may have trimmed the output)."""
        self._take_inline(None, num_tokens)

    def finish(self, rows: CapturedRows, num_tokens: int) -> None:
        """The extract's rows: everything (cut to the window, if any), or
        (inline) the final token's row, appended to the inline rows cut to
        the positions before it (a stop string may have trimmed the output
        after they were computed)."""
        if self.spec.pattern_ids:
            self.complete = rows  # the extract cut every row to the window
            return
        if not self.spec.inline:
            stop = self.spec.end if self.spec.end is None else min(self.spec.end, num_tokens)
            start = min(self.spec.start, num_tokens)
            self.complete = rows if (start, stop) == (0, None) else slice_rows(rows, start, stop)
            return
        self._take_inline(rows, num_tokens)

    def _take_inline(self, final: CapturedRows | None, num_tokens: int) -> None:
        if self.spec.returns == "none":
            self.complete = CapturedRows()
            return
        owed = self._inline_rows_owed(num_tokens)
        if self.chunks:
            earlier = cat_rows(self.chunks)
        else:
            assert final is not None  # needs_final_token without chunks
            earlier = slice_rows(final, 0, 0)
        if num_positions(earlier) < owed:
            self.fail(
                f"{num_positions(earlier)} inline positions arrived for a sequence "
                f"of {num_tokens} tokens ({owed} owed from position {self.spec.start})"
            )
            return
        parts = [slice_rows(earlier, 0, owed)]
        in_window = self.spec.end is None or self.spec.end >= num_tokens
        if final is not None and in_window and self.spec.start <= num_tokens - 1:
            parts.append(final)
        self.complete = cat_rows(parts)
        if self.spec.returns == "last":
            # A "last" request watched by monitors: its final position only.
            self.complete = slice_rows(self.complete, num_positions(self.complete) - 1)

    def output_fields(self, finished: bool, delta: bool) -> dict[str, Any]:
        """``CompletionOutput``'s ``hidden_states``, ``sae_features`` and
        ``probe_scores`` for the output being made (patch 0004).

        Cumulative and final-only outputs: everything, on the final output.
        DELTA outputs of inline "all": the rows that arrived since the previous
        output (the final one: the rest, final token included).
        ``hidden_states``: ``{layer as requested: [positions, hidden]}``, None
        for a features-only request; ``sae_features``: ``{"layer": absolute
        layer (or "point": address, an SAE at a capture point), "ids": int32
        [positions, k], "values": float32 [positions, k]}``,
        None without ``sae_top_k``; ``probe_scores``: ``{probe name: float32
        [positions, k]}`` (views of one tensor), None without probes.
        """
        if not finished and not delta:
            return _NO_FIELDS  # cumulative and final-only: all on the final output
        ops = self._op_results_for_output(finished, delta)
        rows = self._rows_for_output(finished, delta)
        if rows is None:
            return {
                "hidden_states": None,
                "sae_features": None,
                "probe_scores": None,
                "op_results": ops,
            }
        marked = {"mm_positions": self.mm_positions} if self.mm_positions else {}
        features = None
        if self.spec.sae_top_k and rows.sae_ids is not None:
            # Where the SAE reads: its point's address, or its HF layer.
            reads = self.spec.sae_point or self.spec.sae_layer
            features = {
                "point" if self.spec.sae_point else "layer": reads,
                "ids": rows.sae_ids,
                "values": rows.sae_values,
            }
        states = self._keyed(rows.hidden) if self.spec.abs_layers else None
        if self.spec.neurons and rows.neurons is not None:
            # {address: rows} after the rows' keys: mlp_post [positions,
            # intermediate_size]; attn_z, q [positions, heads, head_dim];
            # k, v [positions, kv_heads, head_dim].
            heads = self.spec.neuron_heads or [0] * len(self.spec.neurons)
            wide: dict[int | str, torch.Tensor] = {
                a: t.unflatten(-1, (h, -1)) if h else t
                for a, t, h in zip(self.spec.neurons, rows.neurons, heads)
            }
            states = {**(states or {}), **wide}
        if self.spec.patterns and rows.patterns is not None:
            # {address: [heads, queries, keys]}, beside the rows' keys.
            states = {**(states or {}), **dict(zip(self.spec.patterns, rows.patterns))}
        scores = None
        returned = self.spec.probes_returned
        names = self.spec.probes if returned < 0 else self.spec.probes[:returned]
        if names and rows.probe_scores is not None:
            # The server's monitors' scores stay here: their columns come last.
            scores = dict(zip(names, rows.probe_scores.split(self.spec.probe_widths, dim=1)))
        return {
            "hidden_states": states,
            "sae_features": features,
            "probe_scores": scores,
            "op_results": ops,
            **marked,
        }

    def _op_results_for_output(self, finished: bool, delta: bool) -> OpResults | None:
        """The firings for the output being made: DELTA, those since the
        previous output; else all of them, on the final output. None when
        there are none to give."""
        if not delta and not finished:
            return None
        new = self.firings[self._emitted_firings :] if delta else self.firings
        self._emitted_firings = len(self.firings)
        return OpResults(firings=list(new)) if new else None

    def _rows_for_output(self, finished: bool, delta: bool) -> CapturedRows | None:
        if not delta or not self.spec.inline or self.spec.returns:
            return self.complete if finished else None
        if finished:
            if self.complete is None:
                return None
            new = slice_rows(self.complete, self._emitted_rows)
        else:
            pending = self.chunks[self._emitted_chunks :]
            if not pending:
                return None
            new = cat_rows(pending)
            self._emitted_chunks = len(self.chunks)
        self._emitted_rows += num_positions(new)
        return new


def _cat_output_field(ours: dict | None, theirs: dict | None) -> dict | None:
    """One ``CompletionOutput`` capture field (``hidden_states``,
    ``sae_features`` or ``probe_scores``) of two consecutive DELTA outputs joined: tensors
    concatenated along positions, other entries (``"layer"``) kept."""
    if theirs is None:
        return ours
    if ours is None:
        return theirs
    return {
        key: torch.cat([value, theirs[key]]) if isinstance(value, torch.Tensor) else value
        for key, value in ours.items()
    }


def merge_delta(completion: Any, following: Any) -> None:
    """``RequestOutput.add`` (patch 0001), DELTA outputs merged because the
    consumer had not taken the first yet (vLLM's ``RequestOutputCollector``):
    append ``following``'s rows to ``completion``'s, so a merged output still
    carries every position since the previous one."""
    completion.hidden_states = _cat_output_field(completion.hidden_states, following.hidden_states)
    completion.sae_features = _cat_output_field(completion.sae_features, following.sae_features)
    completion.probe_scores = _cat_output_field(completion.probe_scores, following.probe_scores)
    completion.mm_positions = completion.mm_positions or following.mm_positions
    if following.op_results is not None:
        firings = [*(completion.op_results.firings if completion.op_results else [])]
        completion.op_results = OpResults(firings=[*firings, *following.op_results.firings])


def mm_positions_of(mm_features: list[Any] | None) -> dict[str, list[int]] | None:
    """``{modality: positions}`` of a prompt's multimodal embeddings, from
    vLLM's placeholders (``MultiModalFeatureSpec.mm_position``: an offset, a
    length and, where only some of the range are embeddings (Pixtral's
    break tokens), its ``is_embed`` mask); None for a text prompt."""
    if not mm_features:
        return None
    found: dict[str, list[int]] = {}
    for feature in mm_features:
        where = feature.mm_position
        positions = list(range(where.offset, where.offset + where.length))
        if where.is_embed is not None:
            positions = [p for p, embed in zip(positions, where.is_embed.tolist()) if embed]
        found.setdefault(feature.modality, []).extend(positions)
    return {modality: sorted(positions) for modality, positions in found.items()}


# RequestOutput.error.code of a request whose hidden states could not be captured.
CAPTURE_FAILED = "hidden_states_capture_failed"


class OutputEmission(NamedTuple):
    """What ``process_outputs`` hands ``RequestState.make_request_output`` for
    one ``EngineCoreOutput`` (its locals after steps 1-3, in vLLM's order)."""

    new_token_ids: list[int]
    pooling_output: torch.Tensor | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    kv_transfer_params: dict[str, Any] | None
    ec_transfer_params: dict[str, Any] | None
    request_error: "RequestError | None"


# Where ``finish_reason`` is in the fields ``takes_output`` is given (read
# before an OutputEmission is made: most outputs are not final).
_FINISH_REASON = OutputEmission._fields.index("finish_reason")


def failed_emission(emission: OutputEmission, reason: str) -> OutputEmission:
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


def _sequence(req_state: "RequestState") -> list[int]:
    """The sequence as vLLM reports it: prompt + output after stop trimming."""
    assert req_state.detokenizer is not None
    return list(req_state.prompt_token_ids) + list(req_state.detokenizer.output_token_ids)


@dataclass
class HeldOutput:
    """A finished request's final output, held until its hidden states arrive."""

    req_state: "RequestState"
    engine_core_output: "EngineCoreOutput"
    emission: OutputEmission
    num_tokens: int  # prompt + output after stop trimming


class ExtractDispatcher:
    """Holds finished outputs and produces HIDDEN_STATES_EXTRACT requests.

    One per OutputProcessor (``OutputProcessor.extract_dispatcher``), which it
    emits held outputs through. All methods run on the output-processing path
    and cost dict lookups.
    """

    def __init__(self, processor: "OutputProcessor") -> None:
        self._processor = processor
        self._held: dict[str, HeldOutput] = {}  # extract id -> held output
        self._outgoing: list[HiddenStatesExtractRequest] = []
        # Firings are recorded as the client hands a step's rows out, for
        # requests with a tracker or without (server monitors only).
        on_firings(record_firings)

    @classmethod
    def of(cls, processor: "OutputProcessor") -> "ExtractDispatcher":
        """The processor's dispatcher, made on first use."""
        if processor.extract_dispatcher is None:
            processor.extract_dispatcher = cls(processor)
        return processor.extract_dispatcher

    @staticmethod
    def track(request: "EngineCoreRequest") -> HiddenStatesTracker | None:
        """The tracker of a request that asked (``hidden_states_spec`` set);
        None for one that asked nothing itself, only server monitors act on
        (nothing of theirs reaches it: their firings are recorded as they
        pass, wire.hand_out_captured), so its outputs cost the front-end
        nothing per step."""
        spec = request.hidden_states_spec
        assert spec is not None
        if spec.returns == "none" and all(a.monitor for a in spec.probe_actions):
            return None
        params = request.sampling_params
        return HiddenStatesTracker(
            request.hidden_states_spec,
            request.cache_salt,
            request.priority,
            None if params is None or not params.steering else as_interventions(params.steering),
            mm_positions_of(request.mm_features),
            request_id=request.request_id,
        )

    @property
    def num_held(self) -> int:
        return len(self._held)

    def holds(self, req_state: "RequestState") -> bool:
        """Whether the request's final output is held for its extract. A
        request that finished here on a stop string stays in the engine until
        the abort reaches it: the outputs it sends meanwhile must not reach
        the request (its text would run past the stop string, and each would
        send one more extract)."""
        return bool(self._held) and extract_id_for(req_state.request_id) in self._held

    def takes_output(
        self,
        req_state: "RequestState",
        engine_core_output: "EngineCoreOutput",
        fields: tuple,
        request_outputs: list["RequestOutput | PoolingRequestOutput"],
        reqs_to_abort: list[str],
        iteration_stats: "IterationStats | None",
    ) -> bool:
        """Per output of a request that asked, between steps 3 and 4 of
        ``process_outputs`` (``fields``: the :class:`OutputEmission` fields
        in order): False when vLLM emits it as usual; True when it was taken
        here, and the loop goes on to the next output.

        A finished request is taken when its final token's states are still
        to come (held until :meth:`release`), or when its capture failed
        (emitted now as a failure, :func:`failed_emission`, never with a
        silent None). Either way a request that finished here (a stop string)
        is aborted in the engine, as vLLM's step 5 would.
        """
        tracker: HiddenStatesTracker = req_state.hidden_states_tracker
        if engine_core_output.captured is not None:
            tracker.receive(engine_core_output.captured)
        if fields[_FINISH_REASON] is None:
            return False
        emission = OutputEmission(*fields)
        token_ids = _sequence(req_state)
        failure = None
        if tracker.spec.positions == "prompt":
            if emission.finish_reason == FinishReason.ABORT or tracker.has_everything:
                return False
            tracker.fail("the engine delivered no prompt rows for this request")
            failure = tracker.error
        elif emission.finish_reason != FinishReason.ABORT and not tracker.needs_final_token(
            len(token_ids)
        ):
            # An inline window that ended before the final token: no extract.
            tracker.finish_inline(len(token_ids))
            if tracker.error is None:
                return False
            failure = tracker.error
        if not engine_core_output.finished:
            reqs_to_abort.append(req_state.request_id)
        if failure is None:
            self._hold(req_state, engine_core_output, emission, token_ids)
            return True
        logger.error("Request %s: %s", req_state.request_id, failure)
        self._emit(
            req_state,
            engine_core_output,
            failed_emission(emission, failure),
            request_outputs,
            iteration_stats,
        )
        return True

    def _hold(
        self,
        req_state: "RequestState",
        engine_core_output: "EngineCoreOutput",
        emission: OutputEmission,
        token_ids: list[int],
    ) -> None:
        """Hold ``emission`` until the extract's rows arrive. The engine queued
        the extract itself when the request finished there by length or stop
        token with nothing for the front-end to trim
        (``EngineCoreOutput.hidden_states_extract_queued``); otherwise (a stop
        string matched here, a window the engine could not decide) it is
        queued here, over the sequence as trimmed, for the engine loop to send."""
        self._held[extract_id_for(req_state.request_id)] = HeldOutput(
            req_state, engine_core_output, emission, len(token_ids)
        )
        if engine_core_output.hidden_states_extract_queued:
            return
        tracker: HiddenStatesTracker = req_state.hidden_states_tracker
        self._outgoing.append(
            extract_for(
                tracker.spec,
                req_state.request_id,
                token_ids,
                lora_request=req_state.lora_request,
                cache_salt=tracker.cache_salt,
                priority=tracker.priority,
                steering=tracker.steering,
            )
        )

    def take_extracts(self) -> list[HiddenStatesExtractRequest]:
        """The extracts queued since the last call, for the engine loop to send."""
        if not self._outgoing:
            return []
        out, self._outgoing = self._outgoing, []
        return out

    def release(
        self,
        engine_core_output: "EngineCoreOutput",
        request_outputs: list["RequestOutput | PoolingRequestOutput"],
        iteration_stats: "IterationStats | None",
    ) -> None:
        """An output with no ``RequestState``: when it is the result of a held
        request's extract, attach its rows to the request and emit the held
        output (as a failure when the rows are not what was asked). Other
        outputs (e.g. of an extract whose request was aborted meanwhile) are
        ignored, as vLLM ignores those of aborted requests."""
        if not self._held or not engine_core_output.finished:
            return  # extracts emit exactly one (final) output
        held = self._held.pop(engine_core_output.request_id, None)
        if held is None:
            return
        tracker: HiddenStatesTracker = held.req_state.hidden_states_tracker
        rows = engine_core_output.captured
        if (problem := tracker.problem_with(rows)) is not None:
            reason = engine_core_output.stop_reason
            tracker.fail(
                f"hidden-state extraction failed in the engine ({problem}; "
                f"finish_reason={engine_core_output.finish_reason}"
                + (f": {reason}" if isinstance(reason, str) else "")
                + ")"
            )
        else:
            assert rows is not None  # problem_with(None) is not None
            tracker.finish(rows, held.num_tokens)
        if tracker.error is not None:
            logger.error("Request %s: %s", held.req_state.request_id, tracker.error)
            held.emission = failed_emission(held.emission, tracker.error)
        self._emit(
            held.req_state,
            held.engine_core_output,
            held.emission,
            request_outputs,
            iteration_stats,
        )

    def _emit(
        self,
        req_state: "RequestState",
        engine_core_output: "EngineCoreOutput",
        emission: OutputEmission,
        request_outputs: list["RequestOutput | PoolingRequestOutput"],
        iteration_stats: "IterationStats | None",
    ) -> None:
        """Emit a finished request's final output where step 4 of
        ``process_outputs`` would have (its queue under AsyncLLM,
        ``request_outputs`` under LLMEngine), then free the request
        (``OutputProcessor.finish_held_request``, patch 0004: step 5's stats
        and trace). The engine-side abort was sent when the output was taken.
        Streaming-input requests, step 5's other branch, never ask for hidden
        states (frontend/input_fields.py refuses them)."""
        assert not req_state.streaming_input
        output = req_state.make_request_output(
            emission.new_token_ids,
            emission.pooling_output,
            emission.finish_reason,
            emission.stop_reason,
            emission.kv_transfer_params,
            emission.ec_transfer_params,
            error=emission.request_error,
        )
        if output is not None:
            if req_state.queue is not None:
                req_state.queue.put(output)
            else:
                request_outputs.append(output)
        assert emission.finish_reason is not None
        self._processor.finish_held_request(
            req_state, engine_core_output, emission.finish_reason, iteration_stats
        )

    def abort(self, req_state: Any) -> str | None:
        """Forget a held request; the extract id to abort in the engine, if any."""
        extract_id = extract_id_for(req_state.request_id)
        if self._held.pop(extract_id, None) is None:
            return None
        return extract_id
