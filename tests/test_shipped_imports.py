"""Every module kvguard ships imports where only what it declares is installed.

kvguard's wheel is installed (without its dependencies) into a venv that holds only the
runtime dependencies its metadata declares, and every module of the installed package is
imported, in a fresh interpreter outside the checkout. A module may fail only for a
package one of kvguard's extras declares (``vllm`` and ``torch`` for the engine, ``httpx``
for ``chaos``...), and then each extra is added in turn (installed into a directory of its
own, put on the path for that pass only): with it, nothing may fail for its packages. The
engine extras (3.5 GB) are the project venv's own: there every module must import (in the
test process, the checkout's editable install).

Cheap on purpose: the runtime venv and each extra's directory are built once per set of
requirements (keyed on them, under build/, with pip's cache) and reused; a run rebuilds
only kvguard's wheel.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "shipped-imports"
WHEEL_SOURCES = ("pyproject.toml", "README.md", "kvguard")

PACKAGES_OF_EXTRA: dict[str, frozenset[str]] = {
    "vllm": frozenset({"vllm", "torch"}), "engine": frozenset({"vllm", "torch"}),
    "chaos": frozenset({"httpx"}), "otel": frozenset({"opentelemetry"}),
    "gpu": frozenset({"pynvml"}), "pd": frozenset({"nixl"}),
}
"""The top-level import names each extra provides (a module may need them only through
its extra)."""

SMALL_EXTRAS = ("chaos", "otel", "gpu")
"""Added in turn to the runtime venv; the engine extras (and ``pd``, 430 MB of NIXL) are
checked in the project venv, which has them all (the second test)."""

PLAIN_INSTALL = ("kvguard", "kvguard.cli.main", "kvguard.sidecar.server",
                 "kvguard.sidecar.app", "kvguard.vllm_plugin.plugin")
"""What a plain install runs (the CLI, the sidecar, vLLM's entry point): these import with
the runtime dependencies alone."""

_PROBE = r"""
import importlib, json, pkgutil, sys
import kvguard
failed = {}
for m in sorted(m.name for m in pkgutil.walk_packages(kvguard.__path__, "kvguard.")):
    try:
        importlib.import_module(m)
    except ModuleNotFoundError as exc:
        failed[m] = (exc.name or "?").split(".")[0]
    except Exception as exc:
        failed[m] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"file": kvguard.__file__, "failed": failed}))
"""

_CLI_PROBE = r"""
import json, sys
import kvguard.cli.main
print(json.dumps(sorted(n for n in sys.modules if n.startswith("kvguard.testing"))))
"""


def _run(python: Path | str, code: str, path: list[Path] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(map(str, path))
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env,
                       cwd=CACHE, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


def _pip(python: Path | str, *args: str) -> None:
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def _wheel(tmp_path: Path) -> Path:
    """kvguard's wheel, built offline from a copy of its sources (setuptools writes there)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in WHEEL_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--disable-pip-version-check",
                        "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("kvguard-*.whl")
    return wheel


def _requirements(wheel: Path) -> dict[str, list[str]]:
    """The wheel's Requires-Dist per extra ("" for the runtime ones)."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = HeaderParser().parsestr(zf.read(name).decode())
    out: dict[str, list[str]] = {}
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        extra = next((e for e in PACKAGES_OF_EXTRA | {"dev": frozenset()}
                      if req.marker is not None and req.marker.evaluate({"extra": e})), "")
        req.marker = None
        out.setdefault(extra, []).append(str(req))
    return out


def _cached(kind: str, requirements: list[str], build: object) -> Path:
    """A directory under build/ keyed on ``requirements``: built once by ``build(path)``."""
    key = hashlib.sha256(json.dumps([kind, sys.version, sorted(requirements)]).encode())
    path = CACHE / f"{kind}-{key.hexdigest()[:12]}"
    if not (path / ".done").exists():
        shutil.rmtree(path, ignore_errors=True)
        build(path)  # type: ignore[operator]
        (path / ".done").touch()
    return path


@pytest.mark.timeout(900)
def test_every_shipped_module_imports_with_only_the_declared_dependencies(
        tmp_path: Path) -> None:
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(tmp_path)
    reqs = _requirements(wheel)

    def make_venv(path: Path) -> None:
        venv.EnvBuilder(with_pip=True).create(path)
        _pip(path / "bin" / "python", *reqs[""])

    runtime = _cached("runtime", reqs[""], make_venv)
    python = runtime / "bin" / "python"
    site = tmp_path / "kvguard"  # this run's kvguard: a directory of its own, no venv change
    _pip(python, "--no-deps", "--target", str(site), str(wheel))

    def probe(extra_dirs: list[Path]) -> dict[str, str]:
        out = json.loads(_run(python, _PROBE, [site, *extra_dirs]))
        assert Path(out["file"]).is_relative_to(site), out["file"]  # the wheel, not the tree
        return dict(out["failed"])

    # Runtime dependencies only: a failure only for a package some extra declares.
    failed = probe([])
    declared = frozenset().union(*PACKAGES_OF_EXTRA.values())
    assert {m: why for m, why in failed.items() if why not in declared} == {}
    assert [m for m in PLAIN_INSTALL if m in failed] == []
    assert json.loads(_run(python, _CLI_PROBE, [site])) == []  # no test tooling at import
    # Each small extra in turn: nothing fails for its packages any more.
    for extra in SMALL_EXTRAS:
        extra_dir = _cached(extra, reqs[extra], lambda p, e=extra: _pip(  # type: ignore[misc]
            python, "--target", str(p), *reqs[e]))
        with_extra = probe([extra_dir])
        assert {m: why for m, why in with_extra.items()
                if why in PACKAGES_OF_EXTRA[extra]} == {}, extra
    print(f"shipped imports: runtime venv and {len(SMALL_EXTRAS)} extras checked in "
          f"{time.monotonic() - started:.1f} s")


def test_every_shipped_module_imports_in_the_project_venv_which_has_every_extra() -> None:
    """The engine extras (vLLM, torch), pd, otel and chaos: the project venv has them all.
    In this process: the suite has vLLM imported already, so this costs a walk only."""
    import kvguard

    failed = {}
    for m in sorted(m.name for m in pkgutil.walk_packages(kvguard.__path__, "kvguard.")):
        try:
            importlib.import_module(m)
        except ImportError as exc:
            failed[m] = str(exc)
    assert failed == {}


def test_the_clis_scheduling_choices_are_the_test_toolings() -> None:
    from kvguard.cli.main import SCHEDULINGS
    from kvguard.testing.scheduling import Scheduling

    assert tuple(m.value for m in Scheduling) == SCHEDULINGS
