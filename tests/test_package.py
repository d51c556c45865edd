"""The package as users and CI see it: public API, type and lint cleanliness, core purity."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

import kvguard

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def supported_pythons() -> list[str]:
    """Every CPython minor (3.x) that ``requires-python`` admits."""
    spec = SpecifierSet(PYPROJECT["project"]["requires-python"])
    return [f"3.{minor}" for minor in range(8, 20) if f"3.{minor}" in spec]


def test_public_api_is_exactly_all() -> None:
    # Subpackages and modules become attributes once anything imports them; they are
    # not part of the API.
    public = {n for n, v in vars(kvguard).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public | {"__version__"} == set(kvguard.__all__)
    for name in kvguard.__all__:
        assert getattr(kvguard, name) is not None


def test_core_imports_neither_vllm_nor_torch() -> None:
    code = ("import sys, kvguard, kvguard.core.reconciler, kvguard.core.checkpoint, "
            "kvguard.core.online, kvguard.core.session, kvguard.core.classify, "
            "kvguard.core.engine; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_requires_python_admits_3_12_and_the_tools_target_its_minimum() -> None:
    # mypy's and ruff's targets describe the oldest Python kvguard supports; newer ones
    # are checked by running mypy for each of them (below).
    pythons = supported_pythons()
    assert "3.12" in pythons, pythons
    assert PYPROJECT["tool"]["mypy"]["python_version"] == pythons[0]
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + pythons[0].replace(".", "")


SCRIPTS = ["scripts/gpu_check.py"]
"""Python scripts outside the package, checked like it (mypy with the oldest Python's run,
ruff): the GPU check runs only where a GPU is, so nothing else would notice it breaking."""

BENCH_PATH = ["bench", "tests/core", "tests/sidecar", "tests/scheduler", "tests/pd"]
"""Where the benchmarks' own modules (``harness``) and the test helpers they use live."""


def newer_python_config(path: Path) -> Path:
    """pyproject's mypy settings for the newer Pythons' runs, with vLLM's and torch's
    sources not followed (their types become ``Any``) and the three strict checks that
    only those types decide turned off: the oldest Python's run checks kvguard against
    them, and what differs between Pythons is the standard library, which these runs
    still check in full. Each takes 7 s instead of 55 s from a cold cache."""
    mypy = PYPROJECT["tool"]["mypy"]
    lines = ["[mypy]", f"strict = {mypy['strict']}", f"python_version = {mypy['python_version']}",
             f"packages = {','.join(mypy['packages'])}", "allow_subclassing_any = True",
             "warn_unused_ignores = False", "warn_return_any = False"]
    for override in mypy["overrides"]:
        lines.append(f"[mypy-{','.join(override['module'])}]")
        lines += [f"{k} = {v}" for k, v in override.items() if k != "module"]
        lines.append("follow_imports = skip")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def mypy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.Popen[str]]:
    """One ``mypy --strict`` per supported Python, all started at once. The oldest
    Python's run follows vLLM's and torch's sources (about 55 s from a cold cache) and
    also checks ``bench/`` and :data:`SCRIPTS`: a benchmark calling what no longer exists
    (``bench_cost_meter.py`` did, unnoticed for days) fails here, not at the next
    ``./scripts/bench``. The newer Pythons' runs use :func:`newer_python_config`."""
    pythons = supported_pythons()
    newer = newer_python_config(tmp_path_factory.mktemp("mypy") / "mypy.ini")
    oldest = ["kvguard", *sorted(str(p.relative_to(ROOT))
                                for p in (ROOT / "bench").glob("*.py")), *SCRIPTS]
    env = {**os.environ, "MYPYPATH": os.pathsep.join(BENCH_PATH)}
    return {python: subprocess.Popen(
                [sys.executable, "-m", "mypy", "--python-version", python,
                 *(oldest if python == pythons[0] else ["--config-file", str(newer)])],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for python in pythons}


@pytest.mark.parametrize("python", supported_pythons())
def test_mypy_strict_is_clean(python: str, mypy_runs: dict[str, subprocess.Popen[str]]
                              ) -> None:
    out, _ = mypy_runs[python].communicate(timeout=600)
    assert mypy_runs[python].returncode == 0, out


def test_ruff_is_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "kvguard", "tests", "bench",
                        *SCRIPTS],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_bad_engine_name_is_refused_with_what_is_allowed() -> None:
    import pytest

    from kvguard.config import KvguardConfig
    from kvguard.errors import ConfigError

    with pytest.raises(ConfigError, match=r"KVGUARD_ENGINE_NAME.*A-Z a-z 0-9"):
        KvguardConfig.from_env({"KVGUARD_ENGINE_NAME": "dp0/../../etc"})
    assert KvguardConfig.from_env({"KVGUARD_ENGINE_NAME": "pod-7.dp0"}).engine_name == "pod-7.dp0"


MAX_MODULE_LINES = 600
"""A module longer than this is doing more than one job (issue 53: the session was 930)."""


def test_no_module_in_the_package_is_over_600_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "kvguard").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these by job (lines): {long}"


def _kvguard_imports() -> dict[str, set[str]]:
    """Module -> the kvguard modules it imports anywhere in its body (a function-level
    import is a dependency too: it only defers the circle to the first call)."""
    import ast

    mods = {}
    for p in (ROOT / "kvguard").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = p
    graph: dict[str, set[str]] = {}
    for name, p in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvguard"):
                base = node.module or ""
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("kvguard")}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_no_two_kvguard_modules_import_each_other() -> None:
    graph = _kvguard_imports()
    circles = []
    for a, deps in graph.items():
        for b in deps:
            seen, todo = {b}, [b]
            while todo:  # does b lead back to a?
                for c in graph[todo.pop()]:
                    if c == a:
                        circles.append(f"{a} <-> {b}")
                        todo = []
                        break
                    if c not in seen:
                        seen.add(c)
                        todo.append(c)
    assert not circles, "shared pieces belong in a module both import: " + ", ".join(
        sorted(set(circles)))
