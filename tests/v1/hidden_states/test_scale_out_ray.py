# SPDX-License-Identifier: Apache-2.0
"""Ray: what vLLM itself does on this CPU platform, on a local Ray head
started by the test, and our start-up refusal.

vLLM 0.32's CPU platform has no Ray device key, so plain vLLM (no hidden
states) stops at engine start with either Ray backend:

* ``--distributed-executor-backend ray`` (TP=2):
  ``ValueError: current platform cpu does not support ray.``
* ``--data-parallel-backend ray`` (DP=2):
  ``AssertionError: No  found in Ray cluster.`` (the empty device key)

With ``--enable-hidden-states`` either backend is refused before any engine
process starts (untested: no platform here runs it).
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.support.server_process import free_port

from .server_utils import wait_until

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray", reason="the ray extra: pip install vllm-hidden-states[ray]")


@pytest.fixture(scope="module")
def ray_head():
    """A local Ray head in its own process group; yields its address."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths
    head = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            # Advertise loopback: the host's other interface may not answer
            # (a probe once hung connecting to it).
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: _ray_up(address, head), "the Ray head to answer", timeout=600)
        yield address
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
        head.wait()


def _ray_up(address: str, head: subprocess.Popen) -> bool:
    if head.poll() is not None:
        raise RuntimeError(f"ray start exited with {head.returncode}")
    try:
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import ray; ray.init(address={address!r}); "
                "print(int(ray.cluster_resources().get('CPU', 0)))",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return False  # not up yet: wait_until asks again
    return probe.returncode == 0 and probe.stdout.strip().endswith("2")


def _plain_vllm(args: list[str], address: str, model) -> str:
    """``vllm serve`` without hidden states; its output once it exits."""
    env = {
        **os.environ,
        "RAY_ADDRESS": address,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.2",
            "--max-model-len",
            "256",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode != 0, "plain vLLM served with a Ray backend on CPU"
    return proc.stdout + proc.stderr


def test_plain_vllm_cpu_cannot_run_the_ray_executor(ray_head, qwen3_dir):
    out = _plain_vllm(
        ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
        ray_head,
        qwen3_dir,
    )
    assert "ValueError: current platform cpu does not support ray." in out, out[-3000:]


def test_plain_vllm_cpu_cannot_run_ray_data_parallel(ray_head, qwen3_dir):
    out = _plain_vllm(
        ["--data-parallel-size", "2", "--data-parallel-backend", "ray"],
        ray_head,
        qwen3_dir,
    )
    assert "AssertionError: No  found in Ray cluster." in out, out[-3000:]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (
            dict(tensor_parallel_size=2, distributed_executor_backend="ray"),
            "distributed_executor_backend='ray'",
        ),
        (dict(data_parallel_size=2, data_parallel_backend="ray"), "data_parallel_backend='ray'"),
    ],
)
def test_ray_backends_are_refused_at_start(qwen3_dir, kwargs, named):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(qwen3_dir),
        enable_hidden_states=True,
        enforce_eager=True,
        max_model_len=256,
        dtype="float32",
        **kwargs,
    )
    with pytest.raises(ValueError, match="the Ray backend") as err:
        args.create_engine_config()
    assert named in str(err.value)
    assert "current platform cpu does not support ray" in str(err.value)
