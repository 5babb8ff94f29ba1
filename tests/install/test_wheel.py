# SPDX-License-Identifier: Apache-2.0
"""A non-editable install (wheel) carries the patch set and works on its own.

One module fixture copies the checkout (build outputs left out, so a stale
``build/`` can neither hide nor add files and the checkout is not written to),
builds a wheel and an sdist from the copy without network or build isolation,
creates a fresh venv that reuses the vLLM installed in the project's ``.venv``
(a path line in a ``.pth`` file: the ``.pth`` files of that directory, the
editable finder among them, are *not* executed) and installs the wheel there.
Then each test checks one thing. The wheel carries ``vllm_hidden_states._C``
where CMake and a compiler are found (the build here); two more wheels are
built without it: one with ``VLLM_HIDDEN_STATES_BUILD_C=0``, one whose build
fails (no working C++ compiler), which must still succeed, without ``_C``.

``patch apply`` runs in the new venv against the shared, already patched vLLM:
it must find the same patch set there and change nothing. It is run only after
``patch check`` has found every patch applied, so a stale ``.venv`` fails the
test instead of being re-patched by it.
"""

import ast
import configparser
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "vllm_hidden_states"
# The interpreter of the project's venv (the one running these tests).
PYTHON = sys.executable
TIMEOUT = 600

# Build outputs and caches: never part of what gets built.
_IGNORED = {
    ".git",
    ".venv",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".models",
    ".gl",
    ".whl",
    "results",
}


def _ignore(_directory: str, names: list[str]) -> set[str]:
    # _C*.so: the editable install's compiled ops, built in place.
    return {
        n
        for n in names
        if n in _IGNORED or n.endswith(".egg-info") or (n.startswith("_C") and n.endswith(".so"))
    }


def _env() -> dict[str, str]:
    """The caller's environment minus anything that redirects imports or pip."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PYTHONPATH",
            "PYTHONHOME",
            "PYTHONSTARTUP",
            "VIRTUAL_ENV",
            "PYTHONUSERBASE",
            "VLLM_PLUGINS",
        )
        and not k.startswith("PIP_")
    }
    env.update(
        PYTHONNOUSERSITE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1"
    )
    return env


def _run(cmd: list, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _show(result: subprocess.CompletedProcess) -> str:
    return (
        f"\n$ {' '.join(result.args)}\nexit {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


def _ok(cmd: list, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = _run(cmd, cwd, env)
    assert result.returncode == 0, _show(result)
    return result


def _source_patches(src: Path) -> dict[str, bytes]:
    """The checkout's patch sets, every supported version's, keyed
    ``<version>/<name>`` (as copied: edits made meanwhile do not count)."""
    directory = src / PACKAGE / "patches"
    patches = {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.glob("*/*.patch"))
    }
    assert patches, f"no */*.patch in {directory}"
    return patches


def _installed_set(patches: dict[str, bytes]) -> list[str]:
    """The names of the installed vLLM's set among ``patches``
    (``<version>/<name>`` keys)."""
    from vllm_hidden_states import versions
    from vllm_hidden_states.tools import source_patches

    version = versions.for_version(source_patches.check_version()).version
    return [key.split("/", 1)[1] for key in patches if key.startswith(f"{version}/")]


def _only(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {directory}: {found}"
    return found[0]


def _wheel_patches(wheel: Path) -> dict[str, bytes]:
    prefix = f"{PACKAGE}/patches/"
    with zipfile.ZipFile(wheel) as z:
        return {
            n[len(prefix) :]: z.read(n)
            for n in z.namelist()
            if n.startswith(prefix) and n.endswith(".patch")
        }


@dataclass
class Install:
    tmp: Path
    src: Path  # the copy of the checkout that was built
    wheel: Path
    sdist: Path
    wheel_from_sdist: Path
    venv: Path
    shared_site: Path  # the project venv's site-packages (vLLM lives there)

    @property
    def patches(self) -> dict[str, bytes]:
        return _source_patches(self.src)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def cli(self) -> Path:
        return self.venv / "bin" / "vllm-hidden-states"

    def py(self, code: str) -> subprocess.CompletedProcess:
        # cwd outside the checkout: '' on sys.path must not find the sources.
        return _run([self.python, "-c", code], cwd=self.tmp)

    def hidden_states(self, *args: str) -> subprocess.CompletedProcess:
        return _run([self.cli, *args], cwd=self.tmp)


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> Install:
    tmp = tmp_path_factory.mktemp("wheel-install")
    src = tmp / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=_ignore)

    # 1. Wheel and sdist from the checkout, then a wheel from that sdist.
    _ok(
        [
            PYTHON,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp / "wheelhouse",
            src,
        ],
        cwd=tmp,
    )
    wheel = _only(tmp / "wheelhouse", "*.whl")
    (tmp / "sdist").mkdir()
    _ok(
        [
            PYTHON,
            "-c",
            "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))",
            tmp / "sdist",
        ],
        cwd=src,
    )
    sdist = _only(tmp / "sdist", "*.tar.gz")
    _ok(
        [
            PYTHON,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp / "from-sdist",
            sdist,
        ],
        cwd=tmp,
    )
    wheel_from_sdist = _only(tmp / "from-sdist", "*.whl")

    # 2. A fresh venv that sees the project venv's site-packages (vLLM) as a
    #    plain path, so none of that directory's .pth files run there.
    venv = tmp / "venv"
    _ok([PYTHON, "-m", "venv", venv], cwd=tmp)
    shared_site = Path(sysconfig.get_paths()["purelib"])
    assert (shared_site / "vllm").is_dir(), f"no vllm in {shared_site}"
    new_site = Path(
        _ok(
            [
                venv / "bin" / "python",
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            cwd=tmp,
        ).stdout.strip()
    )
    assert new_site.is_relative_to(venv), new_site
    (new_site / "zz_shared_vllm.pth").write_text(f"{shared_site}\n")

    # 3. The wheel, non-editable.
    _ok(
        [venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", wheel], cwd=tmp
    )
    return Install(tmp, src, wheel, sdist, wheel_from_sdist, venv, shared_site)


# --- what the distributions contain -------------------------------------------


def test_wheel_ships_every_patch_byte_identical(install):
    assert _wheel_patches(install.wheel) == install.patches


def test_wheel_ships_every_module_of_the_package(install):
    expected = {
        p.relative_to(install.src).as_posix()
        for p in (install.src / PACKAGE).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    with zipfile.ZipFile(install.wheel) as z:
        missing = expected - set(z.namelist())
    assert not missing, f"modules missing from {install.wheel.name}: {sorted(missing)}"


def _patch_imports(patches: dict[str, bytes]) -> list[tuple[str, str, str]]:
    """``(patch, module, name)`` for each name the patches' added lines import
    from this package (``import vllm_hidden_states.x`` gives name ``""``)."""
    found = []
    for patch, data in patches.items():
        added = [
            line[1:]
            for line in data.decode().splitlines()
            if line.startswith("+") and not line.startswith("+++")
        ]
        i = 0
        while i < len(added):
            line = added[i].strip()
            m = re.match(rf"from ({PACKAGE}(?:\.\w+)*) import (.*)$", line)
            if m:
                module, names = m.groups()
                if names.startswith("("):
                    while ")" not in names and i + 1 < len(added):
                        i += 1
                        names += " " + added[i].strip()
                names = names.strip("() ").split("#")[0]
                for item in names.split(","):
                    if item.strip():
                        found.append((patch, module, item.split(" as ")[0].strip()))
            for module in re.findall(rf"^import ({PACKAGE}(?:\.\w+)*)", line):
                found.append((patch, module, ""))
            i += 1
    return found


def _top_level_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_wheel_has_every_module_and_name_the_patches_import(install):
    imports = _patch_imports(_wheel_patches(install.wheel))
    assert imports, "the patches import nothing from the package?"
    with zipfile.ZipFile(install.wheel) as z:
        files = set(z.namelist())
        problems = []
        for patch, module, name in imports:
            base = module.replace(".", "/")
            path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in files), None)
            if path is None:
                if not any(f.startswith(base + "/") for f in files):
                    problems.append(f"{patch}: module {module} is not in the wheel")
                elif name and f"{base}/{name}.py" not in files:
                    problems.append(f"{patch}: {module} is a namespace without {name}")
                continue
            defined = _top_level_names(z.read(path).decode())
            if (
                name
                and name not in defined
                and "__getattr__" not in defined
                and not any(f.startswith(f"{base}/{name}") for f in files)
            ):
                problems.append(f"{patch}: {module} ({path}) defines no {name}")
    assert not problems, "\n".join(problems)


def test_wheel_declares_the_plugin_and_the_console_script(install):
    with zipfile.ZipFile(install.wheel) as z:
        [name] = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(name).decode()
    eps = configparser.ConfigParser(delimiters=("=",))
    eps.read_string(text)
    assert (
        eps.has_option("vllm.general_plugins", "hidden_states")
        and eps.get("vllm.general_plugins", "hidden_states") == "vllm_hidden_states.plugin:register"
        and eps.has_option("console_scripts", "vllm-hidden-states")
        and eps.get("console_scripts", "vllm-hidden-states") == "vllm_hidden_states.tools.cli:main"
    ), text


def test_sdist_ships_every_patch_byte_identical(install):
    with tarfile.open(install.sdist) as t:
        found = {}
        for m in t.getmembers():
            parts = m.name.split("/")
            if parts[1:3] == [PACKAGE, "patches"] and len(parts) == 5 and m.isfile():
                found["/".join(parts[3:])] = t.extractfile(m).read()
    assert found == install.patches, sorted(t.getnames())


def test_wheel_built_from_the_sdist_ships_every_patch(install):
    assert _wheel_patches(install.wheel_from_sdist) == install.patches


# --- the installed wheel in a fresh venv ----------------------------------------


def test_new_venv_imports_the_installed_copy_not_the_checkout(install):
    result = install.py("import vllm_hidden_states; print(vllm_hidden_states.__file__)")
    assert result.returncode == 0 and Path(result.stdout.strip()).is_relative_to(install.venv), (
        _show(result)
    )


def test_installed_copy_reads_its_own_patches(install):
    result = install.py(
        "from vllm_hidden_states.tools import source_patches; "
        "print(source_patches.patches_dir()); "
        "print(','.join(p.name for p in source_patches.patch_files()))"
    )
    assert result.returncode == 0, _show(result)
    directory, names = result.stdout.strip().splitlines()
    assert Path(directory).is_relative_to(install.venv) and names.split(",") == _installed_set(
        install.patches
    ), _show(result)


def test_patch_check_lists_every_patch_as_applied(install):
    result = install.hidden_states("patch", "check")
    assert result.returncode == 0 and all(
        f"applied      {name}" in result.stdout.splitlines()
        for name in _installed_set(install.patches)
    ), _show(result)


def _vllm_tree_digest(site: Path) -> dict[str, str]:
    root = site / "vllm"
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (p.suffix in (".py", ".patch"))
    }


@pytest.fixture(scope="module")
def applied(install):
    """``patch apply`` in the new venv, with the shared vLLM hashed around it."""
    check = install.hidden_states("patch", "check")
    if check.returncode != 0:
        pytest.fail(
            "the shared vLLM is not patched with this checkout's patch set; "
            "not running `patch apply` against it (run `make setup`)" + _show(check)
        )
    before = _vllm_tree_digest(install.shared_site)
    result = install.hidden_states("patch", "apply")
    after = _vllm_tree_digest(install.shared_site)
    return result, before, after


def test_patch_apply_says_already_patched(applied):
    result, _, _ = applied
    assert result.returncode == 0 and "already patched" in result.stdout, _show(result)


def test_patch_apply_leaves_the_shared_vllm_untouched(applied):
    _, before, after = applied
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"`patch apply` changed files of the shared vLLM: {changed}"


def test_plugin_register_runs(install):
    result = install.py("from vllm_hidden_states.plugin import register; register()")
    assert result.returncode == 0, _show(result)


def test_plugin_entry_point_is_visible_from_the_installed_wheel(install):
    result = install.py(
        "import importlib.metadata as m\n"
        "print([e.value for e in m.entry_points(group='vllm.general_plugins')])\n"
        "print(m.distribution('vllm-hidden-states').locate_file(''))\n"
    )
    assert result.returncode == 0, _show(result)
    values, location = result.stdout.strip().splitlines()
    assert "vllm_hidden_states.plugin:register" in values and Path(
        location
    ).resolve().is_relative_to(install.venv.resolve()), _show(result)


def test_vllm_loads_the_plugin_from_the_installed_wheel(install):
    result = install.py(
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "print(sys.modules['vllm_hidden_states.plugin'].__file__)\n"
        "print(hasattr(GPUModelRunner, '_setup_hidden_states_capture'))\n"
    )
    assert result.returncode == 0, _show(result)
    plugin_file, called_out = result.stdout.strip().splitlines()[-2:]
    assert Path(plugin_file).is_relative_to(install.venv) and called_out == "True", _show(result)


# --- the compiled ops (vllm_hidden_states._C) -------------------------------------


def _compiled_ops(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return [n for n in z.namelist() if re.fullmatch(rf"{PACKAGE}/_C\.[^/]*\.so", n)]


def _c_expected() -> bool:
    return os.environ.get("VLLM_HIDDEN_STATES_BUILD_C") != "0" and bool(
        shutil.which("cmake") and (shutil.which("c++") or shutil.which("g++"))
    )


def test_wheel_ships_the_compiled_ops_where_cmake_and_a_compiler_are_found(install):
    if not _c_expected():
        pytest.skip("no cmake/C++ compiler, or VLLM_HIDDEN_STATES_BUILD_C=0: no _C to ship")
    assert len(_compiled_ops(install.wheel)) == 1, zipfile.ZipFile(install.wheel).namelist()
    assert len(_compiled_ops(install.wheel_from_sdist)) == 1, "the sdist lacks csrc/ or CMake"
    result = install.py(
        "from vllm_hidden_states.worker import c_ops; print(c_ops.load(), c_ops.why_not())"
    )
    assert result.returncode == 0 and result.stdout.split()[0] == "True", _show(result)


def _wheel_without_c(install: Install, name: str, env: dict[str, str]) -> tuple[Path, str]:
    # A fresh copy: the first builds left build/ (and CMake's cache) in src.
    src = install.tmp / f"{name}-src"
    shutil.copytree(install.src, src, symlinks=True, ignore=_ignore)
    out = install.tmp / name
    result = _ok(
        [
            PYTHON,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            out,
            src,
        ],
        cwd=install.tmp,
        env=env,
    )
    return _only(out, "*.whl"), result.stdout + result.stderr


def test_wheel_builds_without_the_compiled_ops_when_turned_off(install):
    wheel, log = _wheel_without_c(install, "no-c", {"VLLM_HIDDEN_STATES_BUILD_C": "0"})
    assert _compiled_ops(wheel) == [] and wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert "VLLM_HIDDEN_STATES_BUILD_C=0: not building vllm_hidden_states._C" in log
    assert _wheel_patches(wheel) == install.patches


def test_a_failing_compiled_ops_build_still_builds_the_wheel_without_them(install):
    if shutil.which("cmake") is None:
        pytest.skip("no cmake: the build is skipped before it can fail")
    wheel, log = _wheel_without_c(
        install, "failed-c", {"CXX": "/bin/false", "VLLM_HIDDEN_STATES_BUILD_C": "1"}
    )
    assert _compiled_ops(wheel) == [], zipfile.ZipFile(wheel).namelist()
    assert "building vllm_hidden_states._C failed" in log, log[-3000:]
    assert _wheel_patches(wheel) == install.patches
