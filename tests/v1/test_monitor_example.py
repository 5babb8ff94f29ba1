# SPDX-License-Identifier: Apache-2.0
"""``examples/monitor.py`` end to end against real ``make serve`` servers
(eager): a probe trained on harvested states, served as a stop monitor; each
generation must end exactly where its own reported scores first cross the
monitor's threshold (or run to length when none does)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_monitor_stops_each_generation_at_its_first_crossing(tmp_path):
    out = tmp_path / "monitor"
    done = subprocess.run(
        [sys.executable, "examples/monitor.py", "--out", str(out), "--eager"],
        cwd=REPO,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "monitor.json").read_text())
    threshold, max_tokens = summary["threshold"], summary["max_tokens"]
    assert set(summary["runs"]) == {"as generated", "steered along the probe"}
    for label, run in summary["runs"].items():
        # A score per generated token: the fed ones as they were computed,
        # the final one from its extract.
        assert len(run["scores"]) == len(run["tokens"]), label
        assert all(s <= threshold for s in run["scores"][:-1]), label
        if run["finish_reason"] == "stop":
            # It stopped right after the first token whose score crossed.
            assert run["stop_reason"] == "machines-stop" and run["scores"][-1] > threshold
        else:
            assert run["finish_reason"] == "length" and len(run["tokens"]) == max_tokens, label
    assert (out / "monitor.png").stat().st_size > 0
