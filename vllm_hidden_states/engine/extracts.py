# SPDX-License-Identifier: Apache-2.0
"""HIDDEN_STATES_EXTRACT core requests in the EngineCore.

An extract becomes a vLLM ``Request`` over ``prompt + output`` token ids that
samples nothing useful: a prefill with ``max_tokens=1`` whose sampled token is
discarded, so it finishes in the step that computes its last position. It
otherwise goes through the normal scheduling path, which is the point: the
normal token budget (chunked when long), prefix caching, preemption, abort and
block freeing are vLLM's own. The scheduler's ``CapturePlanner``
(``engine/planner.py``) queues it and plans its captures; this module only
builds and checks it, and knows nothing of the planner.
"""

from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.points import EXTRACT_POSITIONS
from vllm_hidden_states.wire import HiddenStatesExtractRequest

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)


def make_extract_request(
    extract: HiddenStatesExtractRequest,
    block_hasher: Callable[["Request"], list[Any]] | None,
    mm_features: list[Any] | None = None,
) -> "Request":
    """The vLLM Request that performs one post-sampling prefill; with its
    request's multimodal inputs (``mm_features``, vLLM's) where it had any,
    so that image placeholders are embedded as the request's own were."""
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        # Cached blocks hold KV, not hidden states: "all" must recompute them.
        skip_reading_prefix_cache=extract.positions == "all",
        # The original request's steering, replayed over every position the
        # extract computes (its KV and prefix-cache salt are the steered ones).
        steering=extract.steering,
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
        mm_features=mm_features,
    )


def problem_with(
    config: HiddenStatesConfig,
    max_model_len: int,
    running: Container[str],
    extract: HiddenStatesExtractRequest,
) -> str | None:
    """Why an extract cannot run on an engine of ``config`` whose extracts
    ``running`` are in flight, or None. The front-end validated the original
    request, so this only guards against a direct EngineCore user."""
    if extract.positions not in EXTRACT_POSITIONS:
        return f"positions must be 'last' or 'all', got {extract.positions!r}"
    if extract.sae_top_k and (
        config.sae is None or not 1 <= extract.sae_top_k <= config.sae["d_sae"]
    ):
        return f"sae_top_k {extract.sae_top_k}: " + (
            "no SAE on this engine (--sae)"
            if config.sae is None
            else f"must be in 1..{config.sae['d_sae']}"
        )
    unknown = [name for name in extract.probes if name not in config.probes]
    if unknown:
        return f"probes {unknown} are not loaded on this engine; loaded: {sorted(config.probes)}"
    if not (
        extract.layers or extract.sae_top_k or extract.patterns or extract.neurons or extract.probes
    ):
        return "no layers requested"
    if extract.patterns and extract.positions != "all":
        return "attention patterns need positions 'all' (every key recomputed)"
    asked = (*extract.layers, *extract.patterns, *extract.neurons)
    bad = [k for k in asked if k not in config.layers]
    if bad:
        return (
            f"layers {bad} are not capturable; capturable layers: "
            f"{config.describe_capturable()} (absolute indices expected)"
        )
    if not 0 < len(extract.token_ids) < max_model_len:
        return (
            f"sequence length {len(extract.token_ids)} must be in "
            f"1..{max_model_len - 1} (max_model_len={max_model_len})"
        )
    if extract.request_id in running:
        return "an extract with this request id is already running"
    return None


def add_extracts(engine_core: Any, extracts: list[HiddenStatesExtractRequest]) -> None:
    """``EngineCore.add_hidden_states_extracts``: validate and queue the
    extracts the front-end sent.

    In the EngineCore process an invalid extract is finished at once with an
    error output (no ``hidden_states``), so the front-end releases its held
    request instead of waiting forever, and the engine keeps serving. An
    in-process EngineCore (driven directly) raises ValueError instead.
    """
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    scheduler = engine_core.scheduler
    planner = scheduler.capture_planner
    for extract in extracts:
        problem = (
            "hidden states are not enabled on this engine"
            if planner is None
            else planner.queue_extract(scheduler, extract)
        )
        if problem is None:
            continue
        logger.error("Rejected hidden-states extract %s: %s", extract.request_id, problem)
        queue = getattr(engine_core, "output_queue", None)
        if queue is None:
            raise ValueError(f"hidden-states extract {extract.request_id}: {problem}")
        error = EngineCoreOutput(
            request_id=extract.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            stop_reason=problem,
        )
        # finished_requests: a data-parallel front-end forgets the extract's
        # engine on it (vLLM sets it from the scheduler for normal requests).
        queue.put_nowait(
            (
                extract.client_index,
                EngineCoreOutputs(outputs=[error], finished_requests={extract.request_id}),
            )
        )
