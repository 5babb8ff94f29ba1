# SPDX-License-Identifier: Apache-2.0
"""Host time per decode step (issue 55): what the overlay's Python adds to
each engine step, in microseconds and as a share of vLLM's own host time per
step, at batch 1, 16 and 64. Measured with a profiler around the call-outs,
not as a throughput difference: on a GPU the device time of a step shrinks
and this host time stays, so the share measured here is the one a GPU step
pays where the host, not the device, bounds the step.

Model: the small-model section's random 5-layer, 256-wide Llama (float32,
torch.compile'd). Per batch size ``b``: engines started with
``max_num_seqs = b``, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so that the engine core's step, the worker's model runner and the front-end's
output processing all run under one profiler. Each run adds ``b`` requests of
48 fresh random prompt tokens (64 generated, greedy, ``ignore_eos``), steps
the engine unprofiled until every request has its first token (prefill), then
profiles (``cProfile``) every later step to the end: the decode phase.
Variants:

* plain vLLM, an engine started without hidden states;
* the overlay's engine (``enable_hidden_states=True``, every layer
  capturable, and ``probes=DIR`` with one probe at HF layer 2), nobody asks;
* the same engine, every request asks ``return_hidden_states`` "last" at
  layer -1;
* every request asks "generated" at layer -1 (one row per generated token:
  the per-token path, a hand-out per step);
* every request asks the probe on every generated token.

Attribution, from the profile's call edges:

* overlay = the sum, over edges whose caller is not a function of
  ``vllm_hidden_states`` and whose callee is, of the callee's cumulative time
  on that edge: the package's functions entered from vLLM (the patches'
  call-outs and the package's hooks), with everything they call. Edges that a
  stack-aware pass (:func:`classify_entries`, ``sys.setprofile``, a few
  steps) saw only inside the model forward are left out and reported apart
  ("in forward"): on a GPU they are in the captured graph or device work. An
  entry the pass saw only inside another package entry is left out too (it is
  in its caller's time already). On the compiled model the pass finds no
  package function inside the forward (the capture and probe taps are ops in
  the compiled graph), so "in forward" reads 0; the eager engines of
  ``--tiny`` show the capture points' Python there.
* model forward = the cumulative time of the runner's ``_model_forward``
  (``GPUModelRunner._model_forward``, which the CPU runner inherits): device
  time on a GPU.
* vLLM host = ``LLMEngine.step`` (in process: the engine core's step, the
  runner's ``execute_model`` and ``sample_tokens``, the front-end's output
  processing) less the forward, less the overlay. On CPU it still holds the
  logits matmul and the sampler's arithmetic, which a GPU runs on the device:
  on this model (vocabulary 512) they are small, and leaving them in makes
  the denominator larger, the share smaller, by that much.
* steps = calls of ``EngineCore.step`` in the profile.

Clock: CPU time of this thread (``time.thread_time``, the profiler's timer
too). In process, with vLLM's CPU worker on one OpenMP thread (its ``auto``
binding on a 2-core box), the engine core, the runner, the forward and the
front-end all run on the calling thread, so its CPU time is the step's host
work, and the other load of a shared machine (preemption) stays out of it:
at a load average of 10-40 on the 2-core box a wall clock measured
decode steps of ~0.5 s at batch 16, ~50 x a quiet box's. What load still
does to CPU time (caches, memory bandwidth, a shared core) shows most in
the forward and in vLLM's tensor work, less in the overlay's Python: its µs
repeat within a few percent from round to round where vLLM's host µs move by
up to 2 x, so read the shares of a loaded run as indicative.

Profiler inflation: ``cProfile`` adds a roughly fixed cost to every Python
call it sees, so the profiled step is longer than an unprofiled one (the
first round also runs each variant's decode phase unprofiled, the same
clock around ``LLMEngine.step``, and the record gives the factor,
``inflation``). The share
is robust to it to the extent that the overlay's code and vLLM's host code
make calls at a similar density per microsecond: both the numerator and the
denominator are profiled, so a uniform inflation cancels in the ratio; the
overlay's µs are then an upper bound of its unprofiled µs, by up to the
inflation factor. The plain engine's "vLLM host" beside the overlay engine's
is a check of the attribution: the difference is host time the overlay adds
inside vLLM's own functions (patched lines that call nothing in the package)
plus noise.

Rounds: each round runs every variant once, in a rotating order; the figures
are medians over rounds (per-round shares, then their median).

Run alone: ``python -m benchmarks.host_time [--rounds N] [--tiny]``; in
``make bench``: ``python -m benchmarks.run --only host_time``. ``--tiny``:
batch 1 and 4, 8-token prompts, 4 generated tokens, eager engines, one
discovery step (a smoke test; its figures mean nothing).
"""

import cProfile
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, Comparison, in_process_engines, write_results
from benchmarks.offline import FreshPrompts
from benchmarks.probes import write_probe
from benchmarks.small_model import ARGS, MAX_TOKENS, PROMPT_LEN, model_shape, small_model

BATCHES = (1, 16, 64)
TINY_BATCHES = (1, 4)
PLAIN = "plain vLLM"
UNUSED = "overlay, nobody asks"
LAST = 'overlay, "last" layer -1'
GENERATED = 'overlay, "generated" layer -1'
PROBE = "overlay, probe every token"
VARIANTS = (PLAIN, UNUSED, LAST, GENERATED, PROBE)
ASKS: dict[str, dict[str, Any]] = {
    PLAIN: {},
    UNUSED: {},
    LAST: {"return_hidden_states": True, "hidden_states_layers": [-1]},
    GENERATED: {
        "return_hidden_states": True,
        "hidden_states_layers": [-1],
        "hidden_states_positions": "generated",
    },
    PROBE: {"probes": ["probe"], "hidden_states_positions": "generated"},
}
TOP = 10
KV_CACHE_GIB = "1"

PACKAGE = f"{os.sep}vllm_hidden_states{os.sep}"
Key = tuple[str, int, str]  # cProfile's (file, line, function)


def in_package(key: Key) -> bool:
    return PACKAGE in key[0] and f"{os.sep}patches{os.sep}" not in key[0]


def is_forward(key: Key) -> bool:
    return key[2] == "_model_forward" and f"v1{os.sep}worker" in key[0]


def is_llm_engine_step(key: Key) -> bool:
    return key[2] == "step" and key[0].endswith(os.path.join("v1", "engine", "llm_engine.py"))


def is_core_step(key: Key) -> bool:
    return key[2] == "step" and key[0].endswith(os.path.join("v1", "engine", "core.py"))


def short(key: Key) -> str:
    """``module.function`` of a package function (``wire.split_group``)."""
    path = key[0].split(PACKAGE, 1)[-1].removesuffix(".py").replace(os.sep, ".")
    return f"{path}.{key[2]}"


def code_key(code) -> Key:
    return (code.co_filename, code.co_firstlineno, code.co_name)


def classify_entries(step) -> dict[tuple[Key, Key], set[str]]:
    """Run ``step()`` under a stack-aware ``sys.setprofile`` hook: for each
    call edge into a package function, where it was seen: "forward" (the
    runner's ``_model_forward`` on the stack); else, for an entry from
    outside the package, "nested" (another package entry on the stack) or
    "top", and for a call inside the package, "inside". Slow (a Python callback per call): a few
    steps only."""
    seen: dict[tuple[Key, Key], set[str]] = {}
    stack: list[tuple[bool, bool]] = []  # (in forward, in a package entry) per Python frame

    def hook(frame, event, arg):
        if event == "call":
            key = code_key(frame.f_code)
            caller = frame.f_back
            outer_forward, outer_package = stack[-1] if stack else (False, False)
            if in_package(key) and caller is not None:
                caller_key = code_key(caller.f_code)
                if in_package(caller_key):  # a call inside the package: only where
                    where = "forward" if outer_forward else "inside"
                else:
                    where = "forward" if outer_forward else "nested" if outer_package else "top"
                    outer_package = True
                seen.setdefault((caller_key, key), set()).add(where)
            stack.append((outer_forward or is_forward(key), outer_package))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


@dataclass
class StepProfile:
    """One decode phase's attribution, in µs per step."""

    steps: int
    step_us: float  # LLMEngine.step, profiled
    forward_us: float
    overlay_us: float
    in_forward_us: float
    vllm_host_us: float
    functions: dict[
        str, tuple[float, float, int]
    ]  # name -> (cumulative µs, own µs, calls) per step


def attribute(stats: dict, excluded: set[tuple[Key, Key]], in_forward: set[tuple[Key, Key]]):
    """A :class:`StepProfile` from ``pstats``' raw ``stats``."""
    steps = sum(v[1] for k, v in stats.items() if is_core_step(k))
    step_s = sum(v[3] for k, v in stats.items() if is_llm_engine_step(k))
    forward_s = 0.0
    for key, (_, _, _, _, callers) in stats.items():
        if is_forward(key):  # outermost calls only (an override calling super())
            forward_s += sum(e[3] for c, e in callers.items() if not is_forward(c))
    overlay_s = in_forward_s = 0.0
    functions: dict[str, list[float]] = {}  # name -> [cumulative s, own s, calls]
    for key, (_, _, _, _, callers) in stats.items():
        if not in_package(key):
            continue
        for caller, (_, nc, tt, ct) in callers.items():
            edge = (caller, key)
            if edge in in_forward:  # not the overlay's host time, nor in its table
                if not in_package(caller):
                    in_forward_s += ct
                continue
            row = functions.setdefault(short(key), [0.0, 0.0, 0])
            row[0] += ct
            row[1] += tt
            row[2] += nc
            if not in_package(caller) and edge not in excluded:
                overlay_s += ct
    per = 1e6 / max(steps, 1)
    return StepProfile(
        steps=steps,
        step_us=step_s * per,
        forward_us=forward_s * per,
        overlay_us=overlay_s * per,
        in_forward_us=in_forward_s * per,
        vllm_host_us=(step_s - forward_s - overlay_s) * per,
        functions={
            n: (c * per, t * per, round(k / max(steps, 1), 1)) for n, (c, t, k) in functions.items()
        },
    )


@dataclass
class Engine:
    """One engine of a batch size, and its requests' parameters per variant."""

    llm: Any
    ids: int = 0

    def add(self, prompts: list, params) -> None:
        for prompt in prompts:
            self.ids += 1
            self.llm.llm_engine.add_request(f"ht-{self.ids}", prompt, params)

    def prefill(self, n: int) -> None:
        """Step, unprofiled, until each of the ``n`` requests has a token."""
        started: set[str] = set()
        engine = self.llm.llm_engine
        while len(started) < n and engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)

    def decode(self, asks: dict, profile: cProfile.Profile | None) -> tuple[float, int, list]:
        """The rest of the requests' steps; (seconds in ``LLMEngine.step``,
        steps, finished outputs), under ``profile`` when given."""
        engine = self.llm.llm_engine
        seconds, steps, finished = 0.0, 0, []
        while engine.has_unfinished_requests():
            if profile is not None:
                profile.enable()
            start = time.thread_time()
            outputs = engine.step()
            seconds += time.thread_time() - start
            if profile is not None:
                profile.disable()
            steps += 1
            finished += [o for o in outputs if o.finished]
        if asks.get("return_hidden_states") and not all(
            o.outputs[0].hidden_states for o in finished
        ):
            raise RuntimeError("a request that asked has no hidden states")
        if asks.get("probes") and not all(o.outputs[0].probe_scores for o in finished):
            raise RuntimeError("a request that asked a probe has no probe scores")
        return seconds, steps, finished


@dataclass
class HostTime(Comparison):
    """One batch size's figures: ``samples`` holds the overlay's µs per decode
    step; the rest, per variant, in ``figures`` (lists over rounds) and
    ``top`` (the package's functions, medians over rounds)."""

    batch: int = 0
    figures: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    top: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def record(self, variant: str, profile: StepProfile, unprofiled_us: float) -> None:
        self.add(variant, profile.overlay_us)
        row = self.figures.setdefault(variant, {})
        values = {
            "vllm_host_us": profile.vllm_host_us,
            "share": profile.overlay_us / profile.vllm_host_us,
            "forward_us": profile.forward_us,
            "in_forward_us": profile.in_forward_us,
            "step_us_profiled": profile.step_us,
            "step_us_unprofiled": unprofiled_us,
            "inflation": profile.step_us / unprofiled_us,
            "steps": profile.steps,
        }
        for name, value in values.items():
            row.setdefault(name, []).append(value)
        functions = row.setdefault("_functions", {})  # name -> [(cum, own, calls)] per round
        for name, figure in profile.functions.items():
            functions.setdefault(name, []).append(figure)

    def finish(self) -> None:
        """Median each function's figures over rounds, keep the top ones."""
        for variant, row in self.figures.items():
            functions = row.pop("_functions", {})
            ranked = sorted(
                (
                    {
                        "function": name,
                        "cumulative_us": statistics.median(f[0] for f in figures),
                        "own_us": statistics.median(f[1] for f in figures),
                        "calls_per_step": statistics.median(f[2] for f in figures),
                    }
                    for name, figures in functions.items()
                ),
                key=lambda r: -r["cumulative_us"],
            )
            self.top[variant] = ranked[:TOP]

    def value(self, variant: str, name: str) -> float:
        if name == "overlay_us":
            return self.median(variant)
        return statistics.median(self.figures[variant][name])

    def summary(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "unit": self.unit,
            "baseline": self.baseline,
            "notes": self.notes,
            "batch": self.batch,
            "variants": {},
        }
        for variant, samples in self.samples.items():
            entry: dict[str, Any] = {"median": self.median(variant), "samples": samples}
            for name, values in self.figures[variant].items():
                entry[name] = statistics.median(values)
                entry[f"{name}_samples"] = values
            entry["top_functions"] = self.top.get(variant, [])
            out["variants"][variant] = entry
        return out

    def lines(self) -> list[str]:
        rows = [
            f"{self.name} (µs per decode step, medians over {len(self.samples[PLAIN])} rounds)",
            f"  {'variant':<30s} {'overlay':>9s} {'vLLM host':>10s} {'share':>7s} "
            f"{'forward':>9s} {'in fwd':>7s} {'steps':>6s} {'inflation':>9s}",
        ]
        for variant in self.samples:
            rows.append(
                f"  {variant:<30s} {self.median(variant):>9.1f} "
                f"{self.value(variant, 'vllm_host_us'):>10.1f} "
                f"{100 * self.value(variant, 'share'):>6.2f}% "
                f"{self.value(variant, 'forward_us'):>9.1f} "
                f"{self.value(variant, 'in_forward_us'):>7.1f} "
                f"{self.value(variant, 'steps'):>6.0f} "
                f"{self.value(variant, 'inflation'):>8.2f}x"
            )
        for variant in (UNUSED, GENERATED, PROBE):
            if self.top.get(variant):
                rows.append(f"  top package functions, {variant} (cumulative / own µs per step):")
                rows += [
                    f"    {f['function']:<52s} {f['cumulative_us']:>8.1f} {f['own_us']:>8.1f}"
                    f"  x{f['calls_per_step']:g}"
                    for f in self.top[variant]
                ]
        if self.notes:
            rows.append(f"  note: {self.notes}")
        return rows


def measure_batch(
    model: Path, probes_dir: Path, batch: int, rounds: int, tiny: bool, progress=None
) -> HostTime:
    from vllm import LLM, SamplingParams

    prompt_len, max_tokens = (8, 4) if tiny else (PROMPT_LEN, MAX_TOKENS)
    prompts = FreshPrompts(batch, prompt_len)
    args = dict(ARGS, max_num_seqs=batch, **({"enforce_eager": True} if tiny else {}))

    def params(variant: str, tokens: int = max_tokens) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **ASKS[variant])

    with in_process_engines(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB):
        plain = Engine(LLM(model=str(model), **args))
        overlay = Engine(
            LLM(model=str(model), enable_hidden_states=True, probes=str(probes_dir), **args)
        )
    engines = {v: plain if v == PLAIN else overlay for v in VARIANTS}
    excluded: dict[str, set] = {}
    in_forward: dict[str, set] = {}
    for variant in VARIANTS:  # warm-up (compilation, caches), then the stack-aware pass
        engine = engines[variant]
        engine.llm.generate(prompts(), params(variant, 4), use_tqdm=False)
        engine.add(prompts(), params(variant, 3))
        engine.prefill(batch)
        seen = classify_entries(lambda e=engine: e.decode({}, None))
        in_forward[variant] = {edge for edge, where in seen.items() if where == {"forward"}}
        excluded[variant] = {edge for edge, where in seen.items() if "top" not in where}
    result = HostTime(
        f"host time per decode step: batch {batch}",
        "overlay µs per decode step",
        baseline=PLAIN,
        higher_is_better=False,
        batch=batch,
        notes=(
            f"{model_shape(model)}, max_num_seqs {batch}, {batch} requests x ({prompt_len} "
            f"prompt + {max_tokens} generated tokens), fresh prompts; the decode phase "
            "profiled with cProfile; engines in this process"
        ),
    )
    unprofiled: dict[str, float] = {}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            engine = engines[variant]
            # CPU time of this thread (the engine's, in process): what the
            # other load on the machine does to the wall clock stays out.
            profile = cProfile.Profile(time.thread_time)
            engine.add(prompts(), params(variant))
            engine.prefill(batch)
            engine.decode(ASKS[variant], profile)
            profile.create_stats()
            step_profile = attribute(profile.stats, excluded[variant], in_forward[variant])
            if r == 0:  # the same, unprofiled, once: the profiler's inflation
                engine.add(prompts(), params(variant))
                engine.prefill(batch)
                seconds, steps, _ = engine.decode(ASKS[variant], None)
                unprofiled[variant] = 1e6 * seconds / steps
            result.record(variant, step_profile, unprofiled[variant])
            if progress is not None:
                progress.update(1)
    result.finish()
    for engine in (plain, overlay):
        engine.llm.llm_engine.engine_core.shutdown()
    return result


def plot(results: list[HostTime], path: Path) -> Path:
    """Stacked bars per batch: vLLM host and overlay µs per step, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.6), squeeze=False)
    for ax, result in zip(axes[0], results):
        names = list(result.samples)
        host = [result.value(v, "vllm_host_us") for v in names]
        overlay = [result.median(v) for v in names]
        x = range(len(names))
        ax.bar(x, host, color="#4c72b0", label="vLLM host")
        ax.bar(x, overlay, bottom=host, color="#dd8452", label="overlay")
        for i, (h, o) in enumerate(zip(host, overlay)):
            if o > 0:  # the median of the per-round shares, as in the table
                share = 100 * result.value(names[i], "share")
                ax.text(i, h + o, f"{share:.1f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [n.replace("overlay, ", "") for n in names], rotation=35, ha="right")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"batch {result.batch}")
        ax.set_ylabel("host µs per decode step (profiled)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("host time per decode step: vLLM's own vs the overlay's (label: share)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(
    rounds: int, quick: bool, model: Path | None = None, progress=None, tiny: bool = False
) -> list[Comparison]:
    """``quick``: batch 1 and 16 only."""
    model = Path(model or small_model())
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    probes_dir = write_probe(model.parent / f"{model.name}-bench-probes", hidden)
    batches = TINY_BATCHES if tiny else BATCHES[:2] if quick else BATCHES
    results: list[HostTime] = []
    for batch in batches:
        results.append(
            measure_batch(model, probes_dir, batch, 1 if tiny else rounds, tiny, progress)
        )
        write_results({"host_time": [r.summary() for r in results]}, stem="host_time-partial")
    path = plot(results, RESULTS / "host_time.png")
    for result in results:
        result.notes += f"; plot: {path.name}"
    return list(results)


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "host_time")
