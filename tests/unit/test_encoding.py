# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.server.encoding (the wire format) and .errors (the error body)."""

import base64
from http import HTTPStatus

import numpy as np
import orjson
import pytest
import torch

from vllm_hidden_states.server.encoding import (
    ENCODING_FORMATS,
    ORJSON_OPTIONS,
    as_float32,
    dtype_name,
    encode_array,
    encoded_size_bytes,
)
from vllm_hidden_states.server.errors import ApiError, invalid_request

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]


def random_tensor(dtype: torch.dtype, shape=(5, 24), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def decode_base64_stdlib(text: str, shape) -> np.ndarray:
    """The documented client recipe, with the standard library only."""
    return np.frombuffer(base64.b64decode(text), "<f4").reshape(shape)


def special_bfloat16_values() -> torch.Tensor:
    """Random normals over many magnitudes plus zeros, subnormals, inf and nan."""
    g = torch.Generator().manual_seed(1)
    normals = torch.randn(512, generator=g) * torch.logspace(-30, 30, 512)
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            1e-39,
            -1e-39,
            9.2e-41,
            -9.2e-41,
            1e-45,
            float("inf"),
            float("-inf"),
            float("nan"),
            -float("nan"),
            3.3895e38,
            -3.3895e38,
        ]
    )
    return torch.cat([normals, specials]).to(torch.bfloat16)


def every_bfloat16() -> torch.Tensor:
    """All 65536 bfloat16 bit patterns (every nan payload included)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


def test_encoding_formats_are_float_and_base64():
    assert ENCODING_FORMATS == ("float", "base64")


@pytest.mark.parametrize("dtype, name", zip(DTYPES, DTYPE_IDS), ids=DTYPE_IDS)
def test_dtype_name_drops_the_torch_prefix(dtype, name):
    assert dtype_name(dtype) == name


# --------------------------------------------------------------------------
# "float"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float_encoding_is_a_float32_numpy_array(dtype):
    array = encode_array(random_tensor(dtype), "float")
    assert isinstance(array, np.ndarray)
    assert array.dtype == np.dtype("<f4")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float_encoding_equals_torch_float(dtype):
    tensor = random_tensor(dtype)
    np.testing.assert_array_equal(encode_array(tensor, "float"), tensor.float().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float_encoding_keeps_the_shape(dtype):
    tensor = random_tensor(dtype, shape=(3, 4, 5))
    assert encode_array(tensor, "float").shape == (3, 4, 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float_encoding_survives_orjson_exactly(dtype):
    tensor = random_tensor(dtype)
    text = orjson.dumps(encode_array(tensor, "float"), option=ORJSON_OPTIONS)
    decoded = np.asarray(orjson.loads(text), dtype=np.float32)
    np.testing.assert_array_equal(decoded, tensor.float().numpy())


# --------------------------------------------------------------------------
# "base64"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_base64_encoding_is_ascii_text(dtype):
    text = encode_array(random_tensor(dtype), "base64")
    assert isinstance(text, str)
    assert text.isascii()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_base64_decodes_with_the_stdlib_to_exactly_torch_float(dtype):
    tensor = random_tensor(dtype)
    decoded = decode_base64_stdlib(encode_array(tensor, "base64"), tensor.shape)
    np.testing.assert_array_equal(decoded, tensor.float().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_base64_is_four_little_endian_bytes_per_value(dtype):
    tensor = random_tensor(dtype)
    raw = base64.b64decode(encode_array(tensor, "base64"))
    assert raw == tensor.float().numpy().astype("<f4").tobytes()


def test_base64_keeps_nan_and_inf_bit_exact():
    tensor = special_bfloat16_values()
    decoded = decode_base64_stdlib(encode_array(tensor, "base64"), tensor.shape)
    np.testing.assert_array_equal(bits(decoded), bits(tensor.float().numpy()))


# --------------------------------------------------------------------------
# as_float32 (the bf16 widening)


def test_bfloat16_widening_is_bit_exact_on_random_and_special_values():
    tensor = special_bfloat16_values()
    assert tensor.isnan().any() and tensor.isinf().any() and (tensor < 0).any()
    np.testing.assert_array_equal(bits(as_float32(tensor)), bits(tensor.float().numpy()))


def test_bfloat16_widening_is_bit_exact_on_every_bit_pattern():
    tensor = every_bfloat16()
    np.testing.assert_array_equal(bits(as_float32(tensor)), bits(tensor.float().numpy()))


def test_bfloat16_widening_keeps_the_shape():
    tensor = random_tensor(torch.bfloat16, shape=(2, 3, 7))
    assert as_float32(tensor).shape == (2, 3, 7)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_as_float32_is_c_contiguous_little_endian_float32(dtype):
    array = as_float32(random_tensor(dtype))
    assert array.dtype == np.dtype("<f4")
    assert array.flags.c_contiguous


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_non_contiguous_input_encodes_its_logical_values_as_float(dtype):
    tensor = random_tensor(dtype, shape=(8, 12)).t()[:, ::3]
    assert not tensor.is_contiguous()
    np.testing.assert_array_equal(encode_array(tensor, "float"), tensor.float().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_non_contiguous_input_encodes_its_logical_values_as_base64(dtype):
    tensor = random_tensor(dtype, shape=(8, 12)).t()[:, ::3]
    assert not tensor.is_contiguous()
    decoded = decode_base64_stdlib(encode_array(tensor, "base64"), tensor.shape)
    np.testing.assert_array_equal(decoded, tensor.float().numpy())


def test_a_tensor_that_requires_grad_is_encoded():
    tensor = torch.randn(2, 3, requires_grad=True)
    np.testing.assert_array_equal(encode_array(tensor, "float"), tensor.detach().numpy())


# --------------------------------------------------------------------------
# encoded_size_bytes


@pytest.mark.parametrize("num_values", [0, 1, 2, 3, 4, 5, 100, 2560, 512 * 2560])
def test_encoded_size_is_exact_for_base64(num_values):
    text = encode_array(torch.zeros(num_values), "base64")
    assert encoded_size_bytes(num_values, "base64") == len(text)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_encoded_size_is_an_upper_bound_for_float_json_on_random_data(dtype):
    tensor = random_tensor(dtype, shape=(64, 256))
    body = orjson.dumps(encode_array(tensor, "float"), option=ORJSON_OPTIONS)
    assert len(body) <= encoded_size_bytes(tensor.numel(), "float")


def test_float_json_estimate_is_larger_than_base64():
    assert encoded_size_bytes(1000, "float") > encoded_size_bytes(1000, "base64")


# --------------------------------------------------------------------------
# ApiError


def test_api_error_body_has_the_openai_shape():
    body = ApiError("bad layer", param="hidden_states_layers").body()
    assert body == {
        "error": {
            "message": "bad layer",
            "type": "invalid_request_error",
            "param": "hidden_states_layers",
            "code": 400,
        }
    }


def test_api_error_body_code_is_a_plain_int_of_the_status():
    body = ApiError("gone", status=HTTPStatus.NOT_FOUND, type="model_not_found").body()
    assert body["error"]["code"] == 404
    assert type(body["error"]["code"]) is int
    assert body["error"]["type"] == "model_not_found"


def test_api_error_body_param_is_null_when_no_field_is_at_fault():
    body = ApiError("boom", status=HTTPStatus.INTERNAL_SERVER_ERROR, type="internal_error").body()
    assert body["error"]["param"] is None
    assert orjson.loads(orjson.dumps(body))["error"]["param"] is None


def test_api_error_str_is_its_message():
    assert str(ApiError("what was wrong")) == "what was wrong"


def test_invalid_request_is_a_400_invalid_request_error_naming_the_param():
    error = invalid_request("nope", "hidden_states_format")
    assert (error.status, error.type, error.param, error.message) == (
        HTTPStatus.BAD_REQUEST,
        "invalid_request_error",
        "hidden_states_format",
        "nope",
    )
