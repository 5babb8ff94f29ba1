# SPDX-License-Identifier: Apache-2.0
"""``vllm_hidden_states._C``: the capture and steering ops compiled from
``csrc/`` (``torch.ops.vllm_hidden_states.capture`` / ``.steer``, the same
arguments as ``torch.ops.vllm.hidden_states_capture`` / ``_steer``).

``setup.py`` builds it where CMake and a C++ compiler are found (CUDA kernels
too where nvcc and a CUDA torch are); a failed or skipped build
(``VLLM_HIDDEN_STATES_BUILD_C=0``) leaves the package without it, and the ops
run by their Python, Triton and aten routes. Which routes run where:
:func:`describe`, logged once at engine start by the capture points.
"""

import importlib

import torch

_loaded: bool | None = None
_why_not = ""
_disabled = False


def load() -> bool:
    """Import ``_C`` once per process (registering its ops); whether its ops
    are usable (not built, or turned off by :func:`disable`: False)."""
    global _loaded, _why_not
    if _loaded is None:
        try:
            importlib.import_module("vllm_hidden_states._C")
            _loaded = hasattr(torch.ops.vllm_hidden_states, "capture")
            if not _loaded:
                _why_not = "vllm_hidden_states._C registered no ops"
        except ImportError as e:
            _loaded = False
            _why_not = f"vllm_hidden_states._C not built ({e})"
    return _loaded and not _disabled


def why_not() -> str:
    """Why :func:`load` answers False ("" when it answers True)."""
    if load():
        return ""
    return "turned off (c_ops.disable)" if _disabled else _why_not


def disable(off: bool = True) -> None:
    """Use the Python routes even where ``_C`` is built (benchmarks' "before",
    tests of the fallback)."""
    global _disabled
    _disabled = off


def has_cuda_kernels() -> bool:
    """Whether ``_C`` was built with its CUDA kernels."""
    if not load():
        return False
    return torch.ops.vllm_hidden_states.capture.default.has_kernel_for_dispatch_key("CUDA")


def capture_op():
    """``torch.ops.vllm_hidden_states.capture.default``, or None without ``_C``."""
    return torch.ops.vllm_hidden_states.capture.default if load() else None


def steer_op():
    """``torch.ops.vllm_hidden_states.steer.default``, or None without ``_C``."""
    return torch.ops.vllm_hidden_states.steer.default if load() else None
