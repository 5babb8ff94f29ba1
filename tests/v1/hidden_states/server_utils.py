# SPDX-License-Identifier: Apache-2.0
"""Real OpenAI server processes on loopback for the server tests."""

import concurrent.futures as cf
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

from tests.support.request_gate import GATE_ARG
from tests.support.server_process import ServerProcess

__all__ = [
    "GATE_ARGS",
    "Gate",
    "ServerProcess",
    "num_generated",
    "num_completed",
    "post_concurrently",
    "running_server",
    "sse_events",
    "test_server_process",
    "wait_until",
]

# Every test server: float32 like the HF reference, eager (fast start), seeded.
TEST_SERVER_ARGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--gpu-memory-utilization",
    "0.2",
    "--seed",
    "0",
]


def test_server_process(
    model: Path,
    args: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    name: str = "model",
) -> ServerProcess:
    """A :class:`ServerProcess` with the test defaults (not started)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    return ServerProcess(model, [*TEST_SERVER_ARGS, *args], log_path, env, name)


test_server_process.__test__ = False  # a factory, not a test


@contextlib.contextmanager
def running_server(
    model: Path,
    args: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    name: str = "model",
    timeout: float = 600,
) -> Iterator[ServerProcess]:
    """Start a :func:`test_server_process` with ``args``, yield it once it
    answers (waiting up to ``timeout`` s), and stop it on exit, an error
    included: the body of a module-scoped ``server`` fixture."""
    process = test_server_process(model, args, log_path, env, name)
    process.start()
    try:
        yield process.wait_ready(timeout=timeout)
    finally:
        process.stop()


def sse_events(response: httpx.Response) -> list[dict]:
    """The JSON events of a streamed response, without the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            break
        events.append(orjson.loads(data))
    return events


# Servers whose tests hold a request mid-generation (see :class:`Gate`).
GATE_ARGS = ["--logits-processors", "tests.support.request_gate:HoldWhileFileExists"]


class Gate:
    """While open, a request sent with :attr:`xargs` is held after its first
    token (the engine waits inside that step), whatever the machine's speed;
    closing it lets the engine go on. Needs a server started with
    :data:`GATE_ARGS`. Use as a context manager: the file is removed on exit,
    an error included."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def xargs(self) -> dict:
        """The request's ``vllm_xargs``."""
        return {GATE_ARG: str(self.path)}

    def __enter__(self) -> "Gate":
        self.path.touch()
        return self

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)


def wait_until(condition, what: str, timeout: float = 300.0, interval: float = 0.2):
    """Poll ``condition()`` until it is truthy; a generous deadline, never a
    measure of the machine's speed. Returns the truthy value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return value


def post_concurrently(base_url: str, path: str, jobs: list[tuple], timeout: float = 600.0):
    """POST every ``(tag, body)`` of ``jobs`` at once, each on its own
    connection; ``[(tag, response)]`` in job order."""

    def post(job):
        with httpx.Client(base_url=base_url, timeout=timeout) as http:
            return job[0], http.post(path, json=job[1])

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(post, jobs))


def num_generated(server: ServerProcess) -> float:
    """Tokens the server generated, over all engines."""
    return server.metric("vllm:generation_tokens_total")


def num_completed(server: ServerProcess) -> float:
    """Requests the server ran to their end (stop or length), over all engines."""
    return sum(
        server.metric("vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length")
    )
