"""The docs cannot drift: every shell command in them is run here, parsed by the program it
calls, or listed below with the reason it is not run; every relative link resolves; the
README's cost figure is the benchmarks' own.

The documents are the README (the front page), ``docs/*.md`` and ``deploy/README.md``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvguard.cli.main import build_parser
from kvguard.config import KvguardConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]

_FENCE = re.compile(r"^```(bash|sh|shell)\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _commands(doc: Path) -> list[str]:
    """The command lines of a document's shell blocks: continuations joined, comments and
    a trailing ``&`` dropped."""
    out = []
    for block in _FENCE.finditer(doc.read_text()):
        text = block.group(2).replace("\\\n", " ")
        for line in text.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip().removesuffix("&").strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _run(line: str) -> None:
    """Run a cheap command as written, from the repository root; it must exit 0."""
    argv = shlex.split(line)
    tool = shutil.which(argv[0])
    if tool is None:
        pytest.fail(f"{argv[0]} is not installed (scripts/bootstrap installs it): {line}")
    proc = subprocess.run([tool, *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def _kvguard(line: str) -> None:
    """``kvguard ...``: ``--help`` is run; anything else is parsed by kvguard's own parser
    (it would start a server or read a run dir)."""
    argv = shlex.split(line)[1:]
    if argv[-1:] == ["--help"]:
        proc = subprocess.run([sys.executable, "-m", "kvguard.cli.main", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0 and "usage: kvguard" in proc.stdout, proc.stderr
        return
    build_parser().parse_args(argv)  # exits (SystemExit) on an unknown option


def _kustomize(line: str) -> None:
    """``kubectl apply -k DIR`` needs a cluster: the same kustomization is rendered."""
    directory = shlex.split(line)[-1]
    _run(f"kubectl kustomize {directory}")


def _export(line: str) -> None:
    """``export NAME=...``: a kvguard setting the docs table lists, or vLLM's plugin switch."""
    name = line.split()[1].split("=")[0]
    if name == "VLLM_PLUGINS":
        return
    assert name.startswith("KVGUARD_"), line
    assert f"`{name}`" in (ROOT / "docs" / "operator-guide.md").read_text(), \
        f"{name} is not in the operator guide's settings table"


def _exists(*paths: str) -> Callable[[str], None]:
    def check(line: str) -> None:
        for p in paths:
            assert (ROOT / p).exists(), f"{line}: {p} does not exist"
    return check


def _script(line: str) -> None:
    """``./scripts/X``: the script exists and is executable (CI runs ``./scripts/test``;
    ``tests/demo`` runs the ``kvguard demo`` that ``./scripts/demo`` executes)."""
    path = ROOT / line.split()[0]
    assert path.exists() and path.stat().st_mode & stat.S_IXUSR, line


def _phoenix_pin(line: str) -> None:
    """``pip install arize-phoenix==X``: the release ``scripts/bootstrap-phoenix`` pins (the
    one tests/tracing runs)."""
    pin = re.search(r"^PHOENIX_PIN=(\S+)$", (ROOT / "scripts" / "bootstrap-phoenix").read_text(),
                    re.M)
    assert pin is not None and line.split("==", 1)[1].split()[0] == pin.group(1), line


def _phoenix_serve(line: str) -> None:
    """``PHOENIX_...=... phoenix serve``: every setting is one the tests' Phoenix
    (tests/tracing/_phoenix.py, which starts it so) sets too."""
    fixture = (ROOT / "tests" / "tracing" / "_phoenix.py").read_text()
    names = re.findall(r"\b(PHOENIX_[A-Z_]+)=", line)
    assert names and all(f'"{n}"' in fixture for n in names), line


def _trace_id(line: str) -> None:
    """``export TRACE_ID=$(...)``: run; it must give 32 lowercase hex digits."""
    proc = subprocess.run(["bash", "-c", f'{line}; printf %s "$TRACE_ID"'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and re.fullmatch(r"[0-9a-f]{32}", proc.stdout), proc


NOT_RUN = "not run here"

RULES: list[tuple[str, Callable[[str], None] | str]] = [
    (r"kvguard ", _kvguard),
    (r"promtool (check|test) rules ", _run),
    (r"kubectl apply -k ", _kustomize),
    (r"export TRACE_ID=\$\(", _trace_id),
    (r"export ", _export),
    (r"pip install arize-phoenix==", _phoenix_pin),
    (r"(PHOENIX_[A-Z_]+=\S+ )+phoenix serve$", _phoenix_serve),
    (r"\./scripts/(demo|test|bench)$", _script),
    (r"KVGUARD_SOAK_SECONDS=\d+ \.venv/bin/python -m pytest tests/reliability/test_soak\.py",
     _exists("tests/reliability/test_soak.py")),
    (r"kubectl -n monitoring create configmap kvguard-dashboard --from-file=dashboards/",
     _exists("dashboards/kvguard.json")),
    # Not run, and why:
    (r"pip install ", f"{NOT_RUN}: it installs from a package index"),
    (r"python -m vllm\.entrypoints", f"{NOT_RUN}: a model server (tests/vllm starts real ones)"),
    (r"docker build ", f"{NOT_RUN}: needs a Docker daemon and vLLM's image (GBs); "
                       "tests/deploy/test_docker.py lints and checks both Dockerfiles"),
    (r"kubectl (create secret|rollout|exec|port-forward|-n monitoring label)",
     f"{NOT_RUN}: needs a cluster; tests/deploy renders and validates the manifests"),
    (r"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=\S+ VLLM_PLUGINS=kvguard +python -m vllm\.",
     f"{NOT_RUN}: a model server exporting spans (tests/tracing and tests/crossnode start "
     "real ones, with this flag and protocol)"),
    (r'curl -H "traceparent: ', f"{NOT_RUN}: needs a model server; tests/tracing and "
                                "tests/crossnode send this header to real ones"),
    (r"curl ", f"{NOT_RUN}: needs a deployed sidecar; tests/sidecar calls every endpoint"),
]


def _rule(line: str) -> Callable[[str], None] | str:
    for pattern, how in RULES:
        if re.match(pattern, line):
            return how
    pytest.fail(f"a command in the docs that no rule covers (run it here, or say why not): "
                f"{line}")


_LINES = [(doc.relative_to(ROOT).as_posix(), line) for doc in DOCS for line in _commands(doc)]


@pytest.mark.parametrize(("doc", "line"), _LINES, ids=[f"{d}:{c[:40]}" for d, c in _LINES])
def test_every_command_in_the_docs_is_run_or_said_why_not(doc: str, line: str) -> None:
    how = _rule(line)
    if callable(how):
        how(line)
    else:
        assert how.startswith(NOT_RUN)


def test_the_docs_have_commands_and_the_cheap_ones_run() -> None:
    ran = [line for _, line in _LINES if callable(_rule(line))]
    assert len(ran) >= 10, ran


_INLINE = re.compile(r"`(kvguard (?:report|sidecar|chaos|demo|kv-events)\b[^`]*)`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_kvguard_command_in_the_prose_parses(doc: Path) -> None:
    # `kvguard report --transfers ...` in a sentence: an option renamed or removed in the
    # CLI fails here (argparse exits on an unknown option).
    for command in _INLINE.findall(doc.read_text()):
        build_parser().parse_args(shlex.split(command)[1:])


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out: set[str] = set()
    for title in re.findall(r"^#+ (.+)$", doc.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        out.add(slug if slug not in out else f"{slug}-1")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc: Path) -> None:
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name}: {target} (no such heading)"


def test_the_readme_quotes_the_benchmarks_end_to_end_cost() -> None:
    result = json.loads((ROOT / "bench" / "results" / "throughput.json").read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    readme = (ROOT / "README.md").read_text()
    for mode in ("interleaved-sync", "interleaved-async"):
        r = rows[mode]
        assert f"**{r['mean_ratio']:.3f}x +- {r['ci95_half_width']:.3f}**" in readme, mode


def test_every_setting_is_in_the_operator_guides_table() -> None:
    # One row per field of KvguardConfig, read from KVGUARD_<FIELD>: a new setting without
    # a row fails here.
    guide = (ROOT / "docs" / "operator-guide.md").read_text()
    rows = set(re.findall(r"^\| `(KVGUARD_[A-Z_]+)`", guide, re.M))
    names = {f"KVGUARD_{f.name.upper()}" for f in dataclasses.fields(KvguardConfig)}
    assert names <= rows | {"KVGUARD_FAULTS", "KVGUARD_ALLOW_FAULTS"} and names, names - rows
    assert f"| `KVGUARD_ONLINE_BUDGET_FRACTION` | `{KvguardConfig().online_budget_fraction}` |" \
        in guide
