# SPDX-License-Identifier: Apache-2.0
"""Decode hidden states returned by the server into numpy arrays or torch tensors.

Accepts, for both encodings (``"float"`` and ``"base64"``):

* a choice's ``hidden_states`` object from /v1/chat/completions or
  /v1/completions (``{"layers", "shape", "dtype", "encoding_format",
  "data"}``), as a dict or as the openai client's choice object;
* a POST /v1/hidden_states response (``{"hidden_states", "shape", ...}``);
* a batch response (``{"object": "list", "data": [...]}``), giving a list.

Values come back as float32 with the server's ``shape``: ``[len(layers),
hidden_size]`` for a choice (rows in the order of ``layers``), ``[seq_len,
hidden_size]`` for /v1/hidden_states. ``dtype`` in the payload is the model's
dtype before encoding.

Example::

    from openai import OpenAI
    from vllm_hidden_states.client import to_numpy

    r = OpenAI(base_url="http://localhost:8000/v1", api_key="-").completions.create(
        model=MODEL, prompt="Hello", max_tokens=4,
        extra_body={"return_hidden_states": True, "hidden_states_layers": [-1, -2]})
    states = to_numpy(r.choices[0])          # [2, hidden_size] float32
"""

import pybase64
from typing import Any

import numpy as np


def _as_dict(obj: Any) -> dict[str, Any]:
    """A plain dict from a dict or a pydantic model (the openai client's types)."""
    if isinstance(obj, dict):
        return obj
    dump = getattr(obj, "model_dump", None)
    if dump is None:
        raise TypeError(
            "expected a dict or a pydantic model holding hidden states, got "
            f"{type(obj).__name__}"
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
    raise ValueError(
        f"unknown encoding_format {encoding_format!r}; expected 'float' or 'base64'"
    )


def to_numpy(obj: Any) -> np.ndarray | list[np.ndarray]:
    """Float32 array(s) from a hidden-states payload (see the module docstring)."""
    payload = _as_dict(obj)
    if payload.get("object") == "list":
        return [to_numpy(item) for item in payload["data"]]
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
        return [torch.from_numpy(a) for a in arrays]
    return torch.from_numpy(arrays)
