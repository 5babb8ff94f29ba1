# SPDX-License-Identifier: Apache-2.0
"""Shared benchmark machinery: models, servers, A/B rounds, results, targets.

Every comparison runs its variants in one session, each once per round for
``rounds`` rounds, in a balanced order (:func:`balanced_orders`), and reports
the median of each variant and the median of the per-round ratios (variant /
baseline of the same round), which cancels slow drifts of the machine
(thermal, other load) better than a ratio of medians, with the ratios'
geometric mean and its standard error: on the 2-core development box a single
round's ratio spreads by about +-0.1, so a 1-3% target needs ~100 rounds before
the standard error is smaller than the gap.
"""

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.support.server_process import ServerProcess, rss_by_process  # noqa: F401 (load.py)

REPO = Path(__file__).resolve().parent.parent
# Where results, plots and server logs go (a smoke test points it elsewhere).
RESULTS = Path(os.environ.get("VLLM_HIDDEN_STATES_BENCH_RESULTS", REPO / "benchmarks" / "results"))
MODELS = Path(os.environ.get("VLLM_HIDDEN_STATES_MODELS", REPO / ".models"))


def bench_model(kind: str = "default") -> Path:
    """The benchmark model: a ~130M-parameter random Qwen3 (12 x 1024), large
    enough that compute, not Python overhead, dominates on a CPU."""
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    if kind == "tiny":
        return build_tiny_model(MODELS / "tiny-qwen3", arch="qwen3")
    return build_tiny_model(
        MODELS / "bench-qwen3",
        arch="qwen3",
        num_layers=12,
        hidden_size=1024,
        intermediate_size=2816,
        vocab_size=512,
    )


def machine() -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["mem_gib"] = round(int(mem) / 2**20, 1)
    except OSError:
        pass
    return info


@dataclass
class Comparison:
    """One A/B(/C...) comparison: per-variant samples, in rounds."""

    name: str
    unit: str
    baseline: str
    higher_is_better: bool = True
    samples: dict[str, list[float]] = field(default_factory=dict)
    targets: dict[str, float] = field(default_factory=dict)  # variant -> min ratio
    notes: str = ""

    def add(self, variant: str, value: float) -> None:
        self.samples.setdefault(variant, []).append(value)

    def median(self, variant: str) -> float:
        return statistics.median(self.samples[variant])

    def ratio(self, variant: str) -> float:
        """Median over rounds of variant / baseline (same round)."""
        return statistics.median(self.round_ratios(variant))

    def round_ratios(self, variant: str) -> list[float]:
        """variant / baseline, round by round."""
        return [v / b for v, b in zip(self.samples[variant], self.samples[self.baseline])]

    def ratio_geomean(self, variant: str) -> tuple[float, float]:
        """Geometric mean of the per-round ratios and its standard error (0
        for one round): how far a target may be from the measured ratio on a
        noisy machine before the rounds can tell them apart.

        Geometric, not arithmetic: with each run's time noisy by a CV ``c``,
        the arithmetic mean of ``b / a`` reads about ``1 + c**2`` for two
        identical engines (an A/A control on the 2-core box read 1.02 at
        ``c`` ~ 0.1); the mean of ``log(b / a)`` is symmetric in ``a`` and
        ``b``. The error is the delta method's, ``g * sd(log r) / sqrt(n)``."""
        logs = [math.log(r) for r in self.round_ratios(variant)]
        geomean = math.exp(statistics.fmean(logs))
        if len(logs) < 2:
            return geomean, 0.0
        return geomean, geomean * statistics.stdev(logs) / len(logs) ** 0.5

    def summary(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "unit": self.unit,
            "baseline": self.baseline,
            "notes": self.notes,
            "variants": {},
        }
        for v in self.samples:
            entry = {"median": self.median(v), "samples": self.samples[v]}
            if v != self.baseline:
                entry["ratio"] = self.ratio(v)
                entry["ratio_geomean"], entry["ratio_geomean_stderr"] = self.ratio_geomean(v)
                if v in self.targets:
                    entry["target"] = self.targets[v]
                    entry["meets_target"] = entry["ratio"] >= self.targets[v]
            out["variants"][v] = entry
        return out

    def lines(self) -> list[str]:
        rows = [f"{self.name} ({self.unit}, median; ratio = median per-round vs {self.baseline})"]
        for v in self.samples:
            row = f"  {v:<34s} {self.median(v):>12.2f}"
            if v != self.baseline:
                geomean, stderr = self.ratio_geomean(v)
                row += f"   x{self.ratio(v):.3f} (geomean {geomean:.3f} +- {stderr:.3f})"
                if v in self.targets:
                    ok = self.ratio(v) >= self.targets[v]
                    row += f"   target >= {self.targets[v]:.2f}: {'MET' if ok else 'MISSED'}"
            rows.append(row)
        if self.notes:
            rows.append(f"  note: {self.notes}")
        return rows


# Seconds to wait before each timed run: past the 1 s for which an idle
# engine's worker keeps spinning on its message queue (vLLM's SpinCondition).
SETTLE_S = 1.5


def balanced_orders(n: int) -> list[list[int]]:
    """Run orders for ``n`` variants (a Williams design): over one cycle of
    ``n`` orders (``2n`` for odd ``n``) every variant runs in every slot
    equally often, and every variant runs right after every other variant
    equally often. The second matters as much as the first: a run after
    another engine's run meets cold caches and an idle worker, and an order
    that only rotates keeps each variant's predecessor fixed for every round,
    so the cost of following one particular variant never averages out."""
    first, low, high = [0], 1, n - 1
    while low <= high:
        first.append(low)
        low += 1
        if low <= high:
            first.append(high)
            high -= 1
    orders = [[(v + shift) % n for v in first] for shift in range(n)]
    if n % 2:
        orders += [order[::-1] for order in orders]
    return orders


def alternate(
    comparison: Comparison, variants: dict[str, Callable[[], float]], rounds: int, progress=None
) -> Comparison:
    """Run each variant once per round, for ``rounds`` rounds, in the
    :func:`balanced_orders` of the variants, so that neither a slot's nor a
    predecessor's warmth or coldness is read as a variant's cost (a fixed order
    put plain vLLM first every round, after the other engine's three runs, and
    measured "nobody asks" at x1.02-1.05 of it). The balance is exact when
    ``rounds`` is a multiple of the cycle (``len(variants)``, twice that when
    odd)."""
    items = list(variants.items())
    orders = balanced_orders(len(items))
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            name, fn = items[i]
            # The engine that ran last keeps its worker busy-polling vLLM's
            # shared-memory queue for a second after its last read; on a small
            # box that takes a core from the next run when it is another
            # engine's. Wait it out.
            time.sleep(SETTLE_S)
            comparison.add(name, fn())
            if progress is not None:
                progress.update(1)
    return comparison


@dataclass
class StepRun:
    """One variant of a step-interleaved comparison (:func:`interleave_steps`):
    its own engine, in this process (an ``LLM`` built under
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: see :func:`in_process_engines`), and
    the sampling parameters of its requests (a list: a round's request ``i``
    takes ``params[i % len(params)]``, e.g. each its own patch). ``asks``: the
    requests ask for hidden states, so each finished one must carry them."""

    llm: Any
    params: Any  # vllm.SamplingParams, or a list of them
    asks: bool = False

    def params_of(self, i: int) -> Any:
        """The sampling parameters of a round's request ``i``."""
        if isinstance(self.params, list):
            return self.params[i % len(self.params)]
        return self.params


@contextmanager
def in_process_engines(**env: str) -> Iterator[None]:
    """``LLM`` s built inside run their engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that a caller can step several
    engines in turn; ``env``: more variables for these engines only (e.g.
    ``VLLM_CPU_KVCACHE_SPACE``). Every variable is restored on exit."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def interleave_steps(
    comparison: Comparison,
    variants: dict[str, StepRun],
    prompts: Callable[[], list],
    rounds: int,
    progress=None,
) -> Comparison:
    """Step-interleaved rounds: each round gives every variant's engine the
    same number of fresh requests (``prompts()``), then steps the engines in
    turn, one engine step each (a :func:`balanced_orders` order per turn),
    until all are done; a variant's value for the round is its generated
    tokens per second of its own steps.

    Why: whole runs one after another (:func:`alternate`) see the machine's
    drifts over seconds as differences between variants (a run-to-run spread
    of +-10% on the 2-core box, and an idle engine's worker spinning for a
    second into the next run); steps ~10 ms apart see the same machine. On
    that box the per-round ratios' standard error fell from ~0.013 (72 whole
    rounds) to ~0.003-0.004 (64 interleaved rounds). What remains is a lasting
    difference between engine instances: two identical engines read 1.005 to
    1.016 of each other, so keep an A/A control beside the variants. Every
    engine must be in this process: elsewhere its core steps on its own and
    ``step()`` only reads."""
    names = list(variants)
    orders = balanced_orders(len(names))
    request_id = 0
    for _ in range(rounds):
        for name in names:
            run = variants[name]
            for i, prompt in enumerate(prompts()):
                request_id += 1
                run.llm.llm_engine.add_request(f"{name}-{request_id}", prompt, run.params_of(i))
        seconds = dict.fromkeys(names, 0.0)
        tokens = dict.fromkeys(names, 0)
        live = set(names)
        turn = 0
        while live:
            for i in orders[turn % len(orders)]:
                name = names[i]
                if name not in live:
                    continue
                engine = variants[name].llm.llm_engine
                start = time.perf_counter()
                outputs = engine.step()
                seconds[name] += time.perf_counter() - start
                for out in outputs:
                    if out.finished:
                        tokens[name] += len(out.outputs[0].token_ids)
                        if variants[name].asks and not out.outputs[0].hidden_states:
                            raise RuntimeError(f"{name}: {out.request_id} has no hidden states")
                if not engine.has_unfinished_requests():
                    live.discard(name)
            turn += 1
        for name in names:
            comparison.add(name, tokens[name] / seconds[name])
        if progress is not None:
            progress.update(len(names))
    return comparison


class Server(ServerProcess):
    """A benchmark server: :class:`ServerProcess` serving ``bench``, started at
    once, its log under ``benchmarks/results/``."""

    def __init__(
        self, model: Path | str, *args: str, name: str = "server", env: dict[str, str] | None = None
    ):
        full_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}
        full_env.update({k: os.environ[k] for k in full_env if k in os.environ})
        full_env.update(env or {})
        super().__init__(model, list(args), RESULTS / f"{name}.log", full_env, "bench")
        self.start()

    def wait(self, timeout: float = 600) -> "Server":
        self.wait_ready(timeout)
        return self


def section_main(
    run: Callable[..., list["Comparison"]], stem: str, argv: list[str] | None = None
) -> None:
    """``python -m benchmarks.<section>``: run one section alone, print its
    table and write ``benchmarks/results/<stem>.json``. ``--tiny`` where the
    section's ``run`` takes ``tiny``: the smallest run that goes through
    every step (a smoke test; its figures mean nothing)."""
    import argparse
    import inspect

    p = argparse.ArgumentParser(description=f"the {stem} benchmark section alone")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", type=Path, default=None)
    if "tiny" in inspect.signature(run).parameters:
        p.add_argument("--tiny", action="store_true", help="a smoke test's size")
    args = p.parse_args(argv)
    kwargs: dict[str, Any] = {"tiny": True} if getattr(args, "tiny", False) else {}
    if "progress" in inspect.signature(run).parameters:
        from tqdm import tqdm

        # One tick per variant run (the section knows no total up front).
        kwargs["progress"] = tqdm(desc=stem, unit="run")
    comps = run(args.rounds, args.quick, args.model, **kwargs)
    if "progress" in kwargs:
        kwargs["progress"].close()
    for comp in comps:
        print("\n".join(comp.lines()))
    path = write_results({"machine": machine(), stem: [c.summary() for c in comps]}, stem=stem)
    print(f"results: {path}")


def write_results(results: dict[str, Any], stem: str = "latest") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{stem}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    return path


def to_dict(obj) -> dict:
    return asdict(obj)
