# SPDX-License-Identifier: Apache-2.0
"""The inventory of the seam with vLLM, generated from the code.

    vllm-hidden-states seam [--check] [--vllm-root DIR] [--docs docs/architecture.md]

Two lists, read statically (``ast``, no import of vLLM): every vLLM symbol the
package names (``vllm.m:S``; a private attribute read on a vLLM object as
``vllm:*._name``), and the site of every patch hunk (file and function). With
``--check`` each reference must resolve in the vLLM sources (a top-level name
of its module; a private attribute defined somewhere in vLLM), else it exits 1
naming what moved: a vLLM upgrade fails here, before anything runs. The patches
themselves are checked by ``patch check``; both, against every supported
version's pristine sources, by :mod:`vllm_hidden_states.tools.release_check`.
"""

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]

# Private attributes the package uses on its own objects, not vLLM's.
_OWN_PRIVATE = {"_asdict", "_replace", "_fields"}


@dataclass(frozen=True, order=True)
class Reference:
    """One vLLM symbol the package names: ``module:name`` (``module`` ``vllm``
    and ``name`` ``*._attr`` for a private attribute of a vLLM object)."""

    module: str
    name: str
    where: str  # first place it is named, "path:line"

    def __str__(self) -> str:
        return f"{self.module}:{self.name}"


def _own_private_names() -> set[str]:
    """Private names the package defines itself (so ``self._x`` of our own
    classes is not taken for a vLLM attribute)."""
    names = set(_OWN_PRIVATE)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and (node.value.isidentifier())
            ):
                names.add(node.value)  # register_buffer("_x"), type(..., {"_x": ...})
    return names


def package_references(root: Path | None = None) -> list[Reference]:
    """Every vLLM symbol the package's own modules name (tests excluded);
    ``root`` (default: the installed vLLM) tells modules from other names."""
    root = root or vllm_root()
    own = _own_private_names()
    found: dict[tuple[str, str], Reference] = {}

    def add(module: str, name: str, path: Path, line: int) -> None:
        key = (module, name)
        if key not in found:
            found[key] = Reference(module, name, f"{path.relative_to(PACKAGE.parent)}:{line}")

    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # local name -> vllm module
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and (node.module == "vllm" or node.module.startswith("vllm."))
            ):
                for alias in node.names:
                    add(node.module, alias.name, path, node.lineno)
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "vllm" or alias.name.startswith("vllm."):
                        local = alias.asname or alias.name
                        aliases[local] = alias.name
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = aliases[value.id]
                if _is_module_path(root, target):
                    add(target, node.attr, path, node.lineno)
            elif isinstance(value, ast.Attribute):
                dotted = _dotted(value)
                if dotted and dotted.split(".")[0] in aliases:
                    head, _, rest = dotted.partition(".")
                    module = f"{aliases[head]}.{rest}" if rest else aliases[head]
                    if _is_module_path(root, module):
                        add(module, node.attr, path, node.lineno)
            if (
                node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in own
            ):
                add("vllm", f"*.{node.attr}", path, node.lineno)
    return sorted(found.values())


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_module_path(root: Path, dotted: str) -> bool:
    """Whether ``dotted`` names a vLLM module (a file or package) under
    ``root``; class-qualified names are not modules."""
    rel = Path(*dotted.split("."))
    return (root.parent / rel).with_suffix(".py").is_file() or (
        root.parent / rel / "__init__.py"
    ).is_file()


def vllm_root() -> Path:
    """The installed vLLM package directory, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vLLM is not installed")
    return Path(list(spec.submodule_search_locations)[0])


# -- resolving -------------------------------------------------------------------


def _module_file(root: Path, module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for candidate in ((root / rel).with_suffix(".py"), root / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(source: str) -> set[str]:
    names: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):  # if/try/TYPE_CHECKING blocks included
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _defines(root: Path, module: str, name: str, depth: int = 0) -> bool:
    """Whether ``module`` defines ``name`` at its top level, re-exports it
    (``from x import *`` followed), or names it (a dynamic module attribute)."""
    path = _module_file(root, module)
    if path is None or depth > 3:
        return False
    source = path.read_text()
    if name in _top_level_names(source) or re.search(rf"\b{re.escape(name)}\b", source):
        return True
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            target = (
                f"{base}.{node.module}"
                if node.level and node.module
                else base
                if node.level
                else node.module
            )
            if target and _defines(root, target, name, depth + 1):
                return True
    return False


def _private_defined(root: Path) -> set[str]:
    names: set[str] = set()
    pattern = re.compile(r"(?:def\s+|self\.|^\s+)(_[A-Za-z0-9_]+)\s*[(:=]", re.M)
    for path in root.rglob("*.py"):
        names.update(pattern.findall(path.read_text(errors="replace")))
    return names


def missing(references: list[Reference], root: Path | None = None) -> list[str]:
    """The references that do not resolve in the vLLM sources under ``root``,
    each as ``"module:name (named at path:line): why"``."""
    root = root or vllm_root()
    problems = []
    sources: dict[str, str | None] = {}
    private: set[str] | None = None
    for ref in references:
        if ref.name.startswith("*."):
            if private is None:
                private = _private_defined(root)
            if ref.name[2:] not in private:
                problems.append(f"{ref} (named at {ref.where}): no vLLM class defines it")
            continue
        if ref.module not in sources:
            path = _module_file(root, ref.module)
            sources[ref.module] = path.read_text() if path else None
        source = sources[ref.module]
        if source is None:
            problems.append(f"{ref} (named at {ref.where}): module {ref.module} not found")
        elif _module_file(root, f"{ref.module}.{ref.name}") is not None:
            continue  # a submodule
        elif not _defines(root, ref.module, ref.name):
            problems.append(f"{ref} (named at {ref.where}): not defined in {ref.module}")
    return problems


# -- patch sites -----------------------------------------------------------------


@dataclass(frozen=True)
class PatchSite:
    patch: str
    file: str
    symbol: str  # innermost enclosing class/function of the hunk, or "<module>"


def patch_sites(root: Path | None = None, patch_dir: Path | None = None) -> list[PatchSite]:
    """Where each hunk of the set in ``patch_dir`` lands, read from the
    patched files under ``root`` (default: the installed vLLM and its
    version's set)."""
    root = root or vllm_root()
    patch_dir = patch_dir or installed_patch_dir()
    sites: list[PatchSite] = []
    trees: dict[Path, ast.Module] = {}  # a file parsed once, not once per hunk
    for patch in sorted(patch_dir.glob("*.patch")):
        current = None
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                current = line[len("+++ b/") :].split("\t")[0]
            elif line.startswith("@@") and current:
                header = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", line)
                assert header is not None, f"not a unified-diff hunk header: {line!r}"
                new_start = int(header.group(1))
                path = root.parent / current
                symbol = _enclosing(trees, path, new_start + 3) if path.is_file() else "?"
                site = PatchSite(patch.name, current, symbol)
                if site not in sites:
                    sites.append(site)
    return sites


def installed_patch_dir() -> Path:
    """The patch set of the installed vLLM's version (read from its
    metadata, without importing it)."""
    from vllm_hidden_states.tools import source_patches

    return source_patches.patches_dir()


def _enclosing(trees: dict[Path, ast.Module], path: Path, line: int) -> str:
    if path not in trees:
        trees[path] = ast.parse(path.read_text())
    tree = trees[path]
    best: list[str] = []

    def visit(node: ast.AST, stack: list[str]) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                end = getattr(child, "end_lineno", child.lineno)
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                if first <= line <= end:
                    best = stack + [child.name]
                    visit(child, best)
            else:
                visit(child, stack)

    visit(tree, [])
    return ".".join(best) or "<module>"


# -- the inventory as text ---------------------------------------------------------


def inventory_markdown() -> str:
    refs = package_references()
    lines = [
        "### Package references to vLLM",
        "",
        f"{len(refs)} symbols; `vllm:*._x` is a private attribute of a vLLM object.",
        "",
        "| symbol | first named at |",
        "| --- | --- |",
    ]
    # Files only: line numbers would make the printed list stale at every edit.
    lines += [f"| `{r}` | {r.where.rpartition(':')[0]} |" for r in refs]
    lines += ["", "### Patch sites", "", "| patch | file | lands in |", "| --- | --- | --- |"]
    lines += [f"| {s.patch} | `{s.file}` | `{s.symbol}` |" for s in patch_sites()]
    return "\n".join(lines) + "\n"


DOCS_BEGIN, DOCS_END = "<!-- seam inventory: begin -->", "<!-- seam inventory: end -->"


def docs_with_inventory(text: str) -> str:
    """``text`` (docs/architecture.md) with the generated inventory between
    its markers."""
    head, _, rest = text.partition(DOCS_BEGIN)
    _, _, tail = rest.partition(DOCS_END)
    return f"{head}{DOCS_BEGIN}\n{inventory_markdown()}{DOCS_END}{tail}"


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="vllm-hidden-states seam")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 naming every reference the vLLM sources lack"
    )
    parser.add_argument(
        "--vllm-root",
        type=Path,
        default=None,
        help="vLLM package directory to check against (default: installed)",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="rewrite the inventory between the markers of this file",
    )
    args = parser.parse_args(argv)
    if args.docs is not None:
        args.docs.write_text(docs_with_inventory(args.docs.read_text()))
        return 0
    if not args.check:
        print(inventory_markdown(), end="")
        return 0
    refs = package_references()
    problems = missing(refs, args.vllm_root)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(refs)} vLLM references, {len(problems)} missing")
    return 1 if problems else 0
