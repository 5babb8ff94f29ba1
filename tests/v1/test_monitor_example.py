# SPDX-License-Identifier: Apache-2.0
"""``examples/monitor.py`` end to end against real ``make serve`` servers
(eager): a probe trained on harvested states, served as a stop monitor; each
generation must end exactly where its own reported scores first cross the
monitor's threshold (or run to length when none does). The third generation
carries its own steer action: it must fire at the first position whose
score passes the lower steer level, and steer the rest away from the probe."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MONITOR = "machines-stop"
AS_GENERATED = "as generated"
STEERED_AWAY = "steered away by a probe action"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example's output directory, after one run with its defaults."""
    out = tmp_path_factory.mktemp("monitor")
    done = subprocess.run(
        [sys.executable, "examples/monitor.py", "--out", str(out), "--eager"],
        cwd=REPO,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_monitor_stops_each_generation_at_its_first_crossing(example):
    summary = json.loads((example / "monitor.json").read_text())
    threshold, max_tokens = summary["threshold"], summary["max_tokens"]
    assert set(summary["runs"]) == {AS_GENERATED, "steered along the probe", STEERED_AWAY}
    for label, run in summary["runs"].items():
        # A score per generated token: the fed ones as they were computed,
        # the final one from its extract.
        assert len(run["scores"]) == len(run["tokens"]), label
        assert all(s <= threshold for s in run["scores"][:-1]), label
        if run["finish_reason"] == "stop":
            # It stopped right after the first token whose score crossed.
            assert run["stop_reason"] == MONITOR and run["scores"][-1] > threshold
        else:
            assert run["finish_reason"] == "length" and len(run["tokens"]) == max_tokens, label
    assert (example / "monitor.png").stat().st_size > 0


def first_above(scores: list[float], level: float) -> int | None:
    """The index of the first score above ``level``, None if none is."""
    return next((i for i, s in enumerate(scores) if s > level), None)


def test_the_steer_action_fires_at_its_first_crossing_and_steers_the_rest_away(example):
    summary = json.loads((example / "monitor.json").read_text())
    threshold, steer_at = summary["threshold"], summary["steer_at"]
    assert steer_at < threshold
    plain, run = summary["runs"][AS_GENERATED], summary["runs"][STEERED_AWAY]
    scores, n_prompt = run["scores"], run["prompt_tokens"]
    # The scores are those of the positions fed back (the last one, from the
    # extract, is not watched): the action fires at the first that passes.
    fired = first_above(scores[:-1], steer_at)
    assert fired is not None

    # Reported once, at that position, with that score (the server
    # monitor's firings are never returned).
    (firing,) = run["firings"]
    assert (firing["probe"], firing["then"]) == ("machines", "steer")
    assert firing["position"] == n_prompt + fired
    assert firing["score"] == pytest.approx(scores[fired], rel=1e-5)

    # The stop monitor had not fired up to the steer firing, and the request
    # went on after it.
    assert all(s <= threshold for s in scores[: fired + 1])
    assert len(run["tokens"]) > fired + 1

    # Up to the firing position nothing is steered: the same tokens and
    # scores as the first run (which passes the steer level there too).
    assert first_above(plain["scores"], steer_at) == fired
    assert run["tokens"][: fired + 1] == plain["tokens"][: fired + 1]
    assert run["scores"][: fired + 1] == pytest.approx(plain["scores"][: fired + 1], rel=1e-5)

    # After it, wherever both runs have read the same tokens, the steered
    # score is the lower one (steered away from the probe).
    same = next(
        (i for i, (a, b) in enumerate(zip(run["tokens"], plain["tokens"])) if a != b),
        min(len(run["tokens"]), len(plain["tokens"])),
    )
    assert same > fired + 1
    for i in range(fired + 1, same):
        assert scores[i] < plain["scores"][i], i

    # With the example's defaults on the tiny model the monitor stops the
    # first run and not the steered one.
    assert plain["stop_reason"] == MONITOR
    assert run["finish_reason"] == "length" and run["stop_reason"] is None
