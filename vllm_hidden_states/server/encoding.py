# SPDX-License-Identifier: Apache-2.0
"""The HTTP wire format of hidden states (``client.py`` is the inverse).

* ``"float"``: nested JSON lists of float32 values, row-major over ``shape``,
  handed to orjson as numpy arrays (no Python float per value);
* ``"base64"``: base64 of the float32 little-endian bytes, row-major over
  ``shape`` (``np.frombuffer(base64.b64decode(data), "<f4").reshape(shape)``);
* binary (POST /v1/hidden_states only): one self-describing octet-stream
  body (:func:`binary_body`).

Whatever the model dtype, JSON values are float32; the model dtype is
reported separately as ``dtype``.
"""

from typing import Any, Literal

import numpy as np
import orjson
import pybase64
import torch

from vllm_hidden_states import bfloat16

ENCODING_FORMATS: tuple[str, ...] = ("float", "base64")
# Binary answers (POST /v1/hidden_states only): vLLM's pooling names.
EMBED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
ENDIANNESS: tuple[str, ...] = ("little", "big", "native")
OCTET_STREAM = "application/octet-stream"

# orjson options for every body that may carry hidden states: numpy arrays are
# written natively; non-str keys occur in some vLLM payloads (logprob maps).
ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def as_float32(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous little-endian float32 numpy view/copy of a CPU tensor.

    bfloat16 is widened in numpy (:func:`vllm_hidden_states.bfloat16.widen`):
    exact, and ~10x faster than torch's CPU cast on a [512, 2560] array, which
    dominated the base64 encode time.
    """
    tensor = tensor.detach().to(device="cpu").contiguous()
    if tensor.dtype == torch.bfloat16:
        array = bfloat16.widen(tensor.view(torch.int16).numpy().view(np.uint16))
    else:
        array = tensor.to(torch.float32).numpy()
    # x86 and aarch64 hosts are little-endian already: this is a no-op there.
    return array.astype("<f4", copy=False)


def encode_array(tensor: torch.Tensor, encoding_format: str) -> np.ndarray | str:
    """The ``data`` value for ``tensor`` in ``encoding_format``.

    Returns a float32 numpy array for ``"float"`` (serialize the body with
    :data:`ORJSON_OPTIONS`) or the base64 text for ``"base64"``.
    """
    array = as_float32(tensor)
    if encoding_format == "base64":
        # SIMD base64 (pybase64): ~40x the stdlib on a [512, 2560] array.
        return pybase64.b64encode_as_string(array.data)
    return array


def binary_array(tensor: torch.Tensor, embed_dtype: str, endianness: str) -> np.ndarray:
    """``tensor`` as a C-contiguous numpy array whose buffer is the wire bytes.

    float32 goes through :func:`as_float32` (exact bf16 widening); float16 and
    bfloat16 are cast in torch and sent as their 16 bits (numpy has no
    bfloat16, so that array is ``uint16``).
    """
    if embed_dtype == "float32":
        array = as_float32(tensor)
    else:
        tensor = tensor.detach().to(device="cpu", dtype=EMBED_DTYPES[embed_dtype])
        array = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    orders: dict[str, Literal["<", ">", "="]] = {"little": "<", "big": ">", "native": "="}
    order = orders[endianness]
    return array.astype(array.dtype.newbyteorder(order), copy=False)


BINARY_HEADER_LENGTH_BYTES = 8
BINARY_ALIGN_BYTES = 8


def binary_body(
    arrays: list[np.ndarray], items: list[dict[str, Any]], header: dict[str, Any]
) -> bytes:
    """The octet-stream body of a binary answer::

        offset 0       8 bytes   N, unsigned little-endian: the JSON header's length
        offset 8       N bytes   UTF-8 JSON header, padded with spaces so that
                                 8 + N is a multiple of 8 (arrays start aligned)
        offset 8 + N   ...       the arrays, back to back in input order

    The header is ``{"model", "layer", "dtype", "data": [{"index",
    "embed_dtype", "endianness", "start", "end", "shape"}, ...]}`` (plus
    ``"object": "list"`` for a list ``input`` and ``"attention_mask"`` per
    item on request); ``start``/``end`` are byte offsets from the first array.
    One body, so no client reads more than a few bytes of headers (httpx,
    requests and curl refuse header blocks past 64 KiB). ``client.from_bytes``
    is the inverse.

    Args:
        arrays: each input's wire array (:func:`binary_array`), in input order.
        items: one dict per array (``index``, ``embed_dtype``, ``endianness``,
            optionally ``attention_mask``); ``start``, ``end`` (bytes from the
            first array) and ``shape`` are added here.
        header: the header's other keys (``model``, ``layer``, ``dtype``, ...);
            ``data`` is set to ``items``.
    """
    start = 0
    for item, array in zip(items, arrays, strict=True):
        item.update(start=start, end=start + array.nbytes, shape=list(array.shape))
        start += array.nbytes
    text = orjson.dumps({**header, "data": items})
    pad = -(BINARY_HEADER_LENGTH_BYTES + len(text)) % BINARY_ALIGN_BYTES
    text += b" " * pad
    prefix = len(text).to_bytes(BINARY_HEADER_LENGTH_BYTES, "little")
    return b"".join([prefix, text, *(array.data for array in arrays)])


def value_bytes(encoding_format: str, embed_dtype: str = "float32") -> float:
    """Wire bytes per value: base64 exactly 16/3; JSON float at most 16;
    binary the dtype's size."""
    if encoding_format == "bytes":
        return float(EMBED_DTYPES[embed_dtype].itemsize)
    return 16 / 3 if encoding_format == "base64" else 16.0


def encoded_size_bytes(num_values: int, encoding_format: str) -> int:
    """How many bytes ``num_values`` float32 values take on the wire, at most.

    Exact for base64 (4 bytes per value, 4/3 expansion). For JSON floats an
    upper bound: a float32 in shortest round-trip form is at most 15
    characters (``-1.1754944e-38``), plus a separator; brackets of rows are
    far fewer than values and fit in the slack of typical values (10-12).
    """
    if encoding_format == "base64":
        return 4 * ((4 * num_values + 2) // 3)
    return 16 * num_values
