# SPDX-License-Identifier: Apache-2.0
"""``patch rebase`` on a synthetic release: a scratch ``vllm/`` tree, a patch
written against it, and a "new release" where that patch needs fuzz or fails.
The set written applies to the new sources with zero fuzz (tools/rebase.py)."""

from pathlib import Path

import pytest

from vllm_hidden_states.tools import rebase, release_check

OLD = """\
def schedule(requests):
    budget = 8
    out = []
    for r in requests:
        out.append(r)
    return out


def preempt(request):
    request.status = "preempted"
    request.blocks = []
    request.num_computed_tokens = 0
    return request


def finish(request):
    reply = render(request)
    return reply
"""

# Upstream moved everything down (an offset), touched a context line of the
# first hunk (fuzz 1) and rewrote the line the second hunk's context needs.
NEW = """\
import logging

logger = logging.getLogger(__name__)


def schedule(requests):
    budget = 16
    out = []
    for r in requests:
        out.append(r)
    return out


def preempt(request):
    request.status = "preempted"
    request.blocks = []
    request.num_computed_tokens = 0
    return request


def finish(request):
    reply = render(request, final=True)
    log(reply)
    return reply
"""

PATCH_OLD = """\
def schedule(requests):
    budget = 8
    out = []
    for r in requests:
        hidden_states.plan(r)
        out.append(r)
    return out


def preempt(request):
    request.status = "preempted"
    request.blocks = []
    request.num_computed_tokens = 0
    return request


def finish(request):
    reply = render(request)
    reply = hidden_states.finish(reply)
    return reply
"""


def _tree(root: Path, text: str) -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "sched.py").write_text(text)
    return root


def _set(tmp_path: Path) -> list[Path]:
    """A one-patch set against OLD, as GNU diff writes it."""
    a, b = _tree(tmp_path / "a", OLD), _tree(tmp_path / "b", PATCH_OLD)
    patch = tmp_path / "set" / "0001-sched.patch"
    patch.parent.mkdir()
    patch.write_text(rebase.unified_diff(a / "vllm/sched.py", b / "vllm/sched.py", "vllm/sched.py"))
    return [patch]


def _run(tmp_path: Path, patches: list[Path], new: str, go_on: bool = False, lines=None):
    return rebase.rebase(
        "9.9.9",
        tmp_path / "work",
        base="9.9.8",
        patches=patches,
        old_sources=_tree(tmp_path / "old", OLD) if not go_on else tmp_path / "old",
        new_sources=_tree(tmp_path / "new", new) if not go_on else tmp_path / "new",
        out=tmp_path / "out",
        go_on=go_on,
        say=(lines if lines is not None else []).append,
    )


def _applies_exactly(patch: Path, text: str, root: Path) -> str:
    """``text`` as ``vllm/sched.py`` with ``patch`` applied at zero fuzz;
    every hunk must land exactly where it says."""
    _tree(root, text)
    code, hunks, output = release_check.run_patch(patch, root, 0)
    assert code == 0 and hunks and all(h.exact for h in hunks), output
    return (root / "vllm" / "sched.py").read_text()


def test_a_hunk_that_needs_fuzz_is_reported_and_the_new_set_applies_with_zero_fuzz(tmp_path):
    patches = _set(tmp_path)
    first_only = NEW.replace(
        "    reply = render(request, final=True)\n    log(reply)\n", "    reply = render(request)\n"
    )
    lines: list[str] = []
    state = _run(tmp_path, patches, first_only, lines=lines)
    assert not state.stopped and state.done == 1
    text = "\n".join(lines)
    assert "0001-sched.patch vllm/sched.py hunk #1: moved +5 lines to 7, fuzz 1" in text
    # With what upstream changed there, old line against new.
    assert "-    budget = 8" in text and "+    budget = 16" in text
    written = tmp_path / "out" / "0001-sched.patch"
    result = _applies_exactly(written, first_only, tmp_path / "check")
    assert "        hidden_states.plan(r)\n        out.append(r)" in result
    assert "    reply = render(request)\n    reply = hidden_states.finish(reply)" in result
    assert result.startswith("import logging")


def test_a_hunk_that_fails_stops_for_a_hand_fix_and_continue_writes_the_set(tmp_path):
    patches = _set(tmp_path)
    lines: list[str] = []
    state = _run(tmp_path, patches, NEW, lines=lines)
    assert state.stopped and state.done == 0
    text = "\n".join(lines)
    assert "0001-sched.patch vllm/sched.py hunk #2: FAILED" in text
    assert "+    reply = render(request, final=True)" in text  # upstream's change there
    assert "--continue" in lines[-1]
    work = tmp_path / "work" / "new" / "vllm"
    assert (work / "sched.py.rej").is_file()

    # --continue refuses while the reject is still there.
    with pytest.raises(
        rebase.RebaseError,
        match=r"--continue: delete vllm/sched\.py\.orig, vllm/sched\.py\.rej under ",
    ):
        _run(tmp_path, patches, NEW, go_on=True)

    # The hand fix: the call-out after upstream's new line.
    fixed = (
        (work / "sched.py")
        .read_text()
        .replace("    log(reply)\n", "    log(reply)\n    reply = hidden_states.finish(reply)\n")
    )
    (work / "sched.py").write_text(fixed)
    for leftover in list(work.glob("*.rej")) + list(work.glob("*.orig")):
        leftover.unlink()
    lines.clear()
    state = _run(tmp_path, patches, NEW, go_on=True, lines=lines)
    assert not state.stopped and state.done == 1
    # The fix moved the call-out, it did not change it.
    assert not any("differ from vLLM" in line for line in lines), lines
    result = _applies_exactly(tmp_path / "out" / "0001-sched.patch", NEW, tmp_path / "check")
    assert result == fixed


def test_carrying_a_set_to_its_own_sources_writes_it_back_unchanged(tmp_path):
    patches = _set(tmp_path)
    state = _run(tmp_path, patches, OLD)
    assert not state.stopped and state.reports == []
    assert (tmp_path / "out" / "0001-sched.patch").read_text() == patches[0].read_text()


def test_parse_hunks_keeps_a_removed_line_that_starts_with_dashes():
    diff = (
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n"
        "--- a comment that starts with dashes\n+new\n keep\n"
        "--- a/vllm/y.py\n+++ b/vllm/y.py\n@@ -3 +3 @@\n-a\n+b\n"
    )
    hunks = rebase.parse_hunks(diff)
    assert [h.lines[1] for h in hunks["vllm/x.py"]] == ["--- a comment that starts with dashes"]
    assert len(hunks["vllm/x.py"][0].lines) == 4
    assert [(h.old_start, h.old_len) for h in hunks["vllm/y.py"]] == [(3, 1)]


def test_a_hand_fix_that_changes_a_call_out_is_reported(tmp_path):
    patches = _set(tmp_path)
    _run(tmp_path, patches, NEW)
    work = tmp_path / "work" / "new" / "vllm"
    fixed = (
        (work / "sched.py")
        .read_text()
        .replace(
            "    log(reply)\n",
            "    log(reply)\n    reply = hidden_states.finish(reply, final=True)\n",
        )
    )
    (work / "sched.py").write_text(fixed)
    for leftover in list(work.glob("*.rej")) + list(work.glob("*.orig")):
        leftover.unlink()
    lines: list[str] = []
    state = _run(tmp_path, patches, NEW, go_on=True, lines=lines)
    assert "0001-sched.patch: its added or removed lines differ from vLLM 9.9.8's set" in lines
    assert state.reports[-1] == lines[-2]


def test_the_real_0_32_set_carried_to_its_own_sources_is_written_back_byte_identical(tmp_path):
    # The tool writes sets in the project's own form: regenerating the 0.32.0
    # set from pristine 0.32.0 changes no byte.
    from vllm_hidden_states import versions

    entry = versions.for_version("0.32.0")
    sources = tmp_path / "pristine"
    release_check.extract_sources(release_check.fetch_wheel(entry), sources)
    state = rebase.rebase(
        entry.version,
        tmp_path / "work",
        base=entry.version,
        patches=entry.patch_files(),
        old_sources=sources,
        new_sources=sources,
        out=tmp_path / "out",
        say=[].append,
    )
    assert not state.stopped and state.reports == []
    written = {p.name: p.read_bytes() for p in sorted((tmp_path / "out").glob("*.patch"))}
    assert written == {p.name: p.read_bytes() for p in entry.patch_files()}


def test_a_file_that_upstream_removed_is_named(tmp_path):
    patches = _set(tmp_path)
    new = tmp_path / "new"
    (new / "vllm").mkdir(parents=True)
    (new / "vllm" / "scheduler.py").write_text(NEW)  # sched.py renamed upstream
    with pytest.raises(rebase.RebaseError) as e:
        rebase.rebase(
            "9.9.9",
            tmp_path / "work",
            base="9.9.8",
            patches=patches,
            old_sources=_tree(tmp_path / "old", OLD),
            new_sources=new,
            out=tmp_path / "out",
            say=[].append,
        )
    assert str(e.value).startswith(f"vllm/sched.py, which the set patches, is not in {new}")
