# SPDX-License-Identifier: Apache-2.0
"""Real OpenAI server processes on loopback for the server tests."""

import os
import time
from pathlib import Path

import httpx
import orjson

from vllm_hidden_states.tools.server_process import ServerProcess

__all__ = ["ServerProcess", "sse_events", "test_server_process", "wait_until"]

# Every test server: float32 like the HF reference, eager (fast start), seeded.
TEST_SERVER_ARGS = [
    "--dtype", "float32", "--enforce-eager",
    "--gpu-memory-utilization", "0.2", "--seed", "0",
]  # fmt: skip


def test_server_process(
    model: Path,
    args: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    name: str = "model",
) -> ServerProcess:
    """A :class:`ServerProcess` with the test defaults (not started)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           **(env or {})}
    return ServerProcess(model, [*TEST_SERVER_ARGS, *args], log_path, env, name)


test_server_process.__test__ = False  # a factory, not a test


def sse_events(response: httpx.Response) -> list[dict]:
    """The JSON events of a streamed response, without the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        events.append(orjson.loads(data))
    return events


def wait_until(condition, what: str, timeout: float = 300.0, interval: float = 0.2):
    """Poll ``condition()`` until it is truthy; a generous deadline, never a
    measure of the machine's speed. Returns the truthy value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return value
