# SPDX-License-Identifier: Apache-2.0
"""Metadata is in pyproject.toml; this file builds ``vllm_hidden_states._C``.

The compiled ops (csrc/, CMakeLists.txt) are built with CMake against the
installed torch where CMake and a C++ compiler are found, with the CUDA
kernels where nvcc and a CUDA torch are both found. A build that cannot run
or fails leaves the package without ``_C`` (its ops then run by the Python,
Triton and aten routes) and says so; it never fails the install.
``VLLM_HIDDEN_STATES_BUILD_C=0`` skips the build (a pure-Python package).
Build with ``pip install --no-build-isolation`` (the Makefile does): the
build needs the torch that will run it.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
ENV_SWITCH = "VLLM_HIDDEN_STATES_BUILD_C"


def _say(message: str) -> None:
    print(f"vllm-hidden-states: {message}", file=sys.stderr, flush=True)


def _cuda_wanted() -> bool:
    """nvcc on PATH (or under CUDA_HOME) and a torch built with CUDA."""
    try:
        import torch
    except ImportError:
        return False
    if torch.version.cuda is None:
        return False
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(shutil.which("nvcc") or (home and Path(home, "bin", "nvcc").exists()))


def _remove_inplace_library() -> None:
    """Remove a ``_C`` an earlier editable install built in the source tree,
    so that an editable install without it does not import a stale one."""
    for stale in (ROOT / "vllm_hidden_states").glob("_C*.so"):
        stale.unlink()


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class BuildWithCMake(build_ext):
    """Builds each :class:`CMakeExtension` with CMake; one that fails is
    dropped with a message, the rest of the install goes on."""

    def build_extensions(self) -> None:
        built = []
        for ext in self.extensions:
            try:
                self._build(ext)
                built.append(ext)
            except Exception as e:  # noqa: BLE001 - any failure falls back
                _say(
                    f"building {ext.name} failed ({e}); installing without it: "
                    "the capture and steering ops run by their Python/Triton/aten routes"
                )
                if self.inplace or getattr(self, "editable_mode", False):
                    _remove_inplace_library()
        # Only this command's list: the distribution keeps declaring the
        # extension, so the wheel keeps its platform layout (files at its
        # root, not under .data/purelib).
        self.extensions = built  # rebound: the same list object as ext_modules

    def _build(self, ext: Extension) -> None:
        if shutil.which("cmake") is None:
            raise RuntimeError("cmake not found")
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        # A library left by an earlier build must not ship if this one fails.
        target.unlink(missing_ok=True)
        cuda = _cuda_wanted()
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DVLLM_HIDDEN_STATES_CUDA={'ON' if cuda else 'OFF'}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build_dir / 'out'}",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        _say(f"building {ext.name} with CMake ({'CPU and CUDA' if cuda else 'CPU'} kernels)")
        for cmd in (
            configure,
            ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 1)],
        ):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
                raise RuntimeError(
                    f"`{' '.join(cmd[:2])}` exited {result.returncode}:\n" + "\n".join(tail)
                )
        [library] = (build_dir / "out").glob("_C*.so")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, target)


def _ext_modules() -> list[Extension]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _say(f"{ENV_SWITCH}=0: not building vllm_hidden_states._C")
        if "develop" in sys.argv or "editable_wheel" in sys.argv:
            _remove_inplace_library()
        return []
    return [CMakeExtension("vllm_hidden_states._C")]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": BuildWithCMake})
