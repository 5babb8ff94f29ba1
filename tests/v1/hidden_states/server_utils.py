# SPDX-License-Identifier: Apache-2.0
"""A real OpenAI server process on loopback, for the server tests."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``vllm serve`` in its own process group; :meth:`start` does not block.

    Logs go to ``log_path`` so a failed start can be shown in the assertion.
    """

    def __init__(
        self,
        model: Path,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        name: str = "model",
    ):
        self.port = free_port()
        self.name = name
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", name,
            "--dtype", "float32", "--enforce-eager",
            "--gpu-memory-utilization", "0.2", "--seed", "0",
            *args,
        ]  # fmt: skip
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stop() ends the engine too
        )
        return self

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url("/health"), timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples on /metrics (all label sets)."""
        text = httpx.get(self.url("/metrics"), timeout=5.0).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(f"metric {name} not on /metrics")
        return total


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
