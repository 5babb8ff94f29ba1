# SPDX-License-Identifier: Apache-2.0
"""CapturePlanner: what the model runner captures each step, and the KV
hand-over of "last".

It hangs off ``Scheduler.capture_planner`` (patch 0003), keeps the captures
pending in the scheduler by request id (extracts, "prompt" and inline "all"
captures), writes each step's ``SchedulerOutput.capture_plan``, moves captured
row groups onto the step's outputs, queues the extracts of requests that
finished in the engine, and parks a finished "last" request's KV blocks for
its extract. docs/architecture.md, "The planner".
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm_hidden_states.contract import as_interventions
from vllm_hidden_states.engine.extracts import make_extract_request, problem_with
from vllm_hidden_states.engine.held_mm_inputs import HeldMMInputs
from vllm_hidden_states.engine.probe_actions import ActionWatch
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.points import EXTRACT_POSITIONS
from vllm_hidden_states.wire import (
    CapturedRows,
    CaptureKind,
    CapturePlan,
    HiddenStatesExtractRequest,
    distinct_layers,
    ends_before_final_token,
    extract_for,
    group_rows,
    original_id_of,
    split_group,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# How long a finished "last" request's KV blocks wait for its extract before
# they are freed anyway (the front-end sends the extract as soon as it sees the
# finished output, so this only bounds leaks, e.g. a client abort that raced
# the finish), in seconds.
PARK_SECONDS = 5.0


@dataclass(slots=True)
class CaptureSpec:
    """What to capture for one request id while it is in the scheduler.

    Attributes:
        kind: what the rows are (layers, "last" or "all", SAE features,
            patterns, neurons; whether they pass the capture buffers), the
            same object for every spec that asks the same.
        num_tokens: the capture ends once this many positions are computed;
            None for an inline capture (the sequence grows as it generates).
        delivered: inline captures: positions ``< delivered`` were delivered
            (or lie before the request's window: it starts there).
        end: inline captures of a window: positions ``>= end`` are not
            captured (None: to the end).
        engine_only: only server monitors read the rows (the request
            returns none of them): they stay in the engine process.
    """

    kind: "CaptureKind"
    num_tokens: int | None
    delivered: int = 0
    end: int | None = None
    engine_only: bool = False


class CapturePlanner:
    """Pending captures and parked KV blocks of one scheduler."""

    def __init__(self, vllm_config: "VllmConfig") -> None:
        config = HiddenStatesConfig.from_vllm_config(vllm_config)
        assert config is not None, "made only when hidden states are enabled"
        self.config = config
        self.max_model_len = vllm_config.model_config.max_model_len
        # Captures pending in the scheduler (waiting or running), by request id.
        self.active: dict[str, CaptureSpec] = {}
        # Finished "last" requests whose KV blocks wait for their extract, by
        # request id, with the monotonic time they were parked (oldest first).
        self.parked: dict[str, tuple[Request, float]] = {}
        # Multimodal inputs of finished requests, carried by their extracts.
        self.mm_inputs = HeldMMInputs()
        # Probe actions of the running requests, decided on each step's scores.
        self.actions = ActionWatch()
        self._can_hand_over: bool | None = None
        # Requests finished in the step being updated whose extract the engine
        # queues itself once the step's outputs are built (attach).
        self._finished: list[Request] = []
        # The engines of a data-parallel group behind vLLM's load-balancing
        # client (a MoE model's ranks) leave every extract to the front-end,
        # which routes it (vllm_hidden_states.frontend.routing). A dense
        # model's ranks run as independent engines, whose config reads data
        # parallel size 1: they queue their own.
        parallel = vllm_config.parallel_config
        self._queues_extracts = (
            parallel.data_parallel_size == 1 or parallel.data_parallel_external_lb
        )
        # Patch rows of the admitted requests that patch (waiting or running),
        # by request id, against the worker's patch table (Scheduler call-out
        # ``waits``): a request whose rows do not fit waits.
        from vllm_hidden_states.steering_config import SteeringConfig

        steering = SteeringConfig.from_vllm_config(vllm_config)
        self.max_patch_rows = 0 if steering is None else steering.max_patch_rows
        self.patch_rows: dict[str, int] = {}
        self.patch_rows_held = 0
        # EngineCore.request_block_hasher (patch 0002): the extracts queued
        # here hash their blocks like every request of the engine.
        self.block_hasher: Callable[[Request], list[Any]] | None = None
        # Capture rows still free in the step being scheduled.
        self.rows_left = config.max_rows
        # A step's rows never outnumber its tokens: buffers that hold a full
        # step's tokens (the default where they fit) never limit a request.
        self._buffers_hold_a_step = (
            config.max_rows >= vllm_config.scheduler_config.max_num_batched_tokens
        )
        # One object per distinct CaptureKind, so that a step finds its
        # distinct kinds by identity (bounded: cleared when it grows).
        self._kinds: dict[CaptureKind, CaptureKind] = {}

    # -- requests entering ---------------------------------------------------

    def queue_extract(
        self, scheduler: "Scheduler", extract: HiddenStatesExtractRequest
    ) -> str | None:
        """Queue ``extract`` in ``scheduler``; why it cannot run, or None."""
        problem = problem_with(self.config, self.max_model_len, self.active, extract)
        if problem is not None:
            return problem
        mm_features, forgotten = self.mm_inputs.take(original_id_of(extract.request_id))
        if forgotten:
            return (
                "the request's images (multimodal inputs) were no longer held in the "
                "engine when its extract came; without them the replayed prompt would "
                "read placeholders as text"
            )
        request = make_extract_request(extract, self.block_hasher, mm_features)
        self.add_extract(scheduler, request, extract)
        return None

    def add_extract(
        self,
        scheduler: "Scheduler",
        request: "Request",
        extract: HiddenStatesExtractRequest,
    ) -> None:
        """Queue an extract in the scheduler, ahead of not-yet-started requests.

        Its request's output is complete and held by the front-end; running
        the extract first returns it sooner and frees what is held. Under the
        priority policy, the extract keeps its original request's priority.
        """
        from vllm.v1.core.sched.request_queue import FCFSRequestQueue

        self._adopt_parked(scheduler, request, extract)
        spec = self._spec(
            tuple(extract.layers),
            extract.positions,
            len(extract.token_ids),
            extract.sae_top_k,
            tuple(extract.patterns),
            tuple(extract.neurons),
            (extract.start, extract.end),
            tuple(extract.probes),
        )
        self.active[request.request_id] = spec
        scheduler.add_request(request)
        waiting = scheduler.waiting
        if isinstance(waiting, FCFSRequestQueue) and waiting and waiting[-1] is request:
            waiting.pop()
            waiting.prepend_request(request)

    def on_new_request(self, request: "Request") -> None:
        """In ``Scheduler.add_request``: its steering as
        :class:`~vllm_hidden_states.contract.Intervention` structs (decoded
        from the front-end's message as dicts), and a "prompt" capture
        registered.

        The request's prompt positions are captured during its own prefill
        (the front-end set ``skip_reading_prefix_cache``, so all are computed).
        """
        params = request.sampling_params
        if params is not None and params.steering:
            params.steering = as_interventions(params.steering)
        spec = request.hidden_states_spec
        if spec is None:
            return
        self.actions.add(request)
        layers = tuple(distinct_layers(spec))
        neurons = tuple(spec.neuron_ids)
        probes = tuple(spec.probes)
        if spec.positions == "prompt":
            self.active[request.request_id] = self._spec(
                layers,
                "all",
                request.num_prompt_tokens,
                spec.sae_top_k,
                neurons=neurons,
                probes=probes,
            )
        elif spec.inline:
            capture = self._spec(
                layers, "all", None, spec.sae_top_k, neurons=neurons, probes=probes
            )
            # A window ("generated", {"start", "end"}): nothing before its
            # start is captured, nothing from its end on.
            capture.delivered, capture.end = spec.start, spec.end
            capture.engine_only = spec.returns == "none"
            self.active[request.request_id] = capture

    def _spec(
        self,
        layers: tuple[int, ...],
        positions: str,
        num_tokens: int | None,
        sae_top_k: int = 0,
        patterns: tuple[int, ...] = (),
        neurons: tuple[int, ...] = (),
        query_window: tuple[int, int | None] = (0, None),
        probes: tuple[str, ...] = (),
    ) -> CaptureSpec:
        final = self.config.num_layers
        read = (*layers, self.config.sae_layer) if sae_top_k else layers
        if probes:  # a probe reads its point's rows, captured like a layer's
            read = (*read, *(self.config.probes[name]["capture_id"] for name in probes))
        kind = CaptureKind(
            layers,
            positions,
            sae_top_k,
            # Rows pass the capture buffers (and count against max_rows)
            # unless only the final layer is read: the model's output holds
            # every scheduled token.
            bool(patterns or neurons) or any(k != final for k in read),
            patterns,
            query_window[0],
            query_window[1],
            neurons,
            probes,
        )
        if len(self._kinds) > 1024:
            self._kinds.clear()  # only identity within a step depends on it
        return CaptureSpec(self._kinds.setdefault(kind, kind), num_tokens)

    # -- each step -------------------------------------------------------------

    def cap_tokens(self, request: "Request", num_new_tokens: int) -> int:
        """In ``Scheduler.schedule``, while captures are pending: the tokens
        ``request`` may schedule in this step so that the step's captured rows
        fit the capture buffers (``max_rows``); 0 = none this step.

        An "all" capture takes a row per scheduled token, so a long one is
        split over steps. A "last" capture takes one row, in the chunk that
        reaches its last position; with no row left, the chunk stops one short
        of it. Requests without a capture, or whose only layer is the final
        one (read from the model's output, not the buffers), are not limited.
        """
        if self._buffers_hold_a_step:
            return num_new_tokens
        spec = self.active.get(request.request_id)
        if spec is None or not spec.kind.buffered:
            return num_new_tokens
        if spec.kind.positions == "last":
            if self.rows_left > 0:
                self.rows_left -= 1
                return num_new_tokens
            return num_new_tokens - 1
        # "all": a row per scheduled position not yet delivered and inside the
        # window; positions before them are scheduled freely.
        computed = request.num_computed_tokens
        first = max(computed, spec.delivered)
        stop = computed + num_new_tokens
        rows = max(0, (stop if spec.end is None else min(stop, spec.end)) - first)
        if rows <= self.rows_left:
            self.rows_left -= rows
            return num_new_tokens
        allowed = max(first - computed, 0) + self.rows_left
        self.rows_left = 0
        return allowed

    def plan_step(self, scheduler: "Scheduler", output: "SchedulerOutput") -> None:
        """After the SchedulerOutput is built and before ``_update_after_schedule``
        advances ``num_computed_tokens``: tell the runner what to capture."""
        self.rows_left = self.config.max_rows  # for the next step
        if self.parked:
            self._expire_parked(scheduler)
        if not self.active:
            return
        # One tuple per request, turned into the plan's columns at the end
        # (one ``zip``, not nine appends per request each step).
        rows: list[tuple[str, int, int, bool, int, int, int, int, int]] = []
        kinds: list[CaptureKind] = []
        kind_index: dict[int, int] = {}  # id(kind) -> index in kinds
        last_kind, last_index = None, 0
        one_group = True
        scheduled = output.num_scheduled_tokens
        requests = scheduler.requests
        for req_id, spec in self.active.items():
            n = scheduled.get(req_id)
            if n is None:
                continue
            request = requests[req_id]
            start = request.num_computed_tokens
            num_tokens = spec.num_tokens
            if num_tokens is None:  # inline: up to the sequence so far
                # With async scheduling the tokens of steps still in flight
                # are placeholders, not yet in num_tokens; the positions this
                # step computes exist all the same.
                num_tokens = request.num_tokens + request.num_output_placeholders
                if start + n <= spec.delivered:
                    continue  # recomputing delivered positions
            kind = spec.kind
            if kind is not last_kind:  # most steps have one kind
                index = kind_index.get(id(kind))
                if index is None:
                    index = kind_index[id(kind)] = len(kinds)
                    kinds.append(kind)
                    one_group = one_group and index == 0 and kind.rows_only
                last_kind, last_index = kind, index
            index = last_index
            # Rows past the sequence (draft tokens of speculative decoding)
            # are never captured.
            end = start + n if start + n < num_tokens else num_tokens
            done = end == num_tokens
            first = start if start > spec.delivered else spec.delivered
            window = spec.end
            if kind.positions == "last":
                # Only in the chunk that computes the last position.
                offset, count = end - 1 - start, int(done)
            else:
                # From ``first`` (earlier positions were delivered before a
                # preemption made the request recompute them, or lie before
                # its window) up to the window's end, if any.
                stop = end if window is None or end < window else window
                offset, count = first - start, stop - first
            one_group = one_group and done and count > 0
            rows.append(
                (
                    req_id,
                    offset,
                    count,
                    done,
                    start,
                    num_tokens,
                    first,
                    -1 if window is None else window,
                    index,
                )
            )
        if rows:
            req_ids, offsets, counts, done_list, starts, num_tokens_list, firsts, stops, kind_of = (
                map(list, zip(*rows))
            )
            output.capture_plan = CapturePlan(
                req_ids,
                offsets,
                counts,
                done_list,
                one_group,
                starts,
                num_tokens_list,
                firsts,
                stops,
                kind_of,
                kinds,
            )

    def attach(
        self,
        scheduler: "Scheduler",
        engine_core_outputs: dict[int, "EngineCoreOutputs"],
        model_runner_output: "ModelRunnerOutput",
    ) -> None:
        """In ``update_from_output``, once the step's outputs are built: queue
        the extracts of the requests that finished in this step
        (:meth:`_queue_extracts`), then put the captured row groups on the
        outputs of their requests' clients, as they are (one tensor per field
        for many requests), and count what each capture delivered. Rows of a
        request without an output in this step (aborted meanwhile) are
        dropped."""
        groups = model_runner_output.captured
        if self.actions.watched:
            if groups:
                # First: a stop finishes its request here, so that its
                # extract is queued with the others.
                self.actions.decide(scheduler, engine_core_outputs, groups)
            self.actions.end_step()
        if self._finished:
            self._queue_extracts(scheduler, engine_core_outputs)
        if not groups:
            return
        if len(engine_core_outputs) == 1:
            # One client (the common case): every group goes to it whole; its
            # hand-out drops rows of a request without an output.
            (outputs,) = engine_core_outputs.values()
            for group in groups:
                self._deliver(outputs, group)
            return
        client_of = {
            eco.request_id: client
            for client, outs in engine_core_outputs.items()
            for eco in outs.outputs
        }
        for group in groups:
            clients = {client_of.get(req_id, -1) for req_id in group.req_ids}
            if len(clients) == 1 and -1 not in clients:
                self._deliver(engine_core_outputs[clients.pop()], group)
                continue
            # Several clients (or a request gone): one group per request.
            for (req_id, rows), first in zip(split_group(group), group.firsts):
                if (client := client_of.get(req_id)) is not None:
                    self._deliver(engine_core_outputs[client], group_rows(rows, req_id, first))

    def _deliver(self, outputs: "EngineCoreOutputs", group: CapturedRows) -> None:
        """``group`` goes out with ``outputs``, unless only server monitors
        read its rows (they were read in :meth:`attach`); its captures
        advance. One pass over the group's requests."""
        active = self.active
        returned = False  # some request of the group gets its rows
        for req_id, count in zip(group.req_ids, group.counts):
            spec = active.get(req_id)
            if spec is None:
                returned = True
                continue
            if not spec.engine_only:
                returned = True
            if spec.num_tokens is None:
                # inline: more to come (unless its window is complete)
                spec.delivered += count
                if spec.end is not None and spec.delivered >= spec.end:
                    del active[req_id]
            else:
                # Delivered: a "prompt" capture must not run again if the
                # request is preempted and recomputed later.
                del active[req_id]
        if returned:
            if outputs.captured is None:
                outputs.captured = []
            outputs.captured.append(group)

    def on_request_freed(self, request_id: str) -> None:
        """In ``_free_request``: a capture left the scheduler (done or
        aborted); its patch rows, if any, are free again."""
        if self.active:
            self.active.pop(request_id, None)
        if self.actions.watched:
            self.actions.forget(request_id)
        if self.patch_rows:
            self.patch_rows_held -= self.patch_rows.pop(request_id, 0)

    def waits(self, request: "Request") -> bool:
        """In the scheduler's loop over waiting requests: whether ``request``
        must wait because its patch rows (``patch`` and ``ablate_heads``) do not fit
        the worker's patch table beside those of the requests admitted before
        it. Otherwise its rows are counted until it is freed (a preempted
        request keeps them). The front-end refuses a request whose rows
        alone outnumber the table, so every request gets in."""
        params = request.sampling_params
        if params is None or not params.steering or request.request_id in self.patch_rows:
            return False
        from vllm_hidden_states.steering_config import TABLE_OPS

        need = sum(item.n for item in params.steering if item.op in TABLE_OPS)
        if not need:
            return False
        if self.patch_rows_held + need > self.max_patch_rows:
            return True
        self.patch_rows[request.request_id] = need
        self.patch_rows_held += need
        return False

    # -- KV-block hand-over for "last" extracts --------------------------------

    def park(self, scheduler: "Scheduler", request: "Request") -> bool:
        """In ``_free_request``: keep a finished "last" request's KV blocks,
        and note a request whose extract the engine queues itself.

        Its extract (same token ids, the final one appended) then computes one
        token on top of them instead of re-prefilling everything after the
        last full, prefix-cached block (up to ``block_size - 1`` tokens).
        Returns True when the blocks are kept (the caller must not free them).
        """
        from vllm.v1.request import RequestStatus

        spec = request.hidden_states_spec
        if spec is not None and request.mm_features and spec.positions in EXTRACT_POSITIONS:
            self.mm_inputs.hold(request)
        if spec is None or request.status not in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            return False
        if self.engine_queues_extract(request):
            self._finished.append(request)
        if (
            not (spec.positions == "last" or spec.inline)
            # An inline window that ends before the final token gets no extract.
            or ends_before_final_token(spec, request.num_tokens)
            or spec.pattern_ids  # its extract recomputes every key
            or not self._hand_over_supported(scheduler)
        ):
            return False
        self.parked[request.request_id] = (request, time.monotonic())
        return True

    def engine_queues_extract(self, request: "Request") -> bool:
        """Whether the engine queues the extract of ``request``, which finished
        here (EOS, stop token, length): when the front-end has nothing to
        trim (no stop strings), the engine's token list is final, and its
        extract can run in the next step instead of after a round trip
        through the front-end."""
        spec = request.hidden_states_spec
        assert spec is not None
        if self.actions.trimmed and request.request_id in self.actions.trimmed:
            # A probe action stopped it: the front-end's sequence is final.
            self.actions.trimmed.discard(request.request_id)
            return False
        params = request.sampling_params
        return (
            self._queues_extracts
            and spec.positions in EXTRACT_POSITIONS
            and params is not None
            and not params.stop
            and not ends_before_final_token(spec, request.num_tokens)
        )

    def _queue_extracts(
        self, scheduler: "Scheduler", engine_core_outputs: dict[int, "EngineCoreOutputs"]
    ) -> None:
        """Queue the extracts noted by :meth:`park` and mark their requests'
        final outputs (``EngineCoreOutput.hidden_states_extract_queued``), so
        the front-end holds them without sending an extract. An extract that
        cannot run (:meth:`queue_extract`),
        or whose request has no final output in this step to mark, is left to
        the front-end, which sends it (and gets its error)."""
        finished, self._finished = self._finished, []
        final_outputs = {
            output.request_id: output
            for outputs in engine_core_outputs.values()
            for output in outputs.outputs
            if output.finish_reason is not None
        }
        for request in finished:
            output = final_outputs.get(request.request_id)
            if output is None:
                continue
            extract = extract_for(
                request.hidden_states_spec,
                request.request_id,
                list(request.all_token_ids),
                lora_request=request.lora_request,
                cache_salt=request.cache_salt,
                priority=request.priority,
                steering=request.sampling_params.steering,
                client_index=request.client_index,
            )
            problem = self.queue_extract(scheduler, extract)
            if problem is None:
                output.hidden_states_extract_queued = True
            else:
                logger.warning(
                    "hidden states: the engine cannot queue %s (%s); the front-end will",
                    extract.request_id,
                    problem,
                )

    def _hand_over_supported(self, scheduler: "Scheduler") -> bool:
        """Hand-over is implemented for plain full attention without a KV
        connector (the only per-request KV state is the block list)."""
        if self._can_hand_over is None:
            from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

            managers = scheduler.kv_cache_manager.coordinator.single_type_managers
            self._can_hand_over = scheduler.connector is None and all(
                type(m) is FullAttentionManager for m in managers
            )
        return self._can_hand_over

    def _adopt_parked(
        self,
        scheduler: "Scheduler",
        request: "Request",
        extract: HiddenStatesExtractRequest,
    ) -> None:
        """Give the extract its finished request's blocks, if they are parked
        and hold exactly the extract's tokens but the last one."""
        entry = self.parked.pop(original_id_of(extract.request_id), None)
        if entry is None:
            return
        original = entry[0]
        n = len(extract.token_ids)
        if (
            original.num_tokens == n
            and original.num_computed_tokens == n - 1
            and list(original.all_token_ids) == list(extract.token_ids)
        ):
            # Holding blocks with computed tokens, the extract waits in the
            # scheduler's KV-holding queue (drained first) and schedules 1 token.
            scheduler.hand_over_parked_blocks(original, request)
        else:
            # E.g. a stop string trimmed the output in the front-end: the
            # sequences differ, fall back to the prefix cache.
            scheduler.free_parked_blocks(original)

    def _expire_parked(self, scheduler: "Scheduler") -> None:
        deadline = time.monotonic() - PARK_SECONDS
        while self.parked:
            request_id, (request, parked_at) = next(iter(self.parked.items()))
            if parked_at > deadline:
                break
            del self.parked[request_id]
            scheduler.free_parked_blocks(request)
            # Expected when the front-end dropped the request while it held
            # it (client gone); else a sign its extract went elsewhere.
            logger.info(
                "hidden states: freed the parked KV blocks of %s, whose extract "
                "did not come within %.0f s",
                request_id,
                PARK_SECONDS,
            )
