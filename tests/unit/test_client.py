# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.client: decoding every payload shape the server sends."""

import base64

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from vllm_hidden_states.client import to_numpy, to_torch
from vllm_hidden_states.server.encoding import dtype_name, encode_array

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]
FORMATS = ["float", "base64"]


def random_tensor(shape=(2, 16), dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def choice_states(tensor: torch.Tensor, fmt: str, layers=None) -> dict:
    """A choice's ``hidden_states`` object as the server builds it."""
    return {
        "layers": list(layers or range(-1, -tensor.shape[0] - 1, -1)),
        "shape": list(tensor.shape),
        "dtype": dtype_name(tensor.dtype),
        "encoding_format": fmt,
        "data": encode_array(tensor, fmt),
    }


def endpoint_response(tensor: torch.Tensor, fmt: str) -> dict:
    """A POST /v1/hidden_states response as the server builds it."""
    body = {
        "hidden_states": encode_array(tensor, fmt),
        "shape": list(tensor.shape),
        "model": "m",
        "layer": -2,
        "dtype": dtype_name(tensor.dtype),
    }
    if fmt == "base64":
        body["encoding_format"] = "base64"
    return body


class OpenAIStyleObject(BaseModel):
    """Like the openai client's types: pydantic, unknown fields kept."""

    model_config = ConfigDict(extra="allow")


class OpenAIStyleChoice(BaseModel):
    """Like the openai client's types: pydantic, unknown fields kept."""

    model_config = ConfigDict(extra="allow")

    index: int = 0
    finish_reason: str | None = "stop"


# --------------------------------------------------------------------------
# the accepted payload shapes


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_numpy_decodes_a_choices_hidden_states_object(fmt, wire):
    tensor = random_tensor()
    array = to_numpy(wire(choice_states(tensor, fmt)))
    np.testing.assert_array_equal(array, tensor.numpy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_numpy_unwraps_a_whole_choice_dict(fmt, wire):
    tensor = random_tensor()
    choice = {
        "index": 0,
        "finish_reason": "stop",
        "text": "hi",
        "hidden_states": choice_states(tensor, fmt),
    }
    np.testing.assert_array_equal(to_numpy(wire(choice)), tensor.numpy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_numpy_unwraps_a_hidden_states_only_wrapper(fmt, wire):
    tensor = random_tensor()
    wrapped = {"hidden_states": choice_states(tensor, fmt)}
    np.testing.assert_array_equal(to_numpy(wire(wrapped)), tensor.numpy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_numpy_accepts_a_pydantic_choice(fmt, wire):
    tensor = random_tensor()
    choice = OpenAIStyleChoice(hidden_states=wire(choice_states(tensor, fmt)))
    np.testing.assert_array_equal(to_numpy(choice), tensor.numpy())


def test_to_numpy_accepts_a_pydantic_hidden_states_object(wire):
    tensor = random_tensor()
    states = OpenAIStyleObject.model_validate(wire(choice_states(tensor, "base64")))
    np.testing.assert_array_equal(to_numpy(states), tensor.numpy())


def test_to_numpy_decodes_a_hidden_states_response_as_float_by_default(wire):
    tensor = random_tensor(shape=(7, 16))
    body = wire(endpoint_response(tensor, "float"))
    assert "encoding_format" not in body
    np.testing.assert_array_equal(to_numpy(body), tensor.numpy())


def test_to_numpy_decodes_a_base64_hidden_states_response(wire):
    tensor = random_tensor(shape=(7, 16))
    np.testing.assert_array_equal(
        to_numpy(wire(endpoint_response(tensor, "base64"))), tensor.numpy()
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_numpy_decodes_a_batch_to_a_list_in_order(fmt, wire):
    tensors = [random_tensor(shape=(n, 16), seed=n) for n in (3, 5, 1)]
    batch = {
        "object": "list",
        "model": "m",
        "data": [endpoint_response(t, fmt) for t in tensors],
    }
    arrays = to_numpy(wire(batch))
    assert isinstance(arrays, list) and len(arrays) == 3
    for array, tensor in zip(arrays, tensors):
        np.testing.assert_array_equal(array, tensor.numpy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_numpy_returns_float32_with_the_payloads_shape(fmt, wire):
    array = to_numpy(wire(choice_states(random_tensor(shape=(3, 8)), fmt)))
    assert array.dtype == np.float32
    assert array.shape == (3, 8)


def test_to_numpy_base64_result_is_writable():
    array = to_numpy(choice_states(random_tensor(), "base64"))
    array[0, 0] = 1.0
    assert array[0, 0] == 1.0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_round_trip_through_encode_array_is_exact(dtype, fmt, wire):
    tensor = random_tensor(shape=(4, 32), dtype=dtype)
    payload = wire(choice_states(tensor, fmt))
    assert payload["dtype"] == dtype_name(dtype)
    np.testing.assert_array_equal(to_numpy(payload), tensor.float().numpy())


# --------------------------------------------------------------------------
# to_torch


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_torch_gives_a_float32_tensor_equal_to_the_original(fmt, wire):
    tensor = random_tensor(dtype=torch.bfloat16)
    out = to_torch(wire(choice_states(tensor, fmt)))
    assert isinstance(out, torch.Tensor)
    assert out.dtype == torch.float32
    assert torch.equal(out, tensor.float())


def test_to_torch_gives_a_list_for_a_batch(wire):
    tensors = [random_tensor(shape=(n, 8), seed=n) for n in (2, 4)]
    batch = {
        "object": "list",
        "data": [endpoint_response(t, "base64") for t in tensors],
    }
    out = to_torch(wire(batch))
    assert isinstance(out, list)
    assert [o.shape for o in out] == [torch.Size([2, 8]), torch.Size([4, 8])]
    assert all(torch.equal(o, t) for o, t in zip(out, tensors))


# --------------------------------------------------------------------------
# errors


def test_null_hidden_states_in_a_choice_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no hidden states \(null\)"):
        to_numpy({"index": 0, "finish_reason": "abort", "hidden_states": None})


def test_null_hidden_states_in_a_pydantic_choice_is_a_clear_error():
    with pytest.raises(ValueError, match="no hidden states"):
        to_numpy(OpenAIStyleChoice(hidden_states=None))


def test_unknown_encoding_format_in_a_choice_is_named():
    payload = choice_states(random_tensor(), "float")
    payload["encoding_format"] = "hex"
    with pytest.raises(ValueError, match="unknown encoding_format 'hex'"):
        to_numpy(payload)


def test_unknown_encoding_format_in_a_hidden_states_response_is_named():
    body = endpoint_response(random_tensor(), "float")
    body["encoding_format"] = "int8"
    with pytest.raises(ValueError, match="unknown encoding_format 'int8'"):
        to_numpy(body)


def test_a_dict_without_hidden_states_is_not_a_payload_and_its_keys_are_listed():
    with pytest.raises(ValueError) as e:
        to_numpy({"id": "cmpl-1", "choices": []})
    assert "not a hidden-states payload" in str(e.value)
    assert "['choices', 'id']" in str(e.value)


@pytest.mark.parametrize("obj", [None, 3, "text", [1.0, 2.0]])
def test_an_object_that_is_neither_dict_nor_pydantic_is_a_type_error(obj):
    with pytest.raises(TypeError, match="expected a dict or a pydantic model"):
        to_numpy(obj)


@pytest.mark.parametrize("data", ["not base64!!", "AAA", "AAAA$AAA"])
def test_invalid_base64_is_a_value_error(data):
    payload = {
        "layers": [-1],
        "shape": [1, 1],
        "dtype": "float32",
        "encoding_format": "base64",
        "data": data,
    }
    with pytest.raises(ValueError):
        to_numpy(payload)


def test_base64_of_the_wrong_size_for_the_shape_is_a_value_error():
    data = base64.b64encode(np.zeros(3, "<f4").tobytes()).decode()
    payload = {
        "layers": [-1],
        "shape": [1, 4],
        "dtype": "float32",
        "encoding_format": "base64",
        "data": data,
    }
    with pytest.raises(ValueError):
        to_numpy(payload)


def test_client_import_needs_neither_torch_nor_vllm(modules_loaded_by):
    loaded = modules_loaded_by("vllm_hidden_states.client")
    assert "vllm_hidden_states" in loaded
    assert "torch" not in loaded
    assert "vllm" not in loaded


# --------------------------------------------------------------------------
# binary answers (encoding_format "bytes")


def binary_answer(tensors, embed_dtype="float32", endianness="little", listed=False):
    """The body of a binary answer, built by the server's own code."""
    from vllm_hidden_states.server.encoding import binary_array, binary_body

    arrays = [binary_array(t, embed_dtype, endianness) for t in tensors]
    items = [
        {"index": i, "embed_dtype": embed_dtype, "endianness": endianness}
        for i in range(len(arrays))
    ]
    header = {"model": "m", "layer": -2, "dtype": "float32"}
    if listed:
        header["object"] = "list"
    return binary_body(arrays, items, header)


@pytest.mark.parametrize("endianness", ["little", "big", "native"])
def test_from_bytes_float32_is_exact_in_every_byte_order(endianness):
    from vllm_hidden_states.client import from_bytes

    t = random_tensor((5, 16))
    body = binary_answer([t], endianness=endianness)
    assert np.array_equal(from_bytes(body), t.numpy())


@pytest.mark.parametrize("embed_dtype", ["float16", "bfloat16"])
def test_from_bytes_half_precision_widens_exactly(embed_dtype):
    from vllm_hidden_states.client import from_bytes

    t = random_tensor((3, 16)).to(getattr(torch, embed_dtype))
    body = binary_answer([t], embed_dtype=embed_dtype)
    assert body.endswith(t.view(torch.int16).numpy().tobytes())
    assert np.array_equal(from_bytes(body), t.float().numpy())


def test_from_bytes_of_a_list_input_is_a_list_even_of_one():
    from vllm_hidden_states.client import from_bytes

    tensors = [random_tensor((n, 16), seed=n) for n in (1, 4, 2)]
    body = binary_answer(tensors, listed=True)
    out = from_bytes(body)
    assert [a.shape for a in out] == [(1, 16), (4, 16), (2, 16)]
    for a, t in zip(out, tensors):
        assert np.array_equal(a, t.numpy())
    body1 = binary_answer(tensors[:1], listed=True)
    assert isinstance(from_bytes(body1), list)


def test_to_numpy_decodes_a_binary_http_response():
    import httpx

    t = random_tensor((3, 16))
    body = binary_answer([t])
    response = httpx.Response(
        200, content=body, headers={"content-type": "application/octet-stream"}
    )
    assert np.array_equal(to_numpy(response), t.numpy())
    assert torch.equal(to_torch(response), t)


def test_to_numpy_decodes_a_json_http_response():
    import httpx
    import orjson

    from vllm_hidden_states.server.encoding import ORJSON_OPTIONS

    t = random_tensor((3, 16))
    content = orjson.dumps(endpoint_response(t, "base64"), option=ORJSON_OPTIONS)
    response = httpx.Response(200, content=content, headers={"content-type": "application/json"})
    assert np.array_equal(to_numpy(response), t.numpy())


def test_binary_arrays_start_8_byte_aligned_after_the_length_prefixed_header():
    from vllm_hidden_states.client import read_binary_header

    tensors = [random_tensor((n, 16), seed=n) for n in (3, 5)]
    body = binary_answer(tensors, listed=True)
    length = int.from_bytes(body[:8], "little")
    assert (8 + length) % 8 == 0
    header, arrays = read_binary_header(body)
    assert [item["shape"] for item in header["data"]] == [[3, 16], [5, 16]]
    assert len(arrays) == sum(t.numel() * 4 for t in tensors)


def test_a_truncated_binary_body_is_a_clear_error():
    from vllm_hidden_states.client import from_bytes

    body = binary_answer([random_tensor((4, 16))])
    with pytest.raises(ValueError, match="truncated"):
        from_bytes(body[:-4])
    with pytest.raises(ValueError, match="truncated"):
        from_bytes(body[:12])
