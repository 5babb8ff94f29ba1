# SPDX-License-Identifier: Apache-2.0
"""The budgeted GPU run's machinery (``tests/gpu/run.sh``), on CPU: its plan,
its skips without a GPU, and a step past its limit killed (SIGINT ignored, a
child in a session of its own) with its record left in the JSON summary."""

import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "run.sh"
STEPS = ["kernel", "engine", "serve", "engines", "special", "bench"]


def run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HS_GPU_ASSUME_NONE": "1", **env},
    )


def summary(out: Path) -> dict:
    return json.loads((out / "gpu-run.json").read_text())


def test_without_a_gpu_it_prints_the_plan_and_skips_every_gpu_step(tmp_path):
    done = run_script("--budget", "540", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    given = {name: s["given_s"] for name, s in summary(tmp_path)["steps"].items()}
    assert list(given) == STEPS
    # Steps 1-3 within 240 s; everything within the budget, the benchmark the rest.
    assert sum(given[n] for n in STEPS[:3]) <= 240
    assert sum(given.values()) == 540
    for i, name in enumerate(STEPS, 1):
        assert f"{i}. {name}" in done.stdout and f"{given[name]} s" in done.stdout
    statuses = {s["status"] for s in summary(tmp_path)["steps"].values()}
    reasons = {s["reason"] for s in summary(tmp_path)["steps"].values()}
    assert statuses == {"skipped"} and reasons == {"no GPU"}


def test_plan_only_runs_nothing_and_lists_the_steps_as_planned(tmp_path):
    done = run_script("--plan", "--budget", "300", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    steps = summary(tmp_path)["steps"]
    assert {s["status"] for s in steps.values()} == {"planned"}
    assert sum(s["given_s"] for s in steps.values()) <= 300
    assert summary(tmp_path)["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_a_budget_too_small_for_a_step_gives_it_no_time(tmp_path):
    done = run_script("--plan", "--budget", "240", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    given = {n: s["given_s"] for n, s in summary(tmp_path)["steps"].items()}
    assert given["kernel"] > 0 and given["engine"] > 0 and given["serve"] > 0
    assert given["engines"] == given["special"] == given["bench"] == 0


def test_bad_budget_is_refused_with_what_is_allowed(tmp_path):
    done = run_script("--budget", "9m", str(tmp_path))
    assert done.returncode == 2
    assert "whole seconds" in done.stderr


def test_a_step_past_its_limit_is_killed_with_its_children_and_leaves_its_record(tmp_path):
    # A step that ignores SIGINT and leaves a child in a session of its own
    # (as a `vllm serve` process group does): the SIGKILL after the grace
    # period ends the first, the step's tag reaps the second.
    # A shell, not Python: it starts in milliseconds however loaded the box
    # is, well inside the step's 3 s (the outer shell passes ``\$!`` on).
    pid_file = tmp_path / "child.pid"
    step = f"trap '' INT; setsid sleep 300 & echo \\$! > {pid_file}; echo started; sleep 300"
    script = f"""
        set -u
        source tests/gpu/run.sh
        out={tmp_path}; RUN_ID=test-$$; SUMMARY_PY=python3; KILL_AFTER=1
        _summary init "$out" 60 "" kernel:30:1 stuck:3:1
        run_step stuck 3 bash -c "{step}"
        echo "rc=$?"
    """
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - start < 30, "the step outlived its limit"
    assert "rc=137" in done.stdout, done.stdout + done.stderr
    entry = summary(tmp_path)["steps"]["stuck"]
    assert entry["status"] == "timed_out" and entry["rc"] == 137
    assert summary(tmp_path)["steps"]["kernel"]["status"] == "planned"
    assert "started" in (tmp_path / "stuck.log").read_text()  # its log, written as it went
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILL is delivered asynchronously
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().split(") ")[1].startswith("Z")


def test_a_pytest_steps_cases_are_folded_into_its_entry(tmp_path):
    (tmp_path / "engine.cases.json").write_text(
        json.dumps(
            {
                "cases": {
                    "t::a": {"outcome": "passed", "seconds": 1.0},
                    "t::b": {"outcome": "failed", "seconds": 2.0},
                },
                "engine_starts": {"default": 41.5},
            }
        )
    )
    tool = ["python3", str(ROOT / "tests" / "gpu" / "summary.py")]
    subprocess.run([*tool, "init", str(tmp_path), "540", "", "engine:140:1"], check=True)
    subprocess.run([*tool, "set", str(tmp_path), "engine", "status=failed", "rc=1"], check=True)
    entry = summary(tmp_path)["steps"]["engine"]
    assert entry["counts"] == {"passed": 1, "failed": 1, "skipped": 0}
    assert entry["failed_cases"] == ["t::b"]
    assert entry["engine_starts"] == {"default": 41.5}
