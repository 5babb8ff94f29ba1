# SPDX-License-Identifier: Apache-2.0
"""Carry the newest patch set to a new vLLM release.

    vllm-hidden-states patch rebase --to X.Y.Z [--workdir DIR] [--sources DIR] [--continue]

The newest supported set (:data:`vllm_hidden_states.versions.SUPPORTED`'s
last entry) is applied, patch by patch, with GNU patch's default fuzz to the
new release's pristine sources (its wheel, downloaded once, or ``--sources``).
Every hunk that moved, needed fuzz or failed is reported; for the last two,
with what upstream changed at that place (the old release's file against the
new one's, both with the set's earlier patches applied). Each patch is then
written again as a diff against the new sources, so the new set applies with
zero fuzz: ``patches/X.Y.Z/``.

A hunk that fails stops the rebase. Its ``.rej`` is left beside the file in
``DIR/new/``: carry the change into that file by hand, delete the ``.rej``
and ``.orig``, and run again with ``--continue``; the file as it stands
becomes that patch's result. docs/upgrading.md walks through one release.
"""

import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_hidden_states import versions
from vllm_hidden_states.tools import release_check
from vllm_hidden_states.tools.release_check import HunkResult, run_patch

STATE = "rebase-state.json"


class RebaseError(RuntimeError):
    pass


@dataclass
class RebaseState:
    """What a stopped rebase needs to go on (``DIR/rebase-state.json``)."""

    base: str  # the version whose set is carried
    to: str
    patches: list[str]  # the set's file names, in order
    done: int = 0  # how many of them are written to out/
    stopped: bool = False  # patch ``patches[done]`` failed and waits for a hand fix
    reports: list[str] = field(default_factory=list)

    def save(self, workdir: Path) -> None:
        (workdir / STATE).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, workdir: Path) -> "RebaseState":
        path = workdir / STATE
        if not path.is_file():
            raise RebaseError(f"--continue: no {STATE} in {workdir}: start without --continue")
        return cls(**json.loads(path.read_text()))


@dataclass(frozen=True)
class Hunk:
    """A unified-diff hunk's header: old and new start and length."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[str, ...]


def parse_hunks(diff: str) -> dict[str, list[Hunk]]:
    """Hunks of a unified diff by the file they change (``vllm/...``)."""
    import re

    header = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
    out: dict[str, list[Hunk]] = {}
    current: str | None = None
    old_left = new_left = 0  # lines of the open hunk still to come
    for line in diff.splitlines():
        if old_left or new_left:
            # Inside a hunk its header's counts decide, not the first
            # character: a removed line may itself start with "--".
            out[current or "?"][-1] = _grown(out[current or "?"][-1], line)
            old_left -= line[:1] in (" ", "-")
            new_left -= line[:1] in (" ", "+")
        elif line.startswith("+++ "):
            current = line[4:].split("\t")[0].removeprefix("b/")
        elif (m := header.match(line)) and current is not None:
            a, b, c, d = m.groups()
            old_left, new_left = int(b or 1), int(d or 1)
            out.setdefault(current, []).append(Hunk(int(a), old_left, int(c), new_left, (line,)))
        elif line.startswith("\\") and current in out:
            out[current][-1] = _grown(out[current][-1], line)  # "\ No newline at end of file"
    return out


def _grown(hunk: Hunk, line: str) -> Hunk:
    return Hunk(hunk.old_start, hunk.old_len, hunk.new_start, hunk.new_len, (*hunk.lines, line))


def changed_lines(diff: str) -> list[str]:
    """A diff's added and removed lines, in order, without file headers: what
    a patch does, wherever it lands."""
    return [
        line
        for hunks in parse_hunks(diff).values()
        for hunk in hunks
        for line in hunk.lines[1:]
        if line[:1] in ("+", "-")
    ]


def unified_diff(old: Path, new: Path, label: str) -> str:
    """``diff -u`` of two files, both labelled ``a/label`` and ``b/label``
    (GNU diff: it marks a missing final newline, as GNU patch expects)."""
    done = subprocess.run(
        ["diff", "-u", "--label", f"a/{label}", "--label", f"b/{label}", str(old), str(new)],
        capture_output=True,
        text=True,
    )
    if done.returncode > 1:
        raise RebaseError(f"diff failed on {old} and {new}: {done.stderr.strip()}")
    return done.stdout


def upstream_near(old: Path, new: Path, label: str, first: int, last: int) -> list[str]:
    """What upstream changed in ``label`` between lines ``first`` and
    ``last`` of ``old``: the hunks of ``diff -u old new`` that touch them."""
    hunks = parse_hunks(unified_diff(old, new, label)).get(label, [])
    near = [h for h in hunks if h.old_start <= last and h.old_start + h.old_len >= first]
    return [line for h in near for line in h.lines]


# -- the rebase -----------------------------------------------------------------


def newest_set(excluding: str) -> versions.SupportedVersion:
    """The newest supported version with a patch set, other than ``excluding``
    (the release being rebased to may already be in the table)."""
    for entry in reversed(versions.SUPPORTED):
        if entry.version != excluding and entry.patch_files():
            return entry
    raise RebaseError(f"no supported version other than {excluding} has a patch set")


def _sources(version: str, given: Path | None, workdir: Path) -> Path:
    """The directory holding ``vllm/`` for ``version``'s pristine sources."""
    if given is not None:
        if not (given / "vllm" / "__init__.py").is_file():
            raise RebaseError(f"--sources {given}: expected a directory holding vllm/__init__.py")
        return given
    cached = workdir / f"pristine-{version}"
    if (cached / "vllm" / "__init__.py").is_file():
        return cached
    try:
        wheel = release_check.fetch_wheel(versions.for_version(version))
    except versions.UnsupportedVersion:
        wheel = release_check.download_wheel("vllm", version, release_check.wheel_cache())
        print(f"{wheel.name}: sha256 {release_check.sha256_of(wheel)} (for versions.py)")
    release_check.extract_sources(wheel, cached)
    return cached


def _copy_files(src_root: Path, dst_root: Path, files: list[str]) -> None:
    for rel in files:
        if not (src_root / rel).is_file():
            raise RebaseError(
                f"{rel}, which the set patches, is not in {src_root}: upstream moved or "
                "removed it. Find where its code went, move the hunks in the old set "
                "by hand, and rebase again"
            )
        target = dst_root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_root / rel, target)


def rebase(
    to: str,
    workdir: Path,
    *,
    base: str,
    patches: list[Path],
    old_sources: Path,
    new_sources: Path,
    out: Path,
    go_on: bool = False,
    say=print,
) -> RebaseState:
    """Carry ``patches`` (a zero-fuzz set for vLLM ``base``, whose sources
    hold ``vllm/`` under ``old_sources``) to the sources under
    ``new_sources`` (vLLM ``to``); the state reached. The new set is written
    to ``out`` once every patch is done. ``go_on``: after a hand fix."""
    workdir.mkdir(parents=True, exist_ok=True)
    if not patches:
        raise RebaseError(f"no patches to carry from vLLM {base}")
    files = release_check.patched_files(patches)
    old_tree, new_tree, written = workdir / "old", workdir / "new", workdir / "out"

    if go_on:
        state = RebaseState.load(workdir)
        if state.to != to or state.base != base:
            raise RebaseError(
                f"--continue: {workdir} holds a rebase of {state.base} to {state.to}, "
                f"not of {base} to {to}"
            )
        leftovers = sorted(
            str(p.relative_to(new_tree))
            for p in new_tree.rglob("*")
            if p.suffix in (".rej", ".orig")
        )
        if leftovers:
            raise RebaseError(
                f"--continue: delete {', '.join(leftovers)} under {new_tree} once "
                "their hunks are carried into the files by hand"
            )
    else:
        for tree in (old_tree, new_tree, written):
            shutil.rmtree(tree, ignore_errors=True)
        # Only the files the set touches: copies of the whole of vLLM would
        # cost seconds and say nothing more.
        _copy_files(old_sources, old_tree, files)
        _copy_files(new_sources, new_tree, files)
        written.mkdir()
        state = RebaseState(base, to, [p.name for p in patches])

    before, old_before = workdir / "before", workdir / "old-before"
    while state.done < len(patches):
        patch = patches[state.done]
        touched = release_check.patched_files([patch])
        if state.stopped:
            # The hand fix is in new/; before/ holds the files as they were
            # before this patch.
            state.stopped = False
        else:
            for tree, source in ((before, new_tree), (old_before, old_tree)):
                shutil.rmtree(tree, ignore_errors=True)
                _copy_files(source, tree, touched)
            code, hunks, output = run_patch(patch, new_tree, 2)
            failed = False
            for h in hunks:
                if h.exact:
                    continue
                line = h.describe()
                state.reports.append(line)
                say(line)
                if not h.applied or h.fuzz:
                    failed |= not h.applied
                    for text in _upstream_of(patch, h, old_before, before, base, to):
                        say(f"    {text}")
            if code != 0 and not failed:
                raise RebaseError(f"{patch.name}: GNU patch failed: {output.strip()[-400:]}")
            # The old tree follows the old set exactly, for the next patch's
            # upstream comparison.
            old_code, _, old_output = run_patch(patch, old_tree, 0)
            if old_code != 0:
                raise RebaseError(
                    f"{patch.name} does not apply with zero fuzz to vLLM {base}'s "
                    f"sources: run `vllm-hidden-states patch verify` ({old_output.strip()[-300:]})"
                )
            if failed:
                state.stopped = True
                state.save(workdir)
                say(
                    f"{patch.name} stopped: carry each .rej's hunk into its file under "
                    f"{new_tree} by hand (the lines above show what upstream changed "
                    f"there), delete the .rej and .orig files, then run again with --continue"
                )
                return state
        for p in new_tree.rglob("*.orig"):
            p.unlink()  # GNU patch's backups of fuzzed files
        diff = "".join(unified_diff(before / rel, new_tree / rel, rel) for rel in touched)
        (written / patch.name).write_text(diff)
        if changed_lines(diff) != changed_lines(patch.read_text()):
            # A hand fix may have to change a call-out, not only move it: said
            # here so that the review looks at it.
            line = f"{patch.name}: its added or removed lines differ from vLLM {base}'s set"
            state.reports.append(line)
            say(line)
        state.done += 1
        state.save(workdir)

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(written, out)
    say(f"wrote {len(patches)} patches to {out}")
    return state


def _upstream_of(
    patch: Path, h: HunkResult, old_before: Path, new_before: Path, base: str, to: str
) -> list[str]:
    """The lines to show beside a fuzzed or failed hunk: the hunk's own lines
    and what upstream changed where it applies."""
    hunks = parse_hunks(patch.read_text()).get(h.file, [])
    if not 0 < h.hunk <= len(hunks):
        return []
    ours = hunks[h.hunk - 1]
    first, last = ours.old_start, ours.old_start + ours.old_len - 1
    lines = [f"the hunk ({patch.name}):", *ours.lines]
    changed = upstream_near(old_before / h.file, new_before / h.file, h.file, first, last)
    lines.append(f"upstream {base} -> {to} at lines {first}-{last}:")
    lines += changed or ["(no change within the hunk's lines: context further out moved)"]
    return lines


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="vllm-hidden-states patch rebase")
    parser.add_argument("--to", required=True, help="the new vLLM version, X.Y.Z")
    parser.add_argument(
        "--from",
        dest="base",
        choices=[v.version for v in versions.SUPPORTED],
        default=None,
        help="the set to carry (default: the newest supported one)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="scratch directory (default: ~/.cache/vllm-hidden-states/rebase-X.Y.Z)",
    )
    parser.add_argument(
        "--sources",
        type=Path,
        default=None,
        help="directory holding the new release's vllm/ (default: from its wheel)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write the new set (default: patches/X.Y.Z)"
    )
    parser.add_argument("--continue", dest="go_on", action="store_true", help="after a hand fix")
    args = parser.parse_args(argv)
    workdir = args.workdir or release_check.wheel_cache().parent / f"rebase-{args.to}"
    out = args.out or versions.PATCHES_ROOT / args.to
    try:
        base = versions.for_version(args.base) if args.base else newest_set(excluding=args.to)
        state = rebase(
            args.to,
            workdir,
            base=base.version,
            patches=base.patch_files(),
            old_sources=_sources(base.version, None, workdir),
            new_sources=_sources(args.to, args.sources, workdir),
            out=out,
            go_on=args.go_on,
        )
    except (RebaseError, release_check.CheckError) as e:
        print(f"vllm-hidden-states: {e}", file=sys.stderr)
        return 2
    if not state.stopped and args.to not in {v.version for v in versions.SUPPORTED}:
        print(
            f"next: add vLLM {args.to} to SUPPORTED in vllm_hidden_states/versions.py "
            "and run `vllm-hidden-states patch verify`"
        )
    return 1 if state.stopped else 0
