# SPDX-License-Identifier: Apache-2.0
"""Decode hidden states returned by the server into numpy arrays or torch tensors.

Accepts a choice's ``hidden_states`` object (dict or openai client object), a
POST /v1/hidden_states response, a batch response, and the binary answer
(``encoding_format: "bytes"``: the HTTP response or its body,
:func:`from_bytes`), in either JSON encoding ("float", "base64"). Values come
back as float32 with the server's ``shape``. Usage and the wire format:
docs/openai_server.md.
"""

from typing import Any, cast

import numpy as np
import pybase64

from vllm_hidden_states import bfloat16


def _as_dict(obj: Any) -> dict[str, Any]:
    """A plain dict from a dict or a pydantic model (the openai client's types)."""
    if isinstance(obj, dict):
        return obj
    dump = getattr(obj, "model_dump", None)
    if dump is None:
        raise TypeError(
            f"expected a dict or a pydantic model holding hidden states, got {type(obj).__name__}"
        )
    return dump()


def _decode(data: Any, shape: list[int], encoding_format: str) -> np.ndarray:
    if encoding_format == "base64":
        # pybase64 decodes str input directly (no ascii round trip), SIMD.
        raw = pybase64.b64decode(data, validate=True)
        # astype copies: the result is writable and in native byte order.
        return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
    if encoding_format == "float":
        return np.asarray(data, dtype=np.float32).reshape(shape)
    raise ValueError(f"unknown encoding_format {encoding_format!r}; expected 'float' or 'base64'")


_BINARY_DTYPES = {"float32": "f4", "float16": "f2", "bfloat16": "u2"}
_ORDER = {"little": "<", "big": ">", "native": "="}


_HEADER_LENGTH_BYTES = 8


def _binary_item(arrays: memoryview, item: dict[str, Any]) -> np.ndarray:
    kind = item.get("embed_dtype", "float32")
    if kind not in _BINARY_DTYPES:
        raise ValueError(f"unknown embed_dtype {kind!r}; expected one of {list(_BINARY_DTYPES)}")
    dtype: np.dtype = np.dtype(_ORDER[item.get("endianness", "little")] + _BINARY_DTYPES[kind])
    start, end = item["start"], item["end"]
    if not 0 <= start <= end <= len(arrays):
        raise ValueError(
            f"array {item.get('index')} spans bytes {start}..{end}, outside the "
            f"{len(arrays)} bytes of arrays in this body (truncated?)"
        )
    array = np.frombuffer(arrays[start:end], dtype=dtype).reshape(item["shape"])
    if kind == "bfloat16":  # bf16 is float32's upper half: exact widening
        return bfloat16.widen(array)
    if dtype != np.dtype("<f4") and dtype != np.dtype("=f4"):
        return array.astype(np.float32)
    return array


def read_binary_header(body: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The JSON header of a binary answer, and a view of its arrays.

    Layout: bytes 0..8 hold N (unsigned little-endian), the next N bytes the
    UTF-8 JSON header (space-padded), the rest the arrays; each ``data`` item's
    ``start``/``end`` are byte offsets into that rest.
    """
    import orjson

    view = memoryview(body).cast("B")
    if len(view) < _HEADER_LENGTH_BYTES:
        raise ValueError(
            f"a binary answer starts with 8 bytes of header length; got {len(view)} bytes"
        )
    length = int.from_bytes(view[:_HEADER_LENGTH_BYTES], "little")
    end = _HEADER_LENGTH_BYTES + length
    if end > len(view):
        raise ValueError(
            f"the binary answer's header claims {length} bytes but the body has "
            f"{len(view) - _HEADER_LENGTH_BYTES} after the length (truncated, or "
            "not a /v1/hidden_states binary answer)"
        )
    return orjson.loads(view[_HEADER_LENGTH_BYTES:end]), view[end:]


def from_bytes(body: bytes | memoryview) -> np.ndarray | list[np.ndarray]:
    """Float32 array(s) from the body of a binary POST /v1/hidden_states answer.

    Returns a list in input order when the request's ``input`` was a list
    (``"object": "list"`` in the header), else one ``[seq_len, hidden]`` array.
    """
    header, arrays = read_binary_header(body)
    out = [_binary_item(arrays, item) for item in header["data"]]
    return out if header.get("object") == "list" else out[0]


def _from_response(response: Any) -> np.ndarray | list[np.ndarray]:
    headers = response.headers
    content_type = (headers.get("content-type") or "").split(";")[0].strip()
    if content_type == "application/octet-stream":
        return from_bytes(response.content)
    import orjson

    return to_numpy(orjson.loads(response.content))


def to_numpy(obj: Any) -> np.ndarray | list[np.ndarray]:
    """Float32 array(s) from a hidden-states payload (see the module docstring)."""
    if hasattr(obj, "headers") and hasattr(obj, "content"):
        return _from_response(obj)
    payload = _as_dict(obj)
    if payload.get("object") == "list":
        # Items of a list are single payloads: one array each.
        return [cast(np.ndarray, to_numpy(item)) for item in payload["data"]]
    if "hidden_states" in payload and "shape" not in payload:
        # A choice (or a choice dumped from the openai client): unwrap it.
        inner = payload["hidden_states"]
        if inner is None:
            raise ValueError("this choice carries no hidden states (null)")
        payload = _as_dict(inner)
    if "hidden_states" in payload:  # /v1/hidden_states: float unless stated
        return _decode(
            payload["hidden_states"],
            payload["shape"],
            payload.get("encoding_format", "float"),
        )
    if "data" in payload:  # a choice's hidden_states object
        return _decode(payload["data"], payload["shape"], payload["encoding_format"])
    raise ValueError(
        "not a hidden-states payload: expected 'data' (a choice's hidden_states), "
        "'hidden_states' (/v1/hidden_states) or object='list', got keys "
        f"{sorted(payload)}"
    )


def to_torch(obj: Any):
    """Like :func:`to_numpy`, as float32 ``torch.Tensor`` (or a list of them)."""
    import torch

    arrays = to_numpy(obj)
    if isinstance(arrays, list):
        return [torch.from_numpy(_writable(a)) for a in arrays]
    return torch.from_numpy(_writable(arrays))


def _writable(array: np.ndarray) -> np.ndarray:
    # torch warns on read-only buffers (binary views): copy those.
    return array if array.flags.writeable else array.copy()


def probe_scores(obj: Any) -> dict[str, np.ndarray]:
    """``{probe name: float32 [positions, k]}`` from a choice (or streamed
    chunk's choice) carrying ``probe_scores``, or from the ``probe_scores``
    object itself (dicts or openai client objects), in either encoding."""
    data = _as_dict(obj)
    if "probe_scores" in data:  # a choice (openai objects dump their extras too)
        data = data["probe_scores"]
    if not data:
        raise ValueError("no probe_scores here: ask with 'probes' (the server needs --probes)")
    return {
        name: _decode(entry["data"], entry["shape"], entry["encoding_format"])
        for name, entry in data.items()
    }
