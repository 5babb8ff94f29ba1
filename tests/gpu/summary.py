# SPDX-License-Identifier: Apache-2.0
"""The budgeted GPU run's JSON summary, written step by step by ``run.sh``.

Standard library only (it runs before anything heavy is imported, and on CPU
boxes without the venv). One file, ``OUT/gpu-run.json``, rewritten atomically
after every change, so a run killed in any step leaves the record of every
step so far: ``planned``, ``running`` (the step it died in), ``passed``,
``failed``, ``timed_out`` or ``skipped`` (with a reason).

    python3 tests/gpu/summary.py init OUT BUDGET GPU STEP:GIVEN:GPU_ONLY ...
    python3 tests/gpu/summary.py set OUT STEP key=value ...   # values as JSON if they parse
    python3 tests/gpu/summary.py finish OUT                 # prints the table

A pytest step's own per-case report (``OUT/STEP.cases.json``, written by
``tests/gpu/conftest.py`` after each test) is folded into its entry.
"""

import json
import os
import platform
import sys
import time
from pathlib import Path

NAME = "gpu-run.json"
# Recorded with the run: they change what vLLM runs.
ENV = ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_LOGGING_LEVEL", "VLLM_USE_V2_MODEL_RUNNER")


def _path(out: str) -> Path:
    return Path(out) / NAME


def _write(out: str, summary: dict) -> None:
    path = _path(out)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, path)  # never a half-written summary


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def init(out: str, budget: str, gpu: str, *steps: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    summary = {
        "started": _now(),
        "finished": None,
        "budget_s": int(budget),
        "gpu": gpu or None,
        "host": {"platform": platform.platform(), "python": platform.python_version()},
        "env": {k: os.environ.get(k) for k in ENV},
        "steps": {},
    }
    for order, spec in enumerate(steps, 1):
        name, given, gpu_only = spec.split(":")
        summary["steps"][name] = {
            "order": order,
            "given_s": int(given),
            "gpu_only": gpu_only == "1",
            "status": "planned",
        }
    _write(out, summary)


def _parse(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def _fold_cases(out: str, step: str, entry: dict) -> None:
    """A pytest step's case report into its entry: counts, failures, engine starts."""
    path = Path(out) / f"{step}.cases.json"
    if not path.exists():
        return
    try:
        report = json.loads(path.read_text())
    except ValueError:  # being rewritten by a step that was killed mid-write
        return
    cases = report.get("cases", {})
    entry["cases_file"] = path.name
    entry["counts"] = {
        o: sum(c["outcome"] == o for c in cases.values()) for o in ("passed", "failed", "skipped")
    }
    entry["failed_cases"] = [n for n, c in cases.items() if c["outcome"] == "failed"]
    for key in ("engine_starts", "engine_modes", "max_rel_error_worst"):
        if key in report:
            entry[key] = report[key]


def set_(out: str, step: str, *pairs: str) -> None:
    summary = json.loads(_path(out).read_text())
    entry = summary["steps"].setdefault(step, {})
    for pair in pairs:
        key, _, value = pair.partition("=")
        entry[key] = _parse(value)
    _fold_cases(out, step, entry)
    _write(out, summary)


def finish(out: str) -> int:
    summary = json.loads(_path(out).read_text())
    summary["finished"] = _now()
    _write(out, summary)
    print(f"summary: {_path(out)}")
    bad = 0
    for name, s in summary["steps"].items():
        counts = s.get("counts")
        extra = f"  {counts}" if counts else ""
        if s.get("reason"):
            extra += f"  ({s['reason']})"
        for engine, seconds in (s.get("engine_starts") or {}).items():
            extra += f"\n      engine start {engine}: {seconds:.1f} s"
        took = f"{s['seconds']:>5.0f} s" if "seconds" in s else "     -"
        print(f"  {s['order']}. {name:<10} {s['status']:<10} {took} of {s['given_s']:>4} s{extra}")
        bad += s["status"] in ("failed", "timed_out", "running")
    return 1 if bad else 0


if __name__ == "__main__":
    command, out, *rest = sys.argv[1:]
    if command == "init":
        init(out, *rest)
    elif command == "set":
        set_(out, *rest)
    elif command == "finish":
        sys.exit(finish(out))
    else:
        sys.exit(f"unknown command {command!r}: init, set or finish")
