# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels of ``vllm_hidden_states._C`` compile with nvcc, for the
architectures ``CMakeLists.txt`` builds (sm_80 and sm_90), against the
installed torch's headers: a compile-only check for machines with nvcc but
no CUDA torch (where ``setup.py`` builds the CPU kernels only). Running them
is the GPU tier's (``tests/gpu/test_c_ops_gpu.py``).

A CPU torch ships ``c10/cuda``'s headers but not the one its CMake build
generates (``c10/cuda/impl/cuda_cmake_macros.h``); the check writes that
one line (a shared-library build, as CUDA torch wheels are) in a temporary
include directory, placed after torch's own so that a CUDA torch's copy wins.
"""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GENCODE = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    found = shutil.which("nvcc")
    if found is None and home and Path(home, "bin", "nvcc").exists():
        found = str(Path(home, "bin", "nvcc"))
    return found


def test_the_cuda_kernels_compile_with_nvcc_for_sm80_and_sm90(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed here (nor under CUDA_HOME): nothing to compile with")
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    generated = Path("c10/cuda/impl/cuda_cmake_macros.h")
    if not any((Path(d) / generated).exists() for d in includes):
        (tmp_path / generated).parent.mkdir(parents=True)
        (tmp_path / generated).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path))
    cmd = [
        nvcc,
        "-c",
        str(REPO / "csrc" / "ops.cu"),
        "-o",
        str(tmp_path / "ops.o"),
        "-std=c++20",
        "--fmad=false",
        *GENCODE,
        *(f"-I{d}" for d in includes),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"$ {' '.join(cmd)}\n{result.stderr[-4000:]}"
    assert (tmp_path / "ops.o").stat().st_size > 0
