# SPDX-License-Identifier: Apache-2.0
"""The engine tier's files in longest-first order, and no vLLM step deadline.

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
"""

import os

import pytest

os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")

# Longest first: file totals of `make test DURATIONS=0` on the 2-core box
# (2026-11-29; the benchmark, scale-out and example files from earlier runs).
LONGEST_FIRST = (
    "tests/v1/test_benchmark_commands.py",
    "tests/v1/hidden_states/test_architectures.py",
    "tests/v1/hidden_states/test_scale_out.py",
    "tests/v1/hidden_states/test_families_moe.py",
    "tests/v1/hidden_states/test_families_sweep.py",
    "tests/v1/hidden_states/test_families_sweep_classic.py",
    "tests/v1/hidden_states/test_families_sweep_remote_a.py",
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
