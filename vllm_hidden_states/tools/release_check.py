# SPDX-License-Identifier: Apache-2.0
"""Keep every supported vLLM version honest without running it.

    vllm-hidden-states patch verify [--version X.Y.Z]

For each entry of :data:`vllm_hidden_states.versions.SUPPORTED`: fetch its
pristine wheel once (``pip download --no-deps`` into a cache outside the
repository, its sha256 checked against the table), extract the ``vllm``
package's Python sources into a scratch directory, apply that version's patch
set with zero fuzz, compile every patched file, and run the seam check there
(every vLLM name the package references resolves; every hunk lands inside a
named function or class, the same one on every supported version).

Imports neither vLLM nor torch: it reads sources only.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hidden_states import versions
from vllm_hidden_states.tools import seam

CACHE_ENV = "VLLM_HS_WHEEL_CACHE"


class CheckError(RuntimeError):
    """The check could not run (no wheel, no GNU patch), as opposed to a
    version that failed it."""


def wheel_cache() -> Path:
    """Where pristine wheels are kept: ``$VLLM_HS_WHEEL_CACHE``, else
    ``~/.cache/vllm-hidden-states/wheels`` (outside any checkout, so a fresh
    clone on the same machine downloads nothing)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "vllm-hidden-states" / "wheels"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(distribution: str, version: str, dest: Path) -> Path:
    """``pip download`` one wheel of ``distribution==version`` (no
    dependencies) into ``dest``; the path of the wheel."""
    dest.mkdir(parents=True, exist_ok=True)
    # Pinned to the x86-64 manylinux build: its Python is the same as any
    # other build's, and a fixed tag gives the same file on every machine.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--dest",
        str(dest),
        f"{distribution}=={version}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise CheckError(
            f"`{' '.join(cmd[2:])}` failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-800:]}. The check needs the registry once per "
            f"machine, or the wheel placed in {dest} (set ${CACHE_ENV} to use another directory)."
        )
    name = distribution.replace("-", "_")
    found = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if not found:
        raise CheckError(f"pip reported success but no {name}-{version}-*.whl is in {dest}")
    return found[0]


def fetch_wheel(entry: versions.SupportedVersion, cache: Path | None = None) -> Path:
    """The pristine wheel of ``entry``, downloaded on first use; its sha256
    must be the table's."""
    cache = cache or wheel_cache()
    path = cache / entry.wheel.filename
    if not path.is_file():
        download_wheel(entry.wheel.distribution, entry.version, cache)
    if not path.is_file():
        raise CheckError(
            f"expected {entry.wheel.filename} in {cache} after downloading "
            f"{entry.wheel.distribution}=={entry.version}; found "
            f"{sorted(p.name for p in cache.glob('*.whl'))}"
        )
    # Hashing 340 MB costs seconds of every run: a stamp beside the wheel
    # records a digest once verified, with the size and time it had then.
    stat = path.stat()
    verified = f"{entry.wheel.sha256} {stat.st_size} {stat.st_mtime_ns}"
    stamp = path.with_name(path.name + ".verified")
    if stamp.is_file() and stamp.read_text() == verified:
        return path
    digest = sha256_of(path)
    if digest != entry.wheel.sha256:
        raise CheckError(
            f"{path} has sha256 {digest}, not the {entry.wheel.sha256} that "
            f"versions.py records for vLLM {entry.version}: delete it to download it again"
        )
    stamp.write_text(verified)
    return path


def extract_sources(wheel: Path, dest: Path) -> Path:
    """The ``vllm`` package's ``.py`` files of ``wheel`` under ``dest``;
    returns ``dest/vllm`` (the layout the patches are rooted at)."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                z.extract(name, dest)
    return dest / "vllm"


# -- applying a set, hunk by hunk -----------------------------------------------

_HUNK = re.compile(
    r"^Hunk #(?P<n>\d+) (?P<how>succeeded|FAILED|ignored) at (?P<line>\d+)"
    r"(?: with fuzz (?P<fuzz>\d+))?(?: \(offset (?P<offset>-?\d+) lines?\))?\."
)
_FILE = re.compile(r"^(?:patching|checking) file '?(?P<path>[^']+?)'?$")


@dataclass(frozen=True)
class HunkResult:
    """What GNU patch did with one hunk."""

    patch: str
    file: str
    hunk: int  # 1-based, per file within the patch (GNU patch's numbering)
    line: int  # where it landed, or where it was tried
    applied: bool
    fuzz: int = 0
    offset: int = 0

    @property
    def exact(self) -> bool:
        return self.applied and self.fuzz == 0 and self.offset == 0

    def describe(self) -> str:
        where = f"{self.patch} {self.file} hunk #{self.hunk}"
        if not self.applied:
            return f"{where}: FAILED at line {self.line}"
        moved = f"moved {self.offset:+d} lines to {self.line}" if self.offset else ""
        fuzz = f"fuzz {self.fuzz}" if self.fuzz else ""
        return f"{where}: " + (", ".join(x for x in (moved, fuzz) if x) or "exact")


def run_patch(patch: Path, root: Path, fuzz: int, *flags: str) -> tuple[int, list[HunkResult], str]:
    """Apply ``patch`` under ``root`` (the directory holding ``vllm/``) with
    at most ``fuzz`` lines of fuzz; GNU patch's exit code, each hunk's
    result, and its output."""
    exe = shutil.which("patch")
    if exe is None:
        raise CheckError("GNU patch is required (apt-get install patch)")
    cmd = [exe, "-p1", "--forward", "--batch", "--verbose", f"--fuzz={fuzz}", "-d", str(root)]
    done = subprocess.run([*cmd, *flags, "-i", str(patch)], capture_output=True, text=True)
    results = []
    current = "?"
    for line in done.stdout.splitlines():
        if m := _FILE.match(line):
            current = m.group("path")
        elif m := _HUNK.match(line):
            results.append(
                HunkResult(
                    patch=patch.name,
                    file=current,
                    hunk=int(m.group("n")),
                    line=int(m.group("line")),
                    applied=m.group("how") == "succeeded",
                    fuzz=int(m.group("fuzz") or 0),
                    offset=int(m.group("offset") or 0),
                )
            )
    return done.returncode, results, done.stdout + done.stderr


def patched_files(patches: list[Path]) -> list[str]:
    """The vLLM files a set touches, ``vllm/...``, in first-touched order."""
    files: list[str] = []
    for patch in patches:
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                path = line[len("+++ b/") :].split("\t")[0]
                if path not in files:
                    files.append(path)
    return files


# -- the check of one version ------------------------------------------------------


@dataclass
class VersionReport:
    version: str
    hunks: list[HunkResult] = field(default_factory=list)
    compiled: int = 0
    references: int = 0
    sites: list[seam.PatchSite] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        moved = sum(1 for h in self.hunks if h.applied and h.offset)
        state = "ok" if not self.problems else f"{len(self.problems)} problems"
        return (
            f"vLLM {self.version}: {len(self.hunks)} hunks applied with zero fuzz "
            f"({moved} at an offset), {self.compiled} patched files compiled, "
            f"{self.references} vLLM references resolved, {len(self.sites)} patch sites: {state}"
        )


def check_sources(
    entry: versions.SupportedVersion, site: Path, patch_dir: Path | None = None
) -> VersionReport:
    """Apply ``entry``'s set (or the one in ``patch_dir``) with zero fuzz to
    the pristine sources under ``site`` (modified in place), compile what it
    patched, run the seam check there."""
    report = VersionReport(entry.version)
    patch_dir = patch_dir or entry.patch_dir
    patches = sorted(patch_dir.glob("*.patch"))
    if not patches:
        report.problems.append(f"no patches in {patch_dir}")
        return report
    for patch in patches:
        code, hunks, output = run_patch(patch, site, 0)
        report.hunks += hunks
        failed = [h for h in hunks if not h.applied]
        for h in failed:
            report.problems.append(
                f"{h.describe()} with zero fuzz on pristine vLLM {entry.version} "
                "(`vllm-hidden-states patch rebase` writes a set that applies)"
            )
        if code != 0 and not failed:
            report.problems.append(f"{patch.name}: GNU patch failed: {output.strip()[-400:]}")
    for rel in patched_files(patches):
        path = site / rel
        try:
            # What py_compile does, without writing a .pyc into the tree.
            compile(path.read_text(), str(path), "exec")
            report.compiled += 1
        except (SyntaxError, OSError) as e:
            report.problems.append(f"{rel} does not compile after patching: {e}")
    if report.problems:
        # The seam read on a tree the set did not fully patch, or that does
        # not parse, would only repeat the problems above.
        report.problems.append("seam check not run: the set must apply and compile first")
        return report
    root = site / "vllm"
    references = seam.package_references(root)
    report.references = len(references)
    report.problems += [f"seam: {p}" for p in seam.missing(references, root)]
    report.sites = seam.patch_sites(root, patch_dir)
    report.problems += [
        f"seam: {s.patch} lands in {s.file}, which is not in vLLM {entry.version}"
        for s in report.sites
        if s.symbol == "?"
    ]
    return report


def check_version(
    entry: versions.SupportedVersion, cache: Path | None = None, scratch: Path | None = None
) -> VersionReport:
    """The whole check of one supported version, in a scratch directory
    (removed afterwards unless given)."""
    wheel = fetch_wheel(entry, cache)
    own = scratch is None
    scratch = scratch or Path(tempfile.mkdtemp(prefix=f"vllm-hs-{entry.version}-"))
    try:
        extract_sources(wheel, scratch)
        return check_sources(entry, scratch)
    finally:
        if own:
            shutil.rmtree(scratch, ignore_errors=True)


def sites_that_differ(reports: list[VersionReport]) -> list[str]:
    """Hunks whose call-out lands in a different function on one version than
    on another: a call-out that moved is a change in behaviour to look at,
    not only a new line number."""
    by_version = {
        r.version: {(s.patch, s.file, s.symbol) for s in r.sites} for r in reports if r.sites
    }
    if len(by_version) < 2:
        return []
    problems = []
    (first, base), *rest = by_version.items()
    for version, sites in rest:
        for patch, file, symbol in sorted(sites - base):
            problems.append(f"{patch} lands in {file}:{symbol} on {version}, not on {first}")
        for patch, file, symbol in sorted(base - sites):
            problems.append(f"{patch} lands in {file}:{symbol} on {first}, not on {version}")
    return problems


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="vllm-hidden-states patch verify")
    parser.add_argument(
        "--version",
        choices=[v.version for v in versions.SUPPORTED],
        action="append",
        help="check only this version (repeatable; default: every supported one)",
    )
    args = parser.parse_args(argv)
    chosen = [v for v in versions.SUPPORTED if not args.version or v.version in args.version]
    try:
        reports = [check_version(v) for v in chosen]
    except CheckError as e:
        print(f"vllm-hidden-states: {e}", file=sys.stderr)
        return 2
    failed = False
    for r in reports:
        print(r.summary())
        for p in r.problems:
            print(f"  {p}", file=sys.stderr)
        failed |= bool(r.problems)
    for p in sites_that_differ(reports):
        print(f"  {p}", file=sys.stderr)
        failed = True
    return 1 if failed else 0
