# SPDX-License-Identifier: Apache-2.0
"""EngineCore driven directly: ADD, then HIDDEN_STATES_EXTRACT, step, read outputs."""

import time

import pytest

from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequestType
from vllm_hidden_states.wire import HiddenStatesExtractRequest, HiddenStatesSpec, hand_out_captured

from .conftest import assert_close, engine_core_request

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 211, 33, 8]


def _add(
    core,
    req_id: str,
    prompt: list[int],
    max_tokens: int,
    spec: HiddenStatesSpec | None = None,
    stop: list[str] | None = None,
) -> None:
    """ADD a request as the front-end would send it (``spec``: what it asked for,
    already resolved, on ``EngineCoreRequest.hidden_states_spec``; ``stop``:
    stop strings, which only the front-end matches)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
    request = engine_core_request(req_id, prompt, params, spec)
    req, wave = core.preprocess_add_request(request)
    core.add_request(req, wave)


def _run(core, req_ids: set[str], max_steps: int = 400, drain: bool = True) -> dict:
    """Step as the engine's busy loop does (``step_fn``: with async scheduling,
    through the batch queue) until every id in req_ids has a finished output
    and (``drain``) the engine is idle again; outputs by id."""
    finished, tokens = {}, {r: [] for r in req_ids}
    for _ in range(max_steps):
        outputs, _ = core.step_fn()
        for outs in (outputs or {}).values():
            hand_out_captured(outs)  # what the client does right after decoding
        for eco in (o for outs in (outputs or {}).values() for o in outs.outputs):
            if eco.request_id in tokens:
                tokens[eco.request_id] += eco.new_token_ids
                if eco.finished:
                    finished[eco.request_id] = eco
        if finished.keys() == req_ids and not (drain and _busy(core)):
            return {r: (finished[r], tokens[r]) for r in req_ids}
    raise AssertionError(f"not finished after {max_steps} steps: {req_ids - finished.keys()}")


def _busy(core) -> bool:
    """Requests left to schedule, or (async scheduling) a step in flight."""
    return core.scheduler.has_unfinished_requests() or bool(core.batch_queue)


def last_final_layer(hf) -> HiddenStatesSpec:
    """The spec the front-end resolves for "last" with the default layer -1."""
    return HiddenStatesSpec(layers=[-1], abs_layers=[hf.num_layers], positions="last")


def _extract(req_id, token_ids, layers, positions="last"):
    return HiddenStatesExtractRequest(
        request_id=req_id,
        token_ids=token_ids,
        layers=layers,
        positions=positions,
        arrival_time=time.time(),
    )


def test_request_type_has_hidden_states_extract_member():
    assert EngineCoreRequestType.HIDDEN_STATES_EXTRACT.value == b"\x06"
    assert len({t.value for t in EngineCoreRequestType}) == len(EngineCoreRequestType)


@pytest.mark.four_modes
def test_extract_after_generation_returns_last_token_states(engine_core, hf_qwen3):
    _add(engine_core, "gen-1", PROMPT, max_tokens=6)
    _, generated = _run(engine_core, {"gen-1"})["gen-1"]
    sequence = PROMPT + generated
    layers = [0, 2, hf_qwen3.num_layers]  # absolute indices: embeddings, middle, L
    engine_core.add_hidden_states_extracts([_extract("gen-1-hs", sequence, layers)])
    eco, _ = _run(engine_core, {"gen-1-hs"})["gen-1-hs"]

    assert eco.captured.hidden.shape == (3, 1, hf_qwen3.hidden_size)
    ref = hf_qwen3.states(sequence)
    for row, layer in enumerate(layers):
        assert_close(eco.captured.hidden[row], ref[layer][-1:], f"layer {layer}")


@pytest.mark.four_modes
def test_extract_all_positions_spans_chunked_prefill(engine_core, hf_qwen3):
    sequence = (PROMPT * 15)[:150]  # > max_num_batched_tokens=64: three chunks
    final = hf_qwen3.num_layers
    engine_core.add_hidden_states_extracts([_extract("all-1", sequence, [1, final], "all")])
    eco, _ = _run(engine_core, {"all-1"})["all-1"]

    assert eco.captured.hidden.shape == (2, 150, hf_qwen3.hidden_size)
    ref = hf_qwen3.states(sequence)
    assert_close(eco.captured.hidden[0], ref[1], "layer 1")
    assert_close(eco.captured.hidden[1], ref[final], "layer L")


def test_extract_output_carries_no_tokens_for_plain_requests(engine_core):
    _add(engine_core, "plain-1", PROMPT, max_tokens=3)
    eco, _ = _run(engine_core, {"plain-1"})["plain-1"]
    assert eco.captured is None


def test_extract_with_uncapturable_layer_raises_clear_error(engine_core, hf_qwen3):
    beyond = hf_qwen3.num_layers + 5
    with pytest.raises(ValueError, match=rf"layers \[{beyond}\] are not capturable"):
        engine_core.add_hidden_states_extracts([_extract("bad-1", PROMPT, [beyond])])
    assert not engine_core.scheduler.capture_planner.active


def test_extract_with_bad_positions_raises_clear_error(engine_core):
    with pytest.raises(ValueError, match="positions must be 'last' or 'all'"):
        engine_core.add_hidden_states_extracts([_extract("bad-2", PROMPT, [0], "first")])


def test_aborted_extract_leaves_no_state(engine_core):
    sequence = (PROMPT * 20)[:200]
    engine_core.add_hidden_states_extracts([_extract("abort-1", sequence, [0], "all")])
    engine_core.step()  # first chunk runs
    engine_core.abort_requests(["abort-1"])
    engine_core.step()
    scheduler = engine_core.scheduler
    assert "abort-1" not in scheduler.requests
    assert not scheduler.capture_planner.active
    runner = engine_core.model_executor.driver_worker.worker.model_runner
    capture = runner.hidden_states_capture
    assert not capture._partial and not capture._ready and capture._ready_group is None


def test_engine_serves_after_rejected_extract(engine_core, hf_qwen3):
    with pytest.raises(ValueError):
        engine_core.add_hidden_states_extracts([_extract("bad-3", PROMPT, [])])
    final = hf_qwen3.num_layers
    engine_core.add_hidden_states_extracts([_extract("ok-3", PROMPT, [final])])
    eco, _ = _run(engine_core, {"ok-3"})["ok-3"]
    assert_close(eco.captured.hidden[0], hf_qwen3.last(PROMPT, final), "layer L")


# A stop string the random model never produces: the request finishes by
# length, but only the front-end could have known, so it sends the extract.
NEVER = ["never produced by the tiny model"]


@pytest.mark.four_modes
def test_engine_queues_the_extract_of_a_request_finished_by_length(engine_core, hf_qwen3):
    scheduler = engine_core.scheduler
    prompt = (PROMPT * 12)[:130]  # not a multiple of the block size: a partial tail
    _add(engine_core, "own-1", prompt, max_tokens=5, spec=last_final_layer(hf_qwen3))
    # Not drained: the engine queued the extract, and the next step runs it.
    eco, generated = _run(engine_core, {"own-1"}, drain=False)["own-1"]
    sequence = prompt + generated

    assert eco.hidden_states_extract_queued  # the front-end holds it, sends nothing
    extract = scheduler.requests["own-1-hs"]
    assert list(extract.all_token_ids) == sequence
    assert extract.num_computed_tokens == len(sequence) - 1  # the blocks handed over
    assert "own-1" not in scheduler.requests and not scheduler.capture_planner.parked
    eco, _ = _run(engine_core, {"own-1-hs"})["own-1-hs"]
    final = hf_qwen3.num_layers
    assert_close(eco.captured.hidden[0], hf_qwen3.last(sequence, final), "layer L")


def test_engine_leaves_the_extract_of_a_request_with_stop_strings_to_the_front_end(
    engine_core, hf_qwen3
):
    _add(engine_core, "stops-1", PROMPT, max_tokens=3, spec=last_final_layer(hf_qwen3), stop=NEVER)
    eco, generated = _run(engine_core, {"stops-1"})["stops-1"]
    assert not eco.hidden_states_extract_queued
    assert "stops-1-hs" not in engine_core.scheduler.requests
    assert "stops-1" in engine_core.scheduler.capture_planner.parked  # waits for it
    final = hf_qwen3.num_layers
    engine_core.add_hidden_states_extracts([_extract("stops-1-hs", PROMPT + generated, [final])])
    _run(engine_core, {"stops-1-hs"})


def test_engine_leaves_plain_requests_without_an_extract(engine_core):
    _add(engine_core, "plain-2", PROMPT, max_tokens=3)
    eco, _ = _run(engine_core, {"plain-2"})["plain-2"]
    assert not eco.hidden_states_extract_queued
    assert "plain-2-hs" not in engine_core.scheduler.requests


@pytest.mark.four_modes
def test_last_extract_takes_over_the_finished_requests_kv_blocks(engine_core, hf_qwen3):
    hs = engine_core.scheduler.capture_planner
    prompt = (PROMPT * 12)[:130]  # not a multiple of the block size: a partial tail
    spec = last_final_layer(hf_qwen3)
    _add(engine_core, "park-1", prompt, max_tokens=5, spec=spec, stop=NEVER)
    _, generated = _run(engine_core, {"park-1"})["park-1"]
    assert "park-1" in hs.parked  # blocks kept for the extract
    sequence = prompt + generated

    final = hf_qwen3.num_layers
    engine_core.add_hidden_states_extracts([_extract("park-1-hs", sequence, [final, 2])])
    extract = engine_core.scheduler.requests["park-1-hs"]
    assert not hs.parked and "park-1" not in engine_core.scheduler.requests
    assert extract.num_computed_tokens == len(sequence) - 1  # one token to compute
    eco, _ = _run(engine_core, {"park-1-hs"})["park-1-hs"]

    ref = hf_qwen3.states(sequence)  # rows follow the extract's layer order
    assert_close(eco.captured.hidden[0], ref[final][-1:], "layer L")
    assert_close(eco.captured.hidden[1], ref[2][-1:], "layer 2")


def test_parked_blocks_without_an_extract_are_freed(engine_core, monkeypatch, hf_qwen3):
    from vllm_hidden_states.engine import planner

    hs = engine_core.scheduler.capture_planner
    spec = last_final_layer(hf_qwen3)
    _add(engine_core, "park-2", PROMPT, max_tokens=3, spec=spec, stop=NEVER)
    _run(engine_core, {"park-2"})
    assert "park-2" in hs.parked
    monkeypatch.setattr(planner, "PARK_SECONDS", 0.0)
    _add(engine_core, "after-2", PROMPT, max_tokens=2)  # any later step expires it
    _run(engine_core, {"after-2"})
    assert not hs.parked and "park-2" not in engine_core.scheduler.requests
