# SPDX-License-Identifier: Apache-2.0
"""``make bench``: every comparison of issue 4 in one session.

    python -m benchmarks.run [--rounds 3] [--quick] [--tiny] [--only offline,server,...]
                             [--model DIR]

Writes ``benchmarks/results/latest.json`` and PNG plots next to it, and prints
a table with each target. Sections: offline (LLM throughput), server (HTTP
throughput), prompt (POST /v1/hidden_states vs the pooling runner vs HF),
payload (float JSON vs base64), load (256 concurrent mixed requests, RSS),
peers (ours vs HF transformers and nnsight on equal cores, and the vLLM-based
peers, n/a with their exact error where they cannot start), harvest (collect ->
Parquet vs the bare route vs an HF transformers loop), sae_payload (SAE top-k
features vs full hidden states over HTTP: bytes per position and throughput),
probes (a linear probe's score on every generated token vs plain vLLM, and its
payload per token vs return_hidden_states at the same point),
scale_out (DP=2 vs DP=1 with "last" on every request, beside plain vLLM's own
DP=2 vs DP=1), capture_op (the capture op alone on a layer stack, 0/1/64/1024
rows, with and without the host copy: the GPU micro-benchmark, a smoke test on
CPU), small_model (a 5 x 256 Llama where the per-step host work shows: nobody
asks, "last", "all" vs plain vLLM), host_time (the overlay's host time per
decode step, profiled, in µs and as a share of vLLM's own host time per step,
at batch 1, 16 and 64 on the same Llama), small_model_modes (the same in each of
vLLM's engine modes, V1/V2 x sync/async, against plain vLLM in that mode),
points (every capture point capturable: nobody asks, "last" at one point of
each kind, an attention pattern, on the 5 x 256 Llama), points_wide (the
same on four layers of a 0.5B model's width),
points_peers (attn_out, resid_mid, mlp_out at layer 2 on the same prompts: ours
vs HF hooks, nnsight and interp-engine's eager backend, each checked against HF
before it is timed), steering (per-request add / ablate at resid_pre.2 vs plain
vLLM, and an engine with steering enabled that nobody uses), steering_peers
(steered greedy generation, add at resid_pre.2 with one vector: ours vs HF with
a forward pre-hook, nnsight and interp-engine's eager steer(), each checked
against HF's greedy tokens before it is timed).
"""

import argparse
import importlib
import inspect
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.common import RESULTS, Comparison, machine, write_results

SECTIONS = (
    "payload",
    "capture_op",
    "small_model",
    "host_time",
    "small_model_modes",
    "points",
    "points_wide",
    "points_peers",
    "steering",
    "steering_peers",
    "patching",
    "offline",
    "server",
    "prompt",
    "load",
    "peers",
    "harvest",
    "sae_payload",
    "probes",
    "scale_out",
)


def _plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    labels, ratios, targets = [], [], []
    for comp in results.get("comparisons", []):
        if comp["unit"].startswith("bytes"):  # sizes, not throughput (sae_payload)
            continue
        for name, v in comp["variants"].items():
            if "ratio" in v:
                labels.append(f"{comp['name'].split(':')[0]}: {name}")
                ratios.append(v["ratio"])
                targets.append(v.get("target"))
    if labels:
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.5))
        ax.barh(range(len(labels)), ratios, color="#4c72b0")
        for i, t in enumerate(targets):
            if t is not None:
                ax.plot([t, t], [i - 0.4, i + 0.4], color="#c44e52", lw=2)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_xlabel("throughput ratio vs baseline (median of per-round ratios); red = target")
        ax.invert_yaxis()
        fig.tight_layout()
        path = out_dir / "throughput_ratios.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    latencies = (results.get("load") or {}).get("latency_s")
    if latencies:
        fig, ax = plt.subplots(figsize=(9, 4))
        kinds = [k for k, v in latencies.items() if v]
        ax.boxplot([latencies[k] for k in kinds], showfliers=True)
        ax.set_xticks(range(1, len(kinds) + 1), kinds, rotation=20, fontsize=8)
        ax.set_ylabel("request latency (s)")
        ax.set_title("load: 256 concurrent mixed requests")
        fig.tight_layout()
        path = out_dir / "load_latency.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer shapes")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a smoke test's size, in the sections that have one (capture_op, small_model, "
        "small_model_modes, host_time, harvest, scale_out); its figures mean nothing",
    )
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help="print the table and redraw the plots of a results JSON",
    )
    args = parser.parse_args(argv)
    if args.report is not None:
        return report_from(args.report)
    args.quick = args.quick or args.tiny  # the sections without a tiny size
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")

    results: dict = {
        "machine": machine(),
        "rounds": args.rounds,
        "quick": args.quick,
        "tiny": args.tiny,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "comparisons": [],
    }
    report: list[str] = []
    with tqdm(total=len(sections), desc="benchmarks", unit="section") as bar:
        for section in sections:
            bar.set_postfix_str(section)
            started = time.perf_counter()
            if section == "payload":
                from benchmarks import payload

                results["payload"] = payload.run(args.rounds, args.quick)
                report += payload.lines(results["payload"])
            elif section == "capture_op":
                from benchmarks.gpu import capture_op

                results["capture_op"] = capture_op.run(args.quick, args.tiny)
                report += capture_op.lines(results["capture_op"])
            elif section == "load":
                from benchmarks import load

                results["load"] = load.run(quick=args.quick, model=args.model)
                report += load.summary_lines(results["load"])
            else:
                module = importlib.import_module(
                    {
                        "offline": "benchmarks.offline",
                        "server": "benchmarks.server_throughput",
                        "small_model": "benchmarks.small_model",
                        "host_time": "benchmarks.host_time",
                        "small_model_modes": "benchmarks.small_model_modes",
                        "points": "benchmarks.points",
                        "points_wide": "benchmarks.points_wide",
                        "points_peers": "benchmarks.points_peers",
                        "steering": "benchmarks.steering",
                        "steering_peers": "benchmarks.steering_peers",
                        "patching": "benchmarks.patching",
                        "prompt": "benchmarks.prompt_states",
                        "peers": "benchmarks.peers",
                        "harvest": "benchmarks.harvest",
                        "sae_payload": "benchmarks.sae_payload",
                        "probes": "benchmarks.probes",
                        "scale_out": "benchmarks.scale_out",
                    }[section]
                )
                kwargs: dict = {"model": args.model} if args.model else {}
                if args.tiny and "tiny" in inspect.signature(module.run).parameters:
                    kwargs["tiny"] = True
                comps: list[Comparison] = module.run(args.rounds, args.quick, **kwargs)
                for comp in comps:
                    results["comparisons"].append(comp.summary())
                    report += comp.lines()
            results.setdefault("seconds", {})[section] = time.perf_counter() - started
            write_results(results)  # keep partial results if a later section fails
            bar.update(1)

    plots = _plot(results, RESULTS)
    results["plots"] = [str(p) for p in plots]
    path = write_results(results)
    print("\n".join(report))
    print(f"\nresults: {path}" + "".join(f"\nplot: {p}" for p in plots))
    return results


def report_lines(results: dict) -> list[str]:
    """The printed table, rebuilt from a results dict."""
    from benchmarks import load, payload

    lines: list[str] = []
    if results.get("payload"):
        lines += payload.lines(results["payload"])
    for comp in results.get("comparisons", []):
        lines.append(
            f"{comp['name']} ({comp['unit']}, median; ratio = median per-round "
            f"vs {comp['baseline']})"
        )
        for name, v in comp["variants"].items():
            row = f"  {name:<34s} {v['median']:>12.2f}"
            if "ratio" in v:
                row += f"   x{v['ratio']:.3f}"
                if "target" in v:
                    row += (
                        f"   target >= {v['target']:.2f}: "
                        f"{'MET' if v['meets_target'] else 'MISSED'}"
                    )
            lines.append(row)
        if comp.get("notes"):
            lines.append(f"  note: {comp['notes']}")
    if results.get("load"):
        lines += load.summary_lines(results["load"])
    return lines


def report_from(path: Path) -> dict:
    import json

    results = json.loads(path.read_text())
    plots = _plot(results, path.parent)
    print("\n".join(report_lines(results)))
    print("".join(f"\nplot: {p}" for p in plots))
    return results


if __name__ == "__main__":
    main()
