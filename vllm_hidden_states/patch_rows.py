# SPDX-License-Identifier: Apache-2.0
"""The rows of a ``patch`` intervention: their forms on the request, their
wire form, and the encoding HTTP clients send.

A request gives a patch's rows ``[n, hidden_size]`` as an array (numpy,
nested lists) or, over HTTP without JSON floats, as a typed array
``{"dtype": "float32" | "float16", "shape": [n, hidden_size], "data":
base64 of the little-endian values}`` (:func:`encode_rows`). On the wire to
the worker they are the float32 little-endian bytes (:func:`rows_bytes`).
Imports nothing from vLLM.
"""

import base64
import binascii
from typing import Any

import numpy as np

# The typed-array form's dtypes (little-endian, as numpy writes them).
ROWS_DTYPES: dict[str, str] = {"float32": "<f4", "float16": "<f2"}
ROWS_FORM = (
    '[n, hidden_size] numbers, or {"dtype": "float32"|"float16", "shape": '
    '[n, hidden_size], "data": base64 of the little-endian values}'
)


def encode_rows(rows: Any, dtype: str = "float32") -> dict[str, Any]:
    """The typed-array form of ``rows`` (``[n, hidden_size]``, any array
    like), for a request's ``rows`` over HTTP."""
    if dtype not in ROWS_DTYPES:
        raise ValueError(f"dtype must be one of {list(ROWS_DTYPES)}, got {dtype!r}")
    array = np.ascontiguousarray(np.asarray(rows, dtype=ROWS_DTYPES[dtype]))
    return {
        "dtype": dtype,
        "shape": list(array.shape),
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
    }


def _as_array(value: Any, form: str) -> np.ndarray:
    """``value`` (typed array, tensor, numpy, nested lists) as a numpy array
    of numbers; ValueError naming ``form``."""
    if isinstance(value, dict):
        return _typed_array(value)
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().float().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "fiu":
            raise ValueError(f"must be numbers, got an array of {value.dtype}; {form}")
        return value
    if isinstance(value, (list, tuple)):
        try:
            return np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"must be {form}") from None
    raise ValueError(f"must be {form}, got {type(value).__name__}")


def _finite32(array: np.ndarray) -> np.ndarray:
    out = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(out).all():
        raise ValueError("must be finite (no NaN or infinity, also after rounding to float32)")
    return out


def decode_rows(
    value: Any, hidden_size: int, width_name: str = "hidden_size", heads: int = 0
) -> np.ndarray:
    """``value`` (see module doc) as float32 ``[n, hidden_size]``, every
    value finite; ValueError saying what was wrong and what is allowed
    (``width_name``: what the width is, heads * head_dim at attn_z).
    ``heads`` (attn_z): ``[n, heads, hidden_size / heads]``, as captured,
    is taken too, flattened."""
    array = _as_array(value, ROWS_FORM)
    if heads and array.ndim == 3 and array.shape[1:] == (heads, hidden_size // heads):
        array = array.reshape(array.shape[0], hidden_size)
    if array.ndim != 2 or array.shape[1] != hidden_size or array.shape[0] < 1:
        also = f" or [n, {heads}, {hidden_size // heads}] (as captured)" if heads else ""
        raise ValueError(
            f"must be [n, {hidden_size}]{also} (n >= 1 positions; {hidden_size} is the "
            f"point's width, {width_name}), got shape {list(array.shape)}"
        )
    return _finite32(array)


def decode_head_rows(value: Any, heads: int, head_dim: int) -> np.ndarray:
    """A per-head patch's ``rows`` as float32 ``[n, heads, head_dim]`` (the
    forms of :func:`decode_rows` with a 3-D shape), every value finite."""
    form = (
        f"[n, {heads}, {head_dim}] numbers (positions, heads given, head_dim), or "
        f'{{"dtype": "float32"|"float16", "shape": [n, {heads}, {head_dim}], "data": '
        "base64 of the little-endian values}"
    )
    array = _as_array(value, form)
    if array.ndim != 3 or array.shape[1:] != (heads, head_dim) or array.shape[0] < 1:
        raise ValueError(f"must be {form}; got shape {list(array.shape)}")
    return _finite32(array)


def decode_head_values(value: Any, heads: int, head_dim: int) -> np.ndarray:
    """An ablate_heads ``mean`` as float32 ``[heads, head_dim]`` (one row per
    head given, the same at every position), every value finite."""
    form = f"[{heads}, {head_dim}] numbers (one row of head_dim values per head given)"
    array = _as_array(value, form)
    if array.shape != (heads, head_dim):
        raise ValueError(f"must be {form}; got shape {list(array.shape)}")
    return _finite32(array)


def _typed_array(value: dict[str, Any]) -> np.ndarray:
    keys = {"dtype", "shape", "data"}
    if set(value) != keys:
        raise ValueError(f"a typed array has exactly the keys {sorted(keys)}; got {sorted(value)}")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype not in ROWS_DTYPES:
        raise ValueError(f"dtype must be one of {list(ROWS_DTYPES)}, got {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) not in (2, 3)
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
    ):
        raise ValueError(
            "shape must be [n, hidden_size] (or, for per-head rows, [n, heads, head_dim]): "
            f"integers, got {shape!r}"
        )
    if not isinstance(data, str):
        raise ValueError("data must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("data is not valid base64") from None
    itemsize = np.dtype(ROWS_DTYPES[dtype]).itemsize
    count = int(np.prod(shape))
    if len(raw) != count * itemsize:
        raise ValueError(
            f"data holds {len(raw)} bytes; shape {shape} of {dtype} needs {count * itemsize}"
        )
    return np.frombuffer(raw, dtype=ROWS_DTYPES[dtype]).reshape(shape)


def rows_bytes(rows: np.ndarray) -> bytes:
    """The wire form: float32 little-endian, row after row."""
    return np.ascontiguousarray(rows, dtype="<f4").tobytes()


def rows_of_bytes(data: bytes, hidden_size: int) -> np.ndarray:
    """The wire form back as float32 ``[n, hidden_size]`` (a read-only view;
    ``hidden_size``: the point's width, heads * head_dim at attn_z)."""
    return np.frombuffer(data, dtype="<f4").reshape(-1, hidden_size)
