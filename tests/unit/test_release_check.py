# SPDX-License-Identifier: Apache-2.0
"""Every supported vLLM version kept honest without running it: its pristine
wheel's sources (downloaded once per machine into the wheel cache), its own
patch set applied with zero fuzz, every patched file compiled, the seam check
run there (tools/release_check.py)."""

import shutil

import pytest

from vllm_hidden_states import versions
from vllm_hidden_states.tools import release_check

SUPPORTED = [v.version for v in versions.SUPPORTED]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, release_check.VersionReport]:
    """Each supported version checked once for the module."""
    return {
        v.version: release_check.check_version(v, scratch=tmp_path_factory.mktemp(v.version))
        for v in versions.SUPPORTED
    }


@pytest.mark.parametrize("version", SUPPORTED)
def test_each_versions_set_applies_with_zero_fuzz_compiles_and_its_names_resolve(reports, version):
    report = reports[version]
    assert report.problems == [], "\n".join(report.problems)
    # Written against these very sources: every hunk lands where it says.
    assert report.hunks and all(h.exact for h in report.hunks), [
        h.describe() for h in report.hunks if not h.exact
    ]
    patched = release_check.patched_files(versions.for_version(version).patch_files())
    assert report.compiled == len(patched) > 20
    assert report.references > 40
    assert report.sites and all(s.symbol != "?" for s in report.sites)


def test_every_call_out_lands_in_the_same_function_on_every_version(reports):
    assert release_check.sites_that_differ(list(reports.values())) == []
    sites = {(s.patch, s.symbol) for s in reports["0.33.0"].sites}
    assert ("0008-model-runner-capture.patch", "GPUModelRunner.execute_model") in sites
    assert ("0010-model-runner-v2-capture.patch", "GPUModelRunner.sample_tokens") in sites


def test_the_older_set_on_the_newer_sources_fails_hunk_by_hunk(tmp_path):
    # What `patch verify` would say had 0.33.0 been given the 0.32.0 set.
    site = tmp_path / "site"
    newer = versions.for_version("0.33.0")
    release_check.extract_sources(release_check.fetch_wheel(newer), site)
    report = release_check.check_sources(newer, site, versions.for_version("0.32.0").patch_dir)
    assert (
        "0009-openai-serving.patch vllm/entrypoints/openai/completion/serving.py "
        "hunk #8: FAILED at line 269 with zero fuzz on pristine vLLM 0.33.0 "
        "(`vllm-hidden-states patch rebase` writes a set that applies)"
    ) in report.problems
    # Without fuzz, the hunks that needed it on 0.33 fail too.
    assert {p[:4] for p in report.problems if "FAILED" in p} == {
        "0001",
        "0002",
        "0003",
        "0004",
        "0005",
        "0009",
        "0010",
    }


def test_a_patched_file_that_does_not_compile_is_named(tmp_path):
    entry = versions.for_version("0.32.0")
    site = tmp_path / "site"
    release_check.extract_sources(release_check.fetch_wheel(entry), site)
    broken = tmp_path / "set"
    shutil.copytree(entry.patch_dir, broken)
    patch = broken / "0007-cpu-seeded-chunked-prefill.patch"
    text = patch.read_text()
    code = next(
        line
        for line in text.splitlines()
        if line.startswith("+") and line[1:].strip() and not line[1:].strip().startswith(("#", "+"))
    )
    patch.write_text(text.replace(code, code + " (", 1))  # applies as before, does not parse
    report = release_check.check_sources(entry, site, broken)
    assert [p.split(":")[0] for p in report.problems] == [
        "vllm/v1/worker/gpu_model_runner.py does not compile after patching",
        "seam check not run",
    ], report.problems


def test_a_wheel_whose_digest_differs_from_the_table_is_refused(tmp_path):
    entry = versions.for_version("0.32.0")
    (tmp_path / entry.wheel.filename).write_bytes(b"not the pristine wheel")
    with pytest.raises(
        release_check.CheckError, match="versions.py records for vLLM 0.32.0: delete it"
    ):
        release_check.fetch_wheel(entry, cache=tmp_path)
