# SPDX-License-Identifier: Apache-2.0
"""The extract that completes a finished request's capture, the same whether
the engine queues it or the front-end sends it (``wire.extract_for``)."""

from vllm_hidden_states.wire import HiddenStatesSpec, extract_for

SEQUENCE = list(range(3, 23))  # prompt + output, 20 tokens


def test_a_last_request_extracts_its_final_token_at_each_distinct_layer():
    spec = HiddenStatesSpec(layers=[-1, 2, 4], abs_layers=[4, 2, 4], positions="last")
    extract = extract_for(spec, "req", SEQUENCE)
    assert extract.request_id == "req-hs"
    assert extract.token_ids == SEQUENCE
    assert (extract.positions, extract.layers) == ("last", [2, 4])


def test_inline_all_extracts_only_the_final_token():
    spec = HiddenStatesSpec(layers=[1], abs_layers=[1], positions="all", inline=True)
    assert extract_for(spec, "req", SEQUENCE).positions == "last"


def test_all_without_inline_capture_recomputes_every_position():
    spec = HiddenStatesSpec(layers=[1], abs_layers=[1], positions="all", start=4, end=9)
    extract = extract_for(spec, "req", SEQUENCE)
    # The window is cut from the rows on the front-end (HiddenStatesTracker.finish).
    assert (extract.positions, extract.start, extract.end) == ("all", 0, None)


def test_a_last_attention_pattern_recomputes_every_key_and_returns_the_final_query():
    spec = HiddenStatesSpec(layers=[], abs_layers=[], positions="last", pattern_ids=[40])
    extract = extract_for(spec, "req", SEQUENCE)
    assert (extract.positions, extract.start, extract.end) == ("all", 19, None)
    assert extract.patterns == [40]


def test_an_attention_pattern_window_is_cut_by_the_extract():
    spec = HiddenStatesSpec(
        layers=[], abs_layers=[], positions="all", pattern_ids=[40], start=25, end=30
    )
    extract = extract_for(spec, "req", SEQUENCE)
    assert (extract.start, extract.end) == (20, 30)  # the start clamped to the sequence


def test_the_extract_replays_the_requests_steering_salt_and_priority():
    spec = HiddenStatesSpec(layers=[-1], abs_layers=[4])
    steering = [{"point": "resid_pre.1", "op": "add", "name": "v", "strength": 2.0}]
    extract = extract_for(
        spec, "req", SEQUENCE, cache_salt="salt", priority=3, steering=steering, client_index=2
    )
    assert (extract.cache_salt, extract.priority, extract.client_index) == ("salt", 3, 2)
    assert extract.steering == steering
