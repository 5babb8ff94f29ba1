# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.server.body_inspection: request bodies measured before
parsing, against vllm_hidden_states.server.limits.

The counter, the parser's fallbacks, the walker (every limit named in its
refusal with its value and flag), the limits' configuration, and the ASGI
middleware driven directly (ASGI messages in, ASGI messages out).
"""

import argparse
import asyncio
import json
import threading
from http import HTTPStatus
from types import SimpleNamespace

import orjson
import pytest

from vllm_hidden_states.engine_args import add_cli_args
from vllm_hidden_states.server.body_inspection import (
    RequestBoundsMiddleware,
    count_values,
    inspect_body,
)
from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.limits import (
    BATCH_FLAG,
    BODY_FLAG,
    DEFAULT_MAX_LIST_ITEMS,
    DEPTH_FLAG,
    INPUT_ITEMS_FLAG,
    KEYS_FLAG,
    LIST_FLAG,
    MESSAGES_FLAG,
    VALUES_FLAG,
    Limits,
)

SMALL = Limits(
    max_body_bytes=10_000,
    max_json_values=1_000,
    max_json_depth=8,
    max_list_items=100,
    max_object_keys=50,
    max_messages=20,
    max_input_items=10,
    num_layers=4,
    max_batch=16,
)
CHAT = "/v1/chat/completions"


def refusal(body, route=CHAT, bounds=SMALL) -> ApiError:
    with pytest.raises(ApiError) as e:
        inspect_body(body if isinstance(body, bytes) else orjson.dumps(body), bounds, route)
    return e.value


def accepts(body, route=CHAT, bounds=SMALL) -> None:
    inspect_body(body if isinstance(body, bytes) else orjson.dumps(body), bounds, route)


# --------------------------------------------------------------------------
# Counting values before parsing


@pytest.mark.parametrize(
    "value",
    [[], {}, [1, 2, 3], {"a": [1, {"b": None}], "c": "x"}, [[[]]], "s", 7],
)
def test_count_values_counts_every_value_and_key_of_plain_json(value):
    def values(v):
        if isinstance(v, dict):
            return 1 + len(v) + sum(values(x) for x in v.values())
        if isinstance(v, list):
            return 1 + sum(values(x) for x in v)
        return 1

    # Empty containers count one more (no comma separates nothing): an upper
    # bound by at most one per empty container.
    counted = count_values(orjson.dumps(value), cap=0)
    assert values(value) <= counted <= values(value) + 3


def test_count_values_leaves_out_commas_and_brackets_inside_strings():
    body = orjson.dumps({"p": "a, [b], {c}, " * 1000, "q": [1, 2]})
    assert count_values(body, cap=10) == 7  # the root, "p", "q", their values, 1, 2


def test_count_values_handles_escaped_quotes_and_backslashes():
    body = json.dumps({"a": 'x,"[y', "b": "\\", "c": ['\\"', 1]}).encode()
    assert count_values(body, cap=0) == 9  # the root, 3 keys, 3 values, c[0], c[1]


def test_count_values_reads_utf16_bodies_like_json_loads():
    body = json.dumps({"a": "x,y,z", "b": [1, 2]}).encode("utf-16")
    assert json.loads(body) == {"a": "x,y,z", "b": [1, 2]}
    assert count_values(body, cap=0) == 7


def test_count_values_is_fast_path_when_under_the_cap():
    body = orjson.dumps({"p": "a,b,c"})
    # Under the cap: the cheap upper bound (commas in strings included).
    assert count_values(body, cap=100) == 5


# --------------------------------------------------------------------------
# Each limit: refused, named with its value and its flag


def test_too_many_json_values_are_refused_before_parsing():
    e = refusal(b"[" + b"1," * 1500 + b"1]")
    assert e.status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    assert "1502 values and keys" in e.message and "limit of 1000" in e.message
    assert VALUES_FLAG in e.message


def test_a_list_over_the_item_cap_is_refused_naming_its_field():
    e = refusal({"model": "m", "stop": ["x"] * 101})
    assert e.status == 413 and e.param == "stop"
    assert "'stop' is a list of 101 items" in e.message
    assert "limit of 100 items per list" in e.message and LIST_FLAG in e.message


def test_a_nested_list_over_the_item_cap_is_named_by_its_path():
    e = refusal({"tools": [{"function": {"parameters": {"enum": list(range(101))}}}]})
    assert e.param == "tools"
    assert "'tools'[0].function.parameters.enum is a list of 101 items" in e.message


def test_an_object_over_the_key_cap_is_refused():
    e = refusal({"model": "m", "logit_bias": {str(i): 1 for i in range(51)}})
    assert e.status == 413 and e.param == "logit_bias"
    assert "51 keys" in e.message and "limit of 50 keys per object" in e.message
    assert KEYS_FLAG in e.message


def test_object_keys_count_as_json_values():
    e = refusal(b"{" + b"".join(b'"k%d":1,' % i for i in range(600)) + b'"z":1}')
    assert "1203 values and keys" in e.message


def test_unknown_top_level_keys_count_against_the_key_cap():
    e = refusal({"model": "m", **{f"k{i}": 1 for i in range(60)}}, "/v1/hidden_states")
    assert e.param is None
    assert "the body is an object with 61 keys" in e.message


def test_nesting_past_the_depth_cap_is_a_400():
    value = 1
    for _ in range(9):
        value = [value]
    e = refusal({"x": value})
    assert e.status == HTTPStatus.BAD_REQUEST and e.param == "x"
    assert "nested 9 levels deep" in e.message
    assert "limit of 8" in e.message and DEPTH_FLAG in e.message


def test_nesting_past_orjsons_1024_levels_is_refused_not_passed_on():
    e = refusal(b"[" * 2000 + b"]" * 2000, bounds=Limits())
    assert e.status == 400 and "more than 1024 levels" in e.message
    assert DEPTH_FLAG in e.message


def test_messages_over_the_cap_are_refused_on_every_route():
    for route in (CHAT, "/v1/hidden_states", "/invocations", "/v1/messages"):
        e = refusal({"model": "m", "messages": [{}] * 21}, route)
        assert e.status == 413 and e.param == "messages"
        assert "'messages' holds 21 messages" in e.message
        assert "limit of 20 messages per request" in e.message and MESSAGES_FLAG in e.message


def test_messages_of_a_batch_are_summed_over_its_conversations():
    body = {"model": "m", "messages": [[{"role": "user", "content": "hi"}] * 7] * 3}
    e = refusal(body, "/v1/chat/completions/batch")
    assert "'messages' holds 21 messages" in e.message


def test_responses_input_items_over_their_cap_are_refused():
    e = refusal({"model": "m", "input": [{}] * 11}, "/v1/responses")
    assert e.status == 413 and e.param == "input"
    assert "'input' has 11 items" in e.message and INPUT_ITEMS_FLAG in e.message


def test_input_lists_elsewhere_are_not_response_items():
    accepts({"model": "m", "input": [[1, 2]] * 11}, "/v1/embeddings")


def test_hidden_states_inputs_over_the_batch_get_the_admission_refusal():
    e = refusal({"model": "m", "input": ["hi"] * 17}, "/v1/hidden_states")
    assert e.status == 413 and e.param == "input" and e.type == "invalid_request_error"
    assert "17 inputs" in e.message and "--hidden-states-max-batch" in e.message


def test_more_layers_than_the_model_has_get_the_admission_refusal():
    e = refusal({"model": "m", "prompt": "x", "hidden_states_layers": [-1] * 6}, "/v1/completions")
    assert e.status == 400 and e.param == "hidden_states_layers"
    assert "hidden_states_layers has 6 entries; this 4-layer model has 5 layers" in e.message


def test_layers_are_not_capped_when_the_model_is_unknown():
    bounds = Limits(num_layers=None)
    accepts({"model": "m", "hidden_states_layers": [-1] * 1000}, bounds=bounds)


def test_a_request_at_every_limit_is_accepted():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}] * 20,
        "stop": ["x"] * 100,
        "logit_bias": {str(i): 1 for i in range(50)},
        "nested": [[[[[[[1]]]]]]],  # depth 8 with the root object
    }
    accepts(body)


def test_a_body_that_is_not_json_is_left_to_the_route():
    accepts(b"{nope, [[[ {{{")
    accepts(b"")


def test_json_that_only_the_standard_library_reads_is_still_bounded():
    # NaN: orjson refuses it, starlette's json.loads reads it.
    e = refusal(b'{"x": NaN, "messages": [' + b"{}," * 20 + b"{}]}")
    assert "'messages' holds 21 messages" in e.message


def test_the_walk_names_deep_paths_briefly():
    value = [1] * 101
    for _ in range(8):
        value = {"k": value}
    e = refusal({"a": value}, bounds=Limits(max_list_items=100, max_json_depth=64))
    assert e.message.startswith("'a'.k.k.k.k.k.k.k...")


# --------------------------------------------------------------------------
# Configuration


def test_defaults_when_no_flag_is_given():
    b = Limits.from_args(SimpleNamespace(), None)
    assert b.max_body_bytes == 64 * 2**20
    assert (b.max_json_values, b.max_json_depth, b.max_list_items) == (2_000_000, 64, 65_536)
    assert (b.max_object_keys, b.max_messages, b.max_input_items) == (16_384, 8_192, 1_024)
    assert b.num_layers is None and b.max_batch == 256


def test_the_list_default_grows_to_max_model_len():
    model = SimpleNamespace(
        max_model_len=131_072, hf_text_config=SimpleNamespace(num_hidden_layers=36)
    )
    b = Limits.from_args(None, model)
    assert b.max_list_items == 131_072 and b.num_layers == 36
    small = SimpleNamespace(max_model_len=1024, hf_text_config=None)
    assert Limits.from_args(None, small).max_list_items == DEFAULT_MAX_LIST_ITEMS


def test_flags_parse_and_set_the_bounds():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            BODY_FLAG,
            "0.5",
            VALUES_FLAG,
            "10",
            DEPTH_FLAG,
            "3",
            LIST_FLAG,
            "4",
            KEYS_FLAG,
            "5",
            MESSAGES_FLAG,
            "6",
            INPUT_ITEMS_FLAG,
            "7",
        ]
    )
    b = Limits.from_args(args)
    assert b.max_body_bytes == 2**19
    assert (
        b.max_json_values,
        b.max_json_depth,
        b.max_list_items,
        b.max_object_keys,
        b.max_messages,
        b.max_input_items,
    ) == (10, 3, 4, 5, 6, 7)


def test_the_flags_are_on_the_engine_parser():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([MESSAGES_FLAG, "99"])
    assert args.request_max_messages == 99 and args.request_max_body_mb is None


@pytest.mark.parametrize("value", [0, -1, "x"])
def test_a_non_positive_flag_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=MESSAGES_FLAG):
        Limits.from_args(SimpleNamespace(request_max_messages=value))


# --------------------------------------------------------------------------
# The middleware, driven as ASGI


class App:
    """The downstream app: records what it receives, answers 200."""

    def __init__(self):
        self.received: list[dict] = []
        self.called = False

    async def __call__(self, scope, receive, send):
        self.called = True
        while True:
            message = await receive()
            self.received.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def drive(messages, headers=(), method="POST", path=CHAT, bounds=SMALL):
    """Run the middleware over ``messages``; (app, sent, messages left unread)."""
    app = App()
    pending = list(messages)
    sent: list[dict] = []

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in headers],
    }
    asyncio.run(RequestBoundsMiddleware(app, bounds)(scope, receive, send))
    return app, sent, pending


def body_message(body: bytes, more: bool = False) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def answer(sent) -> tuple[int, dict]:
    return sent[0]["status"], orjson.loads(sent[1]["body"])


def test_an_accepted_body_reaches_the_app_byte_for_byte_in_one_message():
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    parts = [
        body_message(body[:10], True),
        body_message(body[10:30], True),
        body_message(body[30:]),
    ]
    app, sent, _ = drive(parts, [("content-type", "application/json")])
    assert app.received == [{"type": "http.request", "body": body, "more_body": False}]
    assert sent[0]["status"] == 200


def test_a_content_length_over_the_cap_is_refused_without_reading_the_body():
    parts = [body_message(b"x" * 100)]
    app, sent, unread = drive(parts, [("content-length", "10001")])
    status, error = answer(sent)
    assert status == 413 and not app.called
    assert unread == parts  # never read
    assert (b"connection", b"close") in sent[0]["headers"]
    assert "10001 bytes" in error["error"]["message"] and BODY_FLAG in error["error"]["message"]


def test_a_streamed_body_is_refused_once_past_the_cap():
    parts = [body_message(b" " * 4000, True) for _ in range(5)]
    app, sent, unread = drive(parts)
    status, error = answer(sent)
    assert status == 413 and not app.called
    assert len(unread) == 2  # refused at the third chunk (12000 > 10000)
    assert "more than 12000 bytes" in error["error"]["message"]


def test_a_refusal_is_an_openai_error_body():
    _, sent, _ = drive([body_message(orjson.dumps({"messages": [{}] * 21}))])
    status, body = answer(sent)
    assert status == 413
    assert body == {
        "error": {
            "message": body["error"]["message"],
            "type": "Request Entity Too Large",
            "param": "messages",
            "code": 413,
        }
    }
    assert dict(sent[0]["headers"])[b"content-type"] == b"application/json"


def test_a_disconnect_during_upload_is_passed_on_with_the_partial_body():
    parts = [body_message(b'{"model": "x", "in', True), {"type": "http.disconnect"}]
    app, sent, _ = drive(parts)
    assert app.received == [body_message(b'{"model": "x", "in', True), {"type": "http.disconnect"}]


def test_get_requests_pass_through_unread():
    parts = [body_message(b"")]
    app, sent, unread = drive(parts, method="GET", path="/health")
    assert app.called and app.received == parts and sent[0]["status"] == 200


def test_multipart_bodies_are_size_capped_but_not_parsed():
    body = b'{"messages": [' + b"{}," * 30 + b"{}]}"  # over the messages cap as JSON
    app, sent, _ = drive(
        [body_message(body)], [("content-type", "multipart/form-data; boundary=x")]
    )
    assert app.called and sent[0]["status"] == 200
    _, sent, _ = drive([body_message(b"x" * 10_001)], [("content-type", "multipart/form-data")])
    assert sent[0]["status"] == 413


def test_bodies_without_a_content_type_are_inspected_too():
    _, sent, _ = drive([body_message(orjson.dumps({"messages": [{}] * 21}))])
    assert sent[0]["status"] == 413


def test_large_bodies_are_inspected_off_the_event_loop(monkeypatch):
    import vllm_hidden_states.server.body_inspection as bounds_module

    threads = []
    real = bounds_module.inspect_body

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(bounds_module, "inspect_body", spy)
    small = Limits(off_loop_bytes=100)
    drive([body_message(orjson.dumps({"a": "x" * 10}))], bounds=small)
    drive([body_message(orjson.dumps({"a": "x" * 200}))], bounds=small)
    assert threads[0] == threading.get_ident()  # under 100 bytes: on the loop
    assert threads[1] != threading.get_ident()  # a worker thread


def test_the_hidden_states_input_cap_follows_the_admission_batch_flag():
    assert Limits.from_args(SimpleNamespace(hidden_states_max_batch=8)).max_batch == 8
    e = refusal({"model": "m", "input": ["hi"] * 9}, "/v1/hidden_states", Limits(max_batch=8))
    assert e.status == 413 and "8 per request" in e.message


@pytest.mark.parametrize("value", [0, -1])
def test_a_non_positive_admission_flag_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=BATCH_FLAG):
        Limits.from_args(SimpleNamespace(hidden_states_max_batch=value))
