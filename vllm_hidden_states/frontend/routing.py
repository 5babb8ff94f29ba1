# SPDX-License-Identifier: Apache-2.0
"""Data parallel: each HIDDEN_STATES_EXTRACT goes to the engine that served
its request, where its KV blocks are parked and its prefix cache holds the
sequence.

Runs in the front-end, inside vLLM's load-balancing DP client
(``DPLBAsyncMPClient``, patch 0002); this module only decides the engine.
docs/architecture.md, "Data parallel: routing extracts".
"""

from collections import defaultdict
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm_hidden_states.points import EXTRACT_POSITIONS
from vllm_hidden_states.wire import HiddenStatesExtractRequest, extract_id_for, original_id_of

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

logger = init_logger(__name__)


# Most engines kept for requests whose extract is not sent yet. Entries leave
# when the extract is sent; an aborted request sends none, but aborts cannot
# drop theirs: a stop string also aborts the engine request, and its extract
# follows. So the oldest entries are dropped beyond this bound (an entry that
# old belongs to a request that will never send an extract; were it not, the
# extract would still be exact, on engine 0, without the KV hand-over).
MAX_REMEMBERED = 1 << 16


def remember_engine(engines: dict[str, bytes], request: "EngineCoreRequest", engine: bytes) -> None:
    """When the client routes a request that asked for hidden states: keep its
    engine in ``engines`` (the client's ``hidden_states_engines``) if the
    request will send an extract ("last", "all")."""
    if request.hidden_states_spec.positions in EXTRACT_POSITIONS:
        engines[request.request_id] = engine
        if len(engines) > MAX_REMEMBERED:
            del engines[next(iter(engines))]  # the oldest (dicts keep order)


def route_extracts(
    client: "DPLBAsyncMPClient", extracts: list[HiddenStatesExtractRequest]
) -> list[tuple[bytes, list[HiddenStatesExtractRequest]]]:
    """Group extracts by the engine that served their requests (taken off the
    client's ``hidden_states_engines``) and register each as in flight there
    like a request of the client's own (``reqs_in_flight`` for abort routing,
    ``engine_inflight`` for the load balancer). Returns ``[(engine, extracts)]``
    for the client to send (patch 0002)."""
    by_engine: dict[bytes, list[HiddenStatesExtractRequest]] = defaultdict(list)
    for extract in extracts:
        engine = client.hidden_states_engines.pop(original_id_of(extract.request_id), None)
        if engine is None:
            # Not routed by this client (cannot happen through AsyncLLM):
            # any engine computes the right states, without the hand-over.
            logger.warning(
                "hidden states: no engine recorded for %s; sending its extract to engine 0",
                extract.request_id,
            )
            engine = client.core_engine
        extract.client_index = client.client_index
        client.reqs_in_flight[extract.request_id] = engine
        client.engine_inflight[engine] += 1
        by_engine[engine].append(extract)
    return list(by_engine.items())


def track_queued_extracts(client: "DPLBAsyncMPClient", outputs: "EngineCoreOutputs") -> None:
    """When a step's outputs reach the load-balancing client, with requests
    finished in them (patch 0002): an engine that queued a request's extract
    itself (``EngineCoreOutput.hidden_states_extract_queued``; vLLM runs the
    data-parallel ranks of a dense model as independent engines, which do) runs
    it there, and no extract will be sent for it. So the request's kept engine
    is dropped, and the extract is tracked on it like a sent one: an abort of
    its request while it runs reaches it (``reqs_in_flight``), and the load
    balancer counts it until its finished output arrives (``engine_inflight``).
    """
    engines = client.hidden_states_engines
    for output in outputs.outputs:
        if not output.hidden_states_extract_queued:
            continue
        engine = engines.pop(output.request_id, None)
        if engine is not None:
            client.reqs_in_flight[extract_id_for(output.request_id)] = engine
            client.engine_inflight[engine] += 1
