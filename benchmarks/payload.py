# SPDX-License-Identifier: Apache-2.0
"""Wire payload of hidden states: float JSON vs base64.

For a ``[512, 2560]`` array (Z-Image: 512 tokens of Qwen3-4B) and a
``[4096, 4096]`` one: server-side encode time (array -> JSON bytes with orjson,
as the server does), bytes on the wire, and client-side decode time
(JSON bytes -> float32 numpy via ``vllm_hidden_states.client``). Milliseconds,
medians over rounds; "round trip" = encode + decode of the whole JSON body;
"codec only" = the same without the JSON framing (tensor -> ``data`` value ->
array), i.e. what the encoding itself costs.
"""

import statistics
import time

import orjson
import torch

from vllm_hidden_states.client import to_numpy
from vllm_hidden_states.server.encoding import ORJSON_OPTIONS, encode_array

SHAPES = ((512, 2560), (4096, 4096))


def _codec(tensor: torch.Tensor, fmt: str) -> float:
    """ms for tensor -> data value -> float32 array, without the JSON framing."""
    start = time.perf_counter()
    data = encode_array(tensor, fmt)
    if fmt == "float":
        data = orjson.loads(orjson.dumps(data, option=ORJSON_OPTIONS))
    to_numpy({"hidden_states": data, "shape": list(tensor.shape), "encoding_format": fmt})
    return (time.perf_counter() - start) * 1e3


def _once(tensor: torch.Tensor, fmt: str) -> tuple[float, float, int]:
    start = time.perf_counter()
    body = orjson.dumps(
        {"hidden_states": encode_array(tensor, fmt), "shape": list(tensor.shape),
         "dtype": "bfloat16", "encoding_format": fmt},
        option=ORJSON_OPTIONS)
    encoded = time.perf_counter()
    array = to_numpy(orjson.loads(body))
    decoded = time.perf_counter()
    assert array.shape == tuple(tensor.shape)
    return (encoded - start) * 1e3, (decoded - encoded) * 1e3, len(body)


def run(rounds: int, quick: bool) -> list[dict]:
    results = []
    for shape in SHAPES[:1] if quick else SHAPES:
        # bf16 source, as a Qwen3-4B server would hold it.
        tensor = torch.randn(*shape).to(torch.bfloat16)
        for fmt in ("float", "base64"):
            samples = [_once(tensor, fmt) for _ in range(max(rounds, 3))]
            codec = statistics.median(_codec(tensor, fmt) for _ in range(max(rounds, 3)))
            enc = statistics.median(s[0] for s in samples)
            dec = statistics.median(s[1] for s in samples)
            results.append({
                "shape": list(shape), "encoding_format": fmt,
                "encode_ms": enc, "decode_ms": dec, "round_trip_ms": enc + dec,
                "bytes": samples[0][2], "codec_round_trip_ms": codec,
                "target_round_trip_ms": 10.0 if (shape == (512, 2560) and fmt == "base64") else None,
            })
    return results


def lines(results: list[dict]) -> list[str]:
    rows = ["payload: float JSON vs base64 (ms, median)",
            f"  {'shape':<13s} {'format':<7s} {'encode':>9s} {'decode':>9s} {'round trip':>11s} {'MB on wire':>11s} {'codec only':>11s}"]
    for r in results:
        row = (f"  {str(r['shape']):<13s} {r['encoding_format']:<7s} {r['encode_ms']:>9.1f} "
               f"{r['decode_ms']:>9.1f} {r['round_trip_ms']:>11.1f} {r['bytes'] / 2**20:>11.1f} "
               f"{r['codec_round_trip_ms']:>11.1f}")
        if r["target_round_trip_ms"] is not None:
            ok = r["round_trip_ms"] <= r["target_round_trip_ms"]
            row += f"   target <= {r['target_round_trip_ms']:.0f} ms: {'MET' if ok else 'MISSED'}"
        rows.append(row)
    return rows
