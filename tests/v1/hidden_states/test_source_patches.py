# SPDX-License-Identifier: Apache-2.0
"""``vllm-hidden-states patch``: idempotent, version-pinned, reports its state."""

import subprocess
import sys

import pytest

from vllm_hidden_states.tools import source_patches


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_hidden_states.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_patch_is_applied_to_the_installed_vllm():
    states = source_patches.status()
    assert [s.name for s in states] == [p.name for p in source_patches.patch_files()]
    assert all(s.state == "applied" for s in states), states


def test_apply_twice_changes_nothing():
    result = _cli("patch", "apply")
    assert result.returncode == 0, result.stderr
    assert "already patched" in result.stdout


def test_applies_running_at_once_leave_every_patch_applied():
    """Test processes run side by side: an apply must never read another's
    half-written record of the applied set and take the patches off."""
    cmd = [sys.executable, "-m", "vllm_hidden_states.tools.cli", "patch", "apply"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "already patched" in out, out
    assert all(s.state == "applied" for s in source_patches.status())


def test_check_exits_zero_and_lists_each_patch():
    result = _cli("patch", "check")
    assert result.returncode == 0, result.stderr
    for p in source_patches.patch_files():
        assert f"applied      {p.name}" in result.stdout


def test_installed_vllm_is_a_supported_version_and_its_set_is_the_one_used():
    from vllm_hidden_states import versions

    entry = versions.for_version(source_patches.check_version())
    assert source_patches.patches_dir() == entry.patch_dir


def test_other_vllm_versions_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(source_patches, "installed_vllm_version", lambda: "0.31.2")
    with pytest.raises(
        source_patches.PatchError,
        match=r"supports vLLM 0\.32\.0, 0\.33\.0; "
        r"the installed version is 0\.31\.2",
    ):
        source_patches.apply()


def test_patched_engine_args_expose_the_flags():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--enable-hidden-states", "--hidden-states-layers", "-1,-2,3"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.enable_hidden_states and engine_args.hidden_states_layers == "-1,-2,3"
