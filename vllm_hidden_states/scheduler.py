# SPDX-License-Identifier: Apache-2.0
"""EngineCore side: post-sampling prefills in the scheduler.

A ``HIDDEN_STATES_EXTRACT`` core request becomes a vLLM ``Request`` over
``prompt + output`` token ids that samples nothing useful: it is a prefill
with ``max_tokens=1`` whose one sampled token is discarded, so it finishes in
the step that computes its last position. It otherwise goes through the normal
scheduling path, which is the point:

* it is scheduled under the normal token budget (chunked when long);
* for "last" it takes over the finished request's KV blocks, parked for it in
  ``_free_request``, and computes one token; when those are gone or differ it
  reads the prefix cache, recomputing only what follows the last full block
  (``positions="all"`` sets ``skip_reading_prefix_cache``: cached blocks hold
  KV, not hidden states, so every position must be recomputed);
* preemption, abort and block freeing are vLLM's own.

:class:`HiddenStatesScheduler` hangs off ``Scheduler.hidden_states`` (None when
the engine has hidden states disabled, so the scheduler pays one ``is None``
check per step). It tells the model runner, through
``SchedulerOutput.hidden_states``, which rows of this step to capture, and
copies the captured tensors onto the extracts' EngineCoreOutputs. It also
registers ``positions="prompt"`` captures, which need no extract: the request's
own prefill chunks are captured and the states ride on its first output.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm_hidden_states.config import HiddenStatesConfig
from vllm_hidden_states.request import (
    EXTRACT_ID_SUFFIX,
    EXTRACT_POSITIONS,
    HiddenStatesExtractRequest,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# How long a finished "last" request's KV blocks wait for its extract before
# they are freed anyway (the front-end sends the extract as soon as it sees the
# finished output, so this only bounds leaks, e.g. a client abort that raced
# the finish), in seconds.
PARK_SECONDS = 5.0


@dataclass(frozen=True)
class CaptureSpec:
    """What to capture for one request id while it is in the scheduler.

    Attributes:
        layers: distinct absolute HF layer indices, in result order.
        positions: "last" (only position ``num_tokens - 1``) or "all".
        num_tokens: the capture ends once this many positions are computed.
    """

    layers: tuple[int, ...]
    positions: str
    num_tokens: int


@dataclass(frozen=True)
class CaptureStep:
    """What the model runner captures for one extract in one step.

    Attributes:
        layers: absolute HF layer indices, in result order.
        positions: "last" or "all".
        start: sequence position of this step's first scheduled token.
        num_tokens: length of the whole sequence being extracted.
    """

    layers: tuple[int, ...]
    positions: str
    start: int
    num_tokens: int


def make_extract_request(
    extract: HiddenStatesExtractRequest,
    block_hasher: Callable[["Request"], list[Any]] | None,
) -> "Request":
    """The vLLM Request that performs one post-sampling prefill."""
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        # Cached blocks hold KV, not hidden states: "all" must recompute them.
        skip_reading_prefix_cache=extract.positions == "all",
    )
    return Request(
        request_id=extract.request_id,
        prompt_token_ids=list(extract.token_ids),
        sampling_params=params,
        pooling_params=None,
        client_index=extract.client_index,
        arrival_time=extract.arrival_time,
        lora_request=extract.lora_request,
        cache_salt=extract.cache_salt,
        priority=extract.priority,
        block_hasher=block_hasher,
    )


class HiddenStatesScheduler:
    """Queue and bookkeeping of HIDDEN_STATES_EXTRACT requests in one scheduler."""

    def __init__(self, config: HiddenStatesConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # Captures pending in the scheduler (waiting or running), by request
        # id: HIDDEN_STATES_EXTRACT requests, and "prompt" captures of
        # generation requests until their prefill has delivered them.
        self.active: dict[str, CaptureSpec] = {}
        # Finished "last" requests whose KV blocks wait for their extract, by
        # request id, with the monotonic time they were parked (oldest first).
        self.parked: dict[str, tuple["Request", float]] = {}
        self._adoptable: bool | None = None

    @classmethod
    def maybe_create(cls, vllm_config: "VllmConfig") -> "HiddenStatesScheduler | None":
        config = HiddenStatesConfig.from_vllm_config(vllm_config)
        if config is None:
            return None
        return cls(config, vllm_config.model_config.max_model_len)

    # -- EngineCore input path ---------------------------------------------

    def validate(self, extract: HiddenStatesExtractRequest) -> str | None:
        """Why an extract cannot run, or None. The front-end validated the
        original request, so this only guards against a direct EngineCore user."""
        if extract.positions not in EXTRACT_POSITIONS:
            return f"positions must be 'last' or 'all', got {extract.positions!r}"
        if not extract.layers:
            return "no layers requested"
        bad = [k for k in extract.layers if k not in self.config.layers]
        if bad:
            return (
                f"layers {bad} are not capturable; capturable layers: "
                f"{self.config.describe_capturable()} (absolute indices expected)"
            )
        if not 0 < len(extract.token_ids) < self.max_model_len:
            return (
                f"sequence length {len(extract.token_ids)} must be in "
                f"1..{self.max_model_len - 1} (max_model_len={self.max_model_len})"
            )
        if extract.request_id in self.active:
            return "an extract with this request id is already running"
        return None

    def add(
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
        self.active[request.request_id] = CaptureSpec(
            tuple(extract.layers), extract.positions, len(extract.token_ids))
        scheduler.add_request(request)
        waiting = scheduler.waiting
        if isinstance(waiting, FCFSRequestQueue) and waiting and waiting[-1] is request:
            waiting.pop()
            waiting.prepend_request(request)

    # -- KV-block hand-over for "last" extracts ------------------------------

    def park(self, scheduler: "Scheduler", request: "Request") -> bool:
        """In ``_free_request``: keep a finished "last" request's KV blocks.

        Its extract (same token ids, the final one appended) then computes one
        token on top of them instead of re-prefilling everything after the
        last full, prefix-cached block (up to ``block_size - 1`` tokens).
        Returns True when the blocks are kept (the caller must not free them).
        """
        from vllm.v1.request import RequestStatus

        params = request.sampling_params
        if (
            params is None
            or not params.return_hidden_states
            or params.hidden_states_positions != "last"
            or request.status
            not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
            or not self._can_adopt(scheduler)
        ):
            return False
        self.parked[request.request_id] = (request, time.monotonic())
        return True

    def _can_adopt(self, scheduler: "Scheduler") -> bool:
        """Hand-over is implemented for plain full attention without a KV
        connector (the only per-request KV state is the block list)."""
        if self._adoptable is None:
            from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

            managers = scheduler.kv_cache_manager.coordinator.single_type_managers
            self._adoptable = scheduler.connector is None and all(
                type(m) is FullAttentionManager for m in managers
            )
        return self._adoptable

    def _adopt_parked(
        self,
        scheduler: "Scheduler",
        request: "Request",
        extract: HiddenStatesExtractRequest,
    ) -> None:
        """Give the extract its finished request's blocks, if they are parked
        and hold exactly the extract's tokens but the last one."""
        original_id = extract.request_id.removesuffix(EXTRACT_ID_SUFFIX)
        entry = self.parked.pop(original_id, None)
        if entry is None:
            return
        original = entry[0]
        n = len(extract.token_ids)
        if not (
            original.num_tokens == n
            and original.num_computed_tokens == n - 1
            and list(original.all_token_ids) == list(extract.token_ids)
        ):
            # E.g. a stop string trimmed the output in the front-end: the
            # sequences differ, fall back to the prefix cache.
            scheduler._free_blocks(original)
            return
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            manager.req_to_blocks[request.request_id] = manager.req_to_blocks.pop(
                original_id
            )
            if original_id in manager.num_cached_block:
                manager.num_cached_block[request.request_id] = (
                    manager.num_cached_block.pop(original_id)
                )
        del scheduler.requests[original_id]
        # Holding blocks with computed tokens, the extract waits in the
        # scheduler's KV-holding queue (drained first) and schedules 1 token.
        request.num_computed_tokens = original.num_computed_tokens
        request.last_sched_seq = original.last_sched_seq

    def _expire_parked(self, scheduler: "Scheduler") -> None:
        deadline = time.monotonic() - PARK_SECONDS
        while self.parked:
            request_id, (request, parked_at) = next(iter(self.parked.items()))
            if parked_at > deadline:
                break
            del self.parked[request_id]
            scheduler._free_blocks(request)

    # -- Scheduler call-outs -------------------------------------------------

    def annotate(self, scheduler: "Scheduler", output: "SchedulerOutput") -> None:
        """After the SchedulerOutput is built and before ``_update_after_schedule``
        advances ``num_computed_tokens``: tell the runner what to capture."""
        if self.parked:
            self._expire_parked(scheduler)
        if not self.active:
            return
        steps: dict[str, CaptureStep] = {}
        scheduled = output.num_scheduled_tokens
        for req_id, spec in self.active.items():
            if req_id in scheduled:
                steps[req_id] = CaptureStep(
                    layers=spec.layers,
                    positions=spec.positions,
                    start=scheduler.requests[req_id].num_computed_tokens,
                    num_tokens=spec.num_tokens,
                )
        if steps:
            output.hidden_states = steps

    def on_new_request(self, request: "Request") -> None:
        """In ``Scheduler.add_request``: register a "prompt" capture.

        The request's prompt positions are captured during its own prefill
        (the front-end set ``skip_reading_prefix_cache``, so all are computed).
        """
        params = request.sampling_params
        if (
            params is None
            or not params.return_hidden_states
            or params.hidden_states_positions != "prompt"
        ):
            return
        layers = params.hidden_states_layers or [-1]
        absolute = sorted({self.config.resolve(k) for k in layers})
        self.active[request.request_id] = CaptureSpec(
            tuple(absolute), "all", request.num_prompt_tokens)

    def forget(self, request_id: str) -> None:
        """In ``_free_request``: an extract left the scheduler (done or aborted)."""
        self.active.pop(request_id, None)

    def attach(
        self,
        outputs: dict[int, list["EngineCoreOutput"]],
        model_runner_output: "ModelRunnerOutput",
    ) -> None:
        """In ``update_from_output``: move captured tensors onto the outputs."""
        captured = model_runner_output.hidden_states
        if not captured:
            return
        for client_outputs in outputs.values():
            for eco in client_outputs:
                tensor = captured.get(eco.request_id)
                if tensor is not None:
                    eco.hidden_states = tensor
                    # Delivered: a "prompt" capture must not run again if the
                    # request is preempted and recomputed later.
                    self.active.pop(eco.request_id, None)


def add_extracts(engine_core: Any, extracts: list[HiddenStatesExtractRequest]) -> None:
    """``EngineCore.add_hidden_states_extracts``: validate and queue extracts.

    In the EngineCore process an invalid extract is finished at once with an
    error output (no ``hidden_states``), so the front-end releases its held
    request instead of waiting forever, and the engine keeps serving. An
    in-process EngineCore (driven directly) raises ValueError instead.
    """
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    hs: HiddenStatesScheduler | None = getattr(
        engine_core.scheduler, "hidden_states", None
    )
    for extract in extracts:
        if hs is None:
            problem = "hidden states are not enabled on this engine"
        else:
            problem = hs.validate(extract)
        if problem is not None:
            logger.error("Rejected hidden-states extract %s: %s",
                         extract.request_id, problem)
            error = EngineCoreOutput(
                request_id=extract.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                stop_reason=problem,
            )
            queue = getattr(engine_core, "output_queue", None)
            if queue is not None:
                queue.put_nowait(
                    (extract.client_index, EngineCoreOutputs(outputs=[error]))
                )
            else:
                raise ValueError(
                    f"hidden-states extract {extract.request_id}: {problem}"
                )
            continue
        request = make_extract_request(extract, engine_core.request_block_hasher)
        hs.add(engine_core.scheduler, request, extract)
