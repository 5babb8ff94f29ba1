# SPDX-License-Identifier: Apache-2.0
"""Data parallel: which engine each extract is tracked on, in vLLM's
load-balancing client (``DPLBAsyncMPClient``, patch 0002).

vLLM's own ``process_engine_outputs`` runs on the client's bookkeeping, fed
engine outputs by hand in the order the engines send them; no engine runs, so
the order is exact. (``test_scale_out.py`` runs the same client behind a real
DP=2 server.)
"""

import asyncio
from collections import Counter
from types import SimpleNamespace

from vllm import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.core_client import DPLBAsyncMPClient
from vllm_hidden_states.frontend.routing import remember_engine, route_extracts
from vllm_hidden_states.wire import HiddenStatesSpec, extract_for, extract_id_for

from .conftest import engine_core_request

# Engine identities as vLLM's client makes them: the rank, 2 bytes little-endian.
ENGINE_0, ENGINE_1 = (0).to_bytes(2, "little"), (1).to_bytes(2, "little")
REQ_ID = "req-1"
SPEC = HiddenStatesSpec(layers=[-1], abs_layers=[2], positions="last")


def _client_with_request_on(engine: bytes) -> SimpleNamespace:
    """The bookkeeping ``DPLBAsyncMPClient`` keeps once it routed ``REQ_ID``
    (which asked for the last position's states) to ``engine``."""
    client = SimpleNamespace(
        reqs_in_flight={REQ_ID: engine},
        engine_inflight=Counter({engine: 1}),
        hidden_states_engines={},
        core_engine=ENGINE_0,
        client_index=0,
    )
    request = engine_core_request(REQ_ID, [1, 2, 3], SamplingParams(max_tokens=4), SPEC)
    remember_engine(client.hidden_states_engines, request, engine)
    return client


def _outputs(request_id: str, extract_queued: bool, reason=FinishReason.LENGTH):
    """A step's outputs in which ``request_id`` finished."""
    final = EngineCoreOutput(
        request_id=request_id,
        new_token_ids=[7],
        finish_reason=reason,
        hidden_states_extract_queued=extract_queued,
    )
    return EngineCoreOutputs(outputs=[final], finished_requests={request_id})


def _process(client: SimpleNamespace, outputs: EngineCoreOutputs) -> None:
    asyncio.run(DPLBAsyncMPClient.process_engine_outputs(client, outputs))


def test_an_extract_the_engine_queued_is_tracked_on_that_engine_for_aborts_and_load():
    client = _client_with_request_on(ENGINE_1)
    _process(client, _outputs(REQ_ID, extract_queued=True))
    assert client.reqs_in_flight == {extract_id_for(REQ_ID): ENGINE_1}
    assert client.engine_inflight[ENGINE_1] == 1


def test_an_extract_the_engine_queued_leaves_no_kept_engine_behind():
    client = _client_with_request_on(ENGINE_1)
    _process(client, _outputs(REQ_ID, extract_queued=True))
    assert client.hidden_states_engines == {}


def test_an_engine_queued_extract_is_untracked_when_it_finishes():
    client = _client_with_request_on(ENGINE_1)
    _process(client, _outputs(REQ_ID, extract_queued=True))
    _process(client, _outputs(extract_id_for(REQ_ID), extract_queued=False))
    assert client.reqs_in_flight == {}
    assert client.engine_inflight[ENGINE_1] == 0


def test_a_request_stopped_by_the_front_end_keeps_its_engine_for_the_extract_it_sends():
    client = _client_with_request_on(ENGINE_1)
    # A stop string matched in the front-end: the engine request is aborted,
    # the engine queued nothing, and the front-end sends the extract.
    _process(client, _outputs(REQ_ID, extract_queued=False, reason=FinishReason.ABORT))
    assert client.hidden_states_engines == {REQ_ID: ENGINE_1}
    extract = extract_for(SPEC, REQ_ID, [1, 2, 3, 7])
    routed = route_extracts(client, [extract])
    assert routed == [(ENGINE_1, [extract])]


def test_a_sent_extract_is_tracked_on_its_engine_for_aborts_and_load():
    client = _client_with_request_on(ENGINE_1)
    _process(client, _outputs(REQ_ID, extract_queued=False, reason=FinishReason.ABORT))
    route_extracts(client, [extract_for(SPEC, REQ_ID, [1, 2, 3, 7])])
    assert client.reqs_in_flight == {extract_id_for(REQ_ID): ENGINE_1}
    assert client.engine_inflight[ENGINE_1] == 1
    assert client.hidden_states_engines == {}
