# SPDX-License-Identifier: Apache-2.0
"""Wire payload of hidden states: float JSON vs base64 vs binary.

For a ``[512, 2560]`` array (Z-Image: 512 tokens of Qwen3-4B) and a
``[4096, 4096]`` one: server-side encode time (array -> body bytes as the
server does: orjson for JSON, :func:`binary_array` for ``bytes``), bytes on
the wire, the transfer of the body over a loopback TCP socket, and client-side
decode time (body -> float32 numpy via ``vllm_hidden_states.client``).
Milliseconds, medians over rounds; "round trip" = encode + transfer + decode;
"codec only" = encode + decode without the JSON framing (tensor -> ``data``
value -> array), i.e. what the encoding itself costs. Binary comes in float32
and in the model dtype (bfloat16, half the bytes).
"""

import socket
import statistics
import threading
import time

import orjson
import torch

from vllm_hidden_states.client import from_bytes, to_numpy
from vllm_hidden_states.server.encoding import (
    ORJSON_OPTIONS,
    binary_array,
    binary_body,
    encode_array,
)

FORMATS = ("float", "base64", "bytes", "bytes bf16")
TARGETS_MS = {((512, 2560), "base64"): 10.0, ((512, 2560), "bytes"): 3.0}


def _transfer_ms(body: bytes) -> float:
    """ms to move ``body`` through a loopback TCP connection (send + receive
    into one preallocated buffer), the HTTP body's share of the round trip."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send():
        conn, _ = server.accept()
        with conn:
            conn.sendall(body)

    thread = threading.Thread(target=send)
    thread.start()
    out = bytearray(len(body))
    view = memoryview(out)
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        start = time.perf_counter()
        got = 0
        while got < len(body):
            got += client.recv_into(view[got:])
        elapsed = time.perf_counter() - start
    thread.join()
    server.close()
    return elapsed * 1e3


def _binary_once(tensor: torch.Tensor, embed_dtype: str) -> tuple[float, float, float, int]:
    start = time.perf_counter()
    array = binary_array(tensor, embed_dtype, "little")
    items = [{"index": 0, "embed_dtype": embed_dtype, "endianness": "little"}]
    body = binary_body([array], items, {"model": "m", "layer": -2})  # what is sent
    encoded = time.perf_counter()
    out = from_bytes(body)
    decoded = time.perf_counter()
    assert out.shape == tuple(tensor.shape)
    return (
        (encoded - start) * 1e3,
        (decoded - encoded) * 1e3,
        _transfer_ms(body),
        len(body),
    )


SHAPES = ((512, 2560), (4096, 4096))


def _codec(tensor: torch.Tensor, fmt: str) -> float:
    """ms for tensor -> data value -> float32 array, without the JSON framing."""
    start = time.perf_counter()
    data = encode_array(tensor, fmt)
    if fmt == "float":
        data = orjson.loads(orjson.dumps(data, option=ORJSON_OPTIONS))
    to_numpy({"hidden_states": data, "shape": list(tensor.shape), "encoding_format": fmt})
    return (time.perf_counter() - start) * 1e3


def _once(tensor: torch.Tensor, fmt: str) -> tuple[float, float, float, int]:
    start = time.perf_counter()
    body = orjson.dumps(
        {
            "hidden_states": encode_array(tensor, fmt),
            "shape": list(tensor.shape),
            "dtype": "bfloat16",
            "encoding_format": fmt,
        },
        option=ORJSON_OPTIONS,
    )
    encoded = time.perf_counter()
    array = to_numpy(orjson.loads(body))
    decoded = time.perf_counter()
    assert array.shape == tuple(tensor.shape)
    return (
        (encoded - start) * 1e3,
        (decoded - encoded) * 1e3,
        _transfer_ms(body),
        len(body),
    )


def run(rounds: int, quick: bool) -> list[dict]:
    results = []
    for shape in SHAPES[:1] if quick else SHAPES:
        # bf16 source, as a Qwen3-4B server would hold it.
        tensor = torch.randn(*shape).to(torch.bfloat16)
        for fmt in FORMATS:
            n = max(rounds, 5)
            if fmt.startswith("bytes"):
                dtype = "bfloat16" if fmt.endswith("bf16") else "float32"
                samples = [_binary_once(tensor, dtype) for _ in range(n)]
                codec = statistics.median(s[0] + s[1] for s in samples)
            else:
                samples = [_once(tensor, fmt) for _ in range(n)]
                codec = statistics.median(_codec(tensor, fmt) for _ in range(n))
            enc = statistics.median(s[0] for s in samples)
            dec = statistics.median(s[1] for s in samples)
            xfer = statistics.median(s[2] for s in samples)
            results.append(
                {
                    "shape": list(shape),
                    "encoding_format": fmt,
                    "encode_ms": enc,
                    "decode_ms": dec,
                    "transfer_ms": xfer,
                    "round_trip_ms": enc + xfer + dec,
                    "bytes": samples[0][3],
                    "codec_round_trip_ms": codec,
                    "target_round_trip_ms": TARGETS_MS.get((shape, fmt)),
                }
            )
    return results


def lines(results: list[dict]) -> list[str]:
    rows = [
        "payload: float JSON vs base64 vs binary (ms, median; transfer = loopback TCP)",
        f"  {'shape':<13s} {'format':<10s} {'encode':>8s} {'transfer':>9s} {'decode':>8s} "
        f"{'round trip':>11s} {'MB on wire':>11s} {'codec only':>11s}",
    ]
    for r in results:
        row = (
            f"  {str(r['shape']):<13s} {r['encoding_format']:<10s} {r['encode_ms']:>8.2f} "
            f"{r['transfer_ms']:>9.2f} {r['decode_ms']:>8.2f} {r['round_trip_ms']:>11.2f} "
            f"{r['bytes'] / 2**20:>11.1f} {r['codec_round_trip_ms']:>11.2f}"
        )
        if r["target_round_trip_ms"] is not None:
            ok = r["round_trip_ms"] <= r["target_round_trip_ms"]
            row += f"   target <= {r['target_round_trip_ms']:.0f} ms: {'MET' if ok else 'MISSED'}"
        rows.append(row)
    return rows
