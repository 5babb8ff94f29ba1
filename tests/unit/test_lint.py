# SPDX-License-Identifier: Apache-2.0
"""Lint, format and type checks, in the unit tier (configuration in
pyproject.toml: ``[tool.ruff]``, ``[tool.mypy]``)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["vllm_hidden_states", "tests", "benchmarks", "examples"]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "argv",
    [("ruff", "check", *SOURCES), ("ruff", "format", "--check", *SOURCES), ("mypy",)],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_sources_are_clean(argv):
    done = _run(*argv)
    assert done.returncode == 0, done.stdout + done.stderr
