# SPDX-License-Identifier: Apache-2.0
"""A ``vllm serve`` process on loopback: start, wait until ready, probe, stop.

The one harness the tests (``tests/v1/hidden_states/test_server.py``) and the
benchmarks (``benchmarks/``) start real servers with. The server runs in its
own process group, so :meth:`ServerProcess.stop` ends the EngineCore and
workers too; its output goes to ``log_path``, shown when it fails to start.
Waits are conditions with generous deadlines, never a measure of speed.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``vllm serve MODEL --host 127.0.0.1 --port P --served-model-name NAME *args``.

    Args:
        model: model directory or id.
        args: further ``vllm serve`` arguments.
        log_path: where stdout and stderr go.
        env: environment on top of this process's.
        name: the served model name.
    """

    def __init__(
        self,
        model: Path | str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        name: str = "model",
    ):
        self.port = free_port()
        self.name = name
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            name,
            *args,
        ]
        self.env = {**os.environ, **(env or {})}
        # The server imports tests.support.request_gate (the tests' logits
        # processor) by name: put the checkout on its path.
        paths = [str(REPO_ROOT), *filter(None, [self.env.get("PYTHONPATH")])]
        self.env["PYTHONPATH"] = os.pathsep.join(paths)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "ServerProcess":
        """Launch the process; does not wait (see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stop() ends the engine too
        )
        return self

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        """Until /health answers 200; raises with the log tail if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url("/health"), timeout=5.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus metric's samples on /metrics whose labels
        include ``labels`` (all label sets when none are given)."""
        text = httpx.get(self.url("/metrics"), timeout=30.0).text
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                found = True
                if all(w in line.split("}")[0] for w in wanted):
                    total += float(line.rsplit(" ", 1)[1])
        if not found:
            raise KeyError(f"metric {name} not on /metrics")
        return total

    def num_unfinished(self) -> float:
        """Requests running or waiting in the engine (vLLM's gauges)."""
        return self.metric("vllm:num_requests_running") + self.metric("vllm:num_requests_waiting")

    def load(self) -> int:
        """In-flight HTTP requests (``/load``; needs --enable-server-load-tracking)."""
        return int(httpx.get(self.url("/load"), timeout=30.0).json()["server_load"])

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its descendants, in bytes."""
        return sum(rss_by_process(self.proc.pid).values())


def rss_by_process(root: int) -> dict[str, int]:
    """RSS in bytes of ``root`` and each live descendant, keyed ``"<pid> <name>"``
    (names like ``VLLM::EngineCore``), to see which process grows."""
    import psutil  # a vLLM dependency

    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for proc in procs:
        try:
            out[f"{proc.pid} {proc.name()}"] = proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return out
