# SPDX-License-Identifier: Apache-2.0
"""``examples/probe_loop.py`` end to end against real ``make serve`` servers
(eager, to start faster): harvest over HTTP, a numpy logistic probe, the
server restarted with ``--probes``, scores streamed per generated token,
steering along the probe, the plot and the summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_probe_loop_trains_serves_streams_and_steers_its_probe(tmp_path):
    out = tmp_path / "loop"
    done = subprocess.run(
        [sys.executable, "examples/probe_loop.py", "--out", str(out), "--eager"],
        cwd=REPO,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "probe_loop.json").read_text())
    assert summary["train_accuracy"] > 0.9 and summary["held_out_accuracy"] > 0.5
    # A score per generated token, each a probability, streamed and steered.
    assert summary["tokens"] == len(summary["scores_steered"]) == 24
    assert all(0.0 <= s <= 1.0 for s in summary["scores"] + summary["scores_steered"])
    assert summary["mean_score_steered"] > summary["mean_score"]
    assert (out / "probe_loop.png").stat().st_size > 0
    assert (out / "probes" / "machines.safetensors").is_file()
