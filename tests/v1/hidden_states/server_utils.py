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
    "EngineGauges",
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


def wait_until(condition, what: str, timeout: float = 300.0, interval: float = 0.2, explain=None):
    """Poll ``condition()`` until it is truthy; a generous deadline, never a
    measure of the machine's speed. Returns the truthy value. On timeout the
    error adds ``explain()``, if given (what was seen instead)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            seen = f": {explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{seen}")
        time.sleep(interval)
    return value


class EngineGauges:
    """vLLM's request and KV-cache gauges of a server's engines, read so that
    a stale record never passes for an engine's state.

    vLLM attaches each step's scheduler stats to the outputs of one API server
    only, and with several API-server processes (``--api-server-count``, or
    data parallel) ``/metrics`` shows, per gauge, the value recorded last by
    any of them. An API server busy with an earlier step's outputs can record
    that step's stats after another one recorded the final step's; the stale
    value then stays for as long as the engine is idle. So when a gauge reads
    non-zero, :meth:`nothing_held` sends each engine one plain one-token
    completion (pinned by the ``X-data-parallel-rank`` header): its single
    step's stats go to the API server that sent it and are recorded after the
    stale ones, and show what the engine still holds. :attr:`sent` counts
    those completions (vLLM counts each as finished, reason "length"). Each is
    also a step, in which the engine frees KV blocks parked for an extract that
    did not come within ``PARK_SECONDS`` (and logs it).

    Args:
        server: a started :class:`ServerProcess`.
        ranks: the data-parallel ranks of its engines (``(0,)``: one engine).
    """

    GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")

    def __init__(self, server: ServerProcess, ranks: tuple[int, ...] = (0,)):
        self.server = server
        self.ranks = ranks
        self.sent = 0

    def held(self) -> dict[str, float]:
        """The non-zero gauges, keyed ``"<gauge> engine=<rank>"``."""
        return {
            f"{name} engine={rank}": value
            for rank in self.ranks
            for name in self.GAUGES
            if (value := self.server.metric(name, engine=str(rank)))
        }

    def refresh(self) -> None:
        """One plain one-token completion on each engine."""
        with httpx.Client(base_url=self.server.base_url, timeout=300.0) as http:
            for rank in self.ranks:
                r = http.post(
                    "/v1/completions",
                    json={"model": self.server.name, "prompt": "Hi", "max_tokens": 1},
                    headers={"X-data-parallel-rank": str(rank)},
                )
                assert r.status_code == 200, r.text
                self.sent += 1

    def nothing_held(self) -> bool:
        """No request running or waiting and no KV block in use on any engine,
        as the engines' latest steps report it."""
        if not self.held():
            return True
        self.refresh()
        return not self.held()

    def wait_until_nothing_held(self, timeout: float = 300.0) -> None:
        wait_until(
            self.nothing_held,
            "the engines to hold nothing",
            timeout=timeout,
            interval=1.0,
            explain=self.explain,
        )

    def explain(self) -> str:
        """What is still held, and the server log's last lines but polls."""
        lines = self.server.log_path.read_text(errors="replace").splitlines()
        tail = [line for line in lines if "GET /metrics" not in line][-40:]
        return f"still non-zero: {self.held()}; server log:\n" + "\n".join(tail)


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
