# SPDX-License-Identifier: Apache-2.0
"""POST /v1/hidden_states: the answer format settled between the body's
``encoding_format`` and the ``Accept`` header (no server needed)."""

import pytest

from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.hidden_states_route import negotiate, parse_request

OCTET = "application/octet-stream"


def request(**fields):
    import orjson

    return parse_request(orjson.dumps({"model": "m", "input": "x", **fields}))


@pytest.mark.parametrize("accept", [None, "", "*/*", "application/*", "application/json"])
def test_json_is_kept_when_accept_allows_it(accept):
    assert negotiate(request(), accept).encoding_format == "float"


@pytest.mark.parametrize(
    "accept",
    [
        OCTET,
        f"{OCTET}; q=1",
        f"{OCTET}, application/json;q=0",
        "application/json;q=0, */*",
        "application/json; q=0.0, application/*",
        f"application/json;q=0.5, {OCTET}",
    ],
)
def test_accept_octet_stream_alone_picks_bytes(accept):
    assert negotiate(request(), accept).encoding_format == "bytes"


@pytest.mark.parametrize("accept", [f"application/json, {OCTET}", f"{OCTET};q=0, */*"])
def test_accept_with_both_keeps_the_default_json(accept):
    assert negotiate(request(), accept).encoding_format == "float"


@pytest.mark.parametrize("accept", [OCTET, "*/*", None])
def test_bytes_format_is_kept_when_accept_allows_octet_stream(accept):
    assert negotiate(request(encoding_format="bytes"), accept).encoding_format == "bytes"


@pytest.mark.parametrize(
    "fields, accept, wanted",
    [
        ({}, "text/html", "application/json"),
        ({"encoding_format": "bytes"}, "application/json", OCTET),
        ({"encoding_format": "base64"}, OCTET, "application/json"),
        ({}, f"{OCTET};q=0, text/plain", "application/json"),
        ({"encoding_format": "float"}, "application/json;q=0, */*", "application/json"),
        ({"encoding_format": "bytes"}, f"{OCTET};q=0, */*", OCTET),
    ],
    ids=[
        "neither",
        "bytes-vs-json",
        "base64-vs-octet",
        "q0",
        "json-q0-over-any",
        "octet-q0-over-any",
    ],
)
def test_contradicting_accept_is_a_406_naming_what_to_send(fields, accept, wanted):
    with pytest.raises(ApiError) as e:
        negotiate(request(**fields), accept)
    assert int(e.value.status) == 406 and e.value.param == "Accept"
    assert wanted in e.value.message


@pytest.mark.parametrize("field, value", [("embed_dtype", "bfloat16"), ("endianness", "big")])
def test_binary_only_fields_need_the_bytes_format(field, value):
    with pytest.raises(ApiError) as e:
        request(**{field: value})
    assert field in e.value.message and "'bytes'" in e.value.message


@pytest.mark.parametrize("embed_dtype", ["float64", "fp8_e4m3", "int8"])
def test_unknown_embed_dtype_is_a_400_listing_the_dtypes(embed_dtype):
    with pytest.raises(ApiError) as e:
        request(encoding_format="bytes", embed_dtype=embed_dtype)
    assert e.value.param == "embed_dtype" and "bfloat16" in e.value.message
