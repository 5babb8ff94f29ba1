# SPDX-License-Identifier: Apache-2.0
"""The seam inventory: every vLLM symbol the package names, checked against
the vLLM sources, so an upgrade that moves one fails here, naming it."""

import ast
import shutil
from pathlib import Path

import pytest

from vllm_hidden_states.tools import seam


@pytest.fixture(scope="module")
def references():
    return seam.package_references()


@pytest.fixture(scope="module")
def sites() -> list[seam.PatchSite]:
    return seam.patch_sites()


@pytest.fixture(scope="module")
def scratch_vllm(tmp_path_factory) -> Path:
    """A copy of the installed vLLM's Python sources."""
    root = tmp_path_factory.mktemp("scratch") / "vllm"
    shutil.copytree(
        seam.vllm_root(),
        root,
        ignore=lambda d, names: [
            n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()
        ],
    )
    return root


def test_every_vllm_symbol_the_package_names_exists_in_the_installed_vllm(references):
    assert seam.missing(references) == []


def test_inventory_lists_imported_symbols_and_module_attributes(references):
    names = {str(r) for r in references}
    assert "vllm.v1.engine:FinishReason" in names
    assert "vllm.logger:init_logger" in names
    assert "vllm.v1.core.sched.request_queue:FCFSRequestQueue" in names


def test_inventory_leaves_out_the_packages_own_private_names(references):
    assert not any(r.name in ("*._hs_rows", "*._arm", "*._collect") for r in references)


def test_a_renamed_vllm_class_is_reported_with_where_the_package_names_it(references, scratch_vllm):
    module = scratch_vllm / "v1" / "engine" / "__init__.py"
    module.write_text(module.read_text().replace("FinishReason", "FinishCause"))
    problems = seam.missing(references, scratch_vllm)
    assert any(
        p.startswith("vllm.v1.engine:FinishReason (named at vllm_hidden_states/")
        and p.endswith("not defined in vllm.v1.engine")
        for p in problems
    ), problems


def test_a_renamed_private_vllm_attribute_is_reported(scratch_vllm):
    # The package itself names no private vLLM attribute any more; one that
    # it would name is checked the same way.
    used = [seam.Reference("vllm", "*._free_blocks", "vllm_hidden_states/x.py:1")]
    assert seam.missing(used, scratch_vllm) == []
    for path in scratch_vllm.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "_free_blocks" in text:
            path.write_text(text.replace("_free_blocks", "_release_blocks"))
    problems = seam.missing(used, scratch_vllm)
    assert problems == [
        "vllm:*._free_blocks (named at vllm_hidden_states/x.py:1): no vLLM class defines it"
    ]


def test_patch_sites_name_the_function_each_hunk_lands_in(sites):
    landed = {(s.patch, s.symbol) for s in sites}
    assert ("0008-model-runner-capture.patch", "GPUModelRunner.execute_model") in landed
    assert ("0008-model-runner-capture.patch", "CPUModelRunner.load_model") in landed
    assert ("0010-model-runner-v2-capture.patch", "GPUModelRunner.execute_model") in landed
    assert ("0010-model-runner-v2-capture.patch", "GPUModelRunner.sample_tokens") in landed


def test_architecture_doc_prints_the_current_inventory(references, sites, monkeypatch):
    # The inventory from the lists the tests above read (each costs seconds of
    # parsing vLLM's sources): the same calls, made once for the module.
    monkeypatch.setattr(seam, "package_references", lambda: references)
    monkeypatch.setattr(seam, "patch_sites", lambda root=None: sites)
    doc = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
    text = doc.read_text()
    assert text == seam.docs_with_inventory(text), (
        "docs/architecture.md's inventory is stale: run "
        "`vllm-hidden-states seam --docs docs/architecture.md`"
    )


def _vllm_bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds to vLLM modules or objects by importing them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def test_the_package_replaces_nothing_of_vllm_at_run_time():
    # Issue 17: every join with vLLM is a patch call-out. An assignment to an
    # attribute of something imported from vLLM (module.f = ..., Class.m = ...,
    # setattr(Class, ...)) would be a run-time replacement that a vLLM upgrade
    # breaks silently.
    import vllm_hidden_states

    root = Path(vllm_hidden_states.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        bound = _vllm_bound_names(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
                if not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and ast.unparse(node) == "functools.wraps":
                # A wrapper stands in for the function it wraps.
                found.append(f"{path.relative_to(root)}:{node.lineno} functools.wraps")
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "__class__":
                    # Swapping a vLLM object's class replaces its methods too.
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(target)}")
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if target is not base and isinstance(base, ast.Name) and base.id in bound:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(target)}")
    assert found == []
