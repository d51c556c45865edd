"""``kvguard`` command line: ``report``, ``sidecar``, ``chaos`` and ``demo``.

Every option also reads a ``KVGUARD_*`` environment variable (see docs/operator-guide.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvguard.config import KvguardConfig
from kvguard.errors import KvguardError
from kvguard.transport.reader import read_run_dir

SCHEDULINGS: tuple[str, ...] = ("sync", "async")
"""``kvguard chaos --scheduling`` values: ``kvguard.testing.scheduling.Scheduling``'s, spelled
here so that the CLI imports no test tooling until a command needs it (tests/cli checks
that the two agree)."""

if TYPE_CHECKING:
    from kvguard.core.transfers import TransfersState


def _cmd_report(args: argparse.Namespace) -> int:
    from kvguard.cli.render import render_state

    if args.sidecar:
        if not args.transfers:
            print("kvguard: --sidecar needs --transfers (the per-engine reports of a sidecar "
                  "are at its /v1/report and status page)", file=sys.stderr)
            return 2
        return _transfers_from_sidecars(args)
    run_dirs = [Path(d) for d in args.run_dir] if args.run_dir else \
        [KvguardConfig.from_env().run_dir]
    states = []
    for run_dir in run_dirs:
        result = read_run_dir(run_dir)
        for name, err in result.errors.items():
            print(f"kvguard: skipped {name}: {err}", file=sys.stderr)
        states.extend(result.states)
    if not states:
        print(f"kvguard: no engine state in {', '.join(map(str, run_dirs))}. Is vLLM running "
              "with VLLM_PLUGINS=kvguard and the same KVGUARD_RUN_DIR?", file=sys.stderr)
        return 2
    if args.transfers:
        _print_transfers({s.engine: s.transfers for s in states}, as_json=args.json)
        return 0
    if args.json:
        # Per engine: its latest report, and beside it what is judged online (the offload
        # audit, the wedge verdict, reclaim) and which features are off for a missing hook.
        payload = [{**(s.latest_report.model_dump(mode="json") if s.latest_report else
                       {"engine": s.engine, "verdict": None}),
                    "offload": s.offload.model_dump(mode="json") if s.offload else None,
                    "wedge": s.wedge.model_dump(mode="json") if s.wedge else None,
                    "reclaim": s.reclaim.model_dump(mode="json") if s.reclaim else None,
                    "hooks_missing": list(s.hooks_missing)} for s in states]
        print(json.dumps(payload, indent=2))
    else:
        print("\n\n".join(render_state(s) for s in states))
    return 0


def _print_transfers(transfers: dict[str, TransfersState | None], *, as_json: bool) -> None:
    """The joined view of every transfer and the cross-engine findings; ``--json``: an
    object with ``transfers`` (each a joined transfer) and ``links`` (the findings, as the
    sidecar's ``transfer_links``)."""
    from kvguard.cli.transfers_view import render_transfers
    from kvguard.core.transfer_links import join_transfer_states, link_transfer_states

    joined, links = join_transfer_states(transfers), link_transfer_states(transfers)
    if as_json:
        print(json.dumps({"transfers": [j.model_dump(mode="json") for j in joined],
                          "links": [ln.model_dump(mode="json") for ln in links]}, indent=2))
    else:
        print(render_transfers(joined, links))


def _transfers_from_sidecars(args: argparse.Namespace) -> int:
    """The cross-engine transfer verdicts joined over several sidecars' HTTP APIs (one per
    node): exit 2 when one cannot be read."""
    from kvguard.cli.sidecars import read_sidecars, transfers_by_engine

    try:
        reports = read_sidecars(args.sidecar)
    except KvguardError as exc:
        print(f"kvguard: {exc}", file=sys.stderr)
        return 2
    _print_transfers(transfers_by_engine(reports), as_json=args.json)
    return 0


def _cmd_kv_events(args: argparse.Namespace) -> int:
    """The KV-event mirror check of every engine, as the sidecar judged it (the mirror lives in
    the sidecar). Exit 1 when an engine's mirror differs from its pool, 2 when the sidecar
    cannot be read."""
    import urllib.error
    import urllib.request

    from kvguard.cli.render import render_kv_events
    from kvguard.kv_events.verdict import KvEventsVerdict
    from kvguard.sidecar.models import ReportsResponse

    cfg = KvguardConfig.from_env()
    base = (args.sidecar or f"http://{cfg.sidecar_host}:{cfg.sidecar_port}").rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/v1/report", timeout=10) as resp:
            report = ReportsResponse.model_validate_json(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"kvguard: cannot read {base}/v1/report ({exc}); is `kvguard sidecar` running "
              "there (--sidecar URL)?", file=sys.stderr)
        return 2
    checks = {e.engine: e.kv_events for e in report.engines}
    if args.json:
        print(json.dumps({n: c.model_dump(mode="json") if c else None
                          for n, c in checks.items()}, indent=2))
    else:
        print("\n".join(render_kv_events(n, c) for n, c in checks.items()) or "no engine")
    ok = (KvEventsVerdict.CONSISTENT, KvEventsVerdict.PENDING)
    return 1 if any(c is not None and c.verdict not in ok for c in checks.values()) else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvguard.demo.run import run_demo

    return run_demo(workdir=Path(args.workdir) if args.workdir else None,
                    inject_fault=not args.no_fault)


def _cmd_sidecar(args: argparse.Namespace) -> int:
    from kvguard.sidecar.server import serve

    cfg = KvguardConfig.from_env()
    serve(host=args.host or cfg.sidecar_host, port=args.port or cfg.sidecar_port,
          run_dir=Path(args.run_dir) if args.run_dir else None,
          uds=args.uds or cfg.sidecar_uds, config=cfg)
    return 0


def _cmd_chaos(args: argparse.Namespace) -> int:
    import tempfile

    from kvguard.chaos.result import ScenarioResult, Status, mode_disagreements
    from kvguard.cli.chaos_table import render_table

    if args.url:
        # Client-side scenarios against a deployment: no engine here (no vLLM import).
        try:
            from kvguard.chaos.remote import run_remote
        except ModuleNotFoundError as exc:
            print(f"kvguard: chaos --url needs {exc.name}, which this install lacks: "
                  "pip install 'kvguard[chaos]'", file=sys.stderr)
            return 2
        if not args.sidecar:
            print("kvguard: --url needs --sidecar URL (the deployment's kvguard sidecar, "
                  "where the verdict is read)", file=sys.stderr)
            return 2
        results = run_remote(args.url, args.sidecar, model=args.model,
                             token=KvguardConfig.from_env().control_token)
        print(render_table(results))
        if args.json:
            Path(args.json).write_text(json.dumps([r.model_dump(mode="json") for r in results],
                                                  indent=2))
        return 0 if all(r.status is Status.PASSED for r in results) else 1

    from kvguard.chaos.runner import expected_text, run_matrix
    from kvguard.chaos.scenarios import matrix
    from kvguard.testing.scheduling import Scheduling

    modes = list(Scheduling) if args.scheduling == "both" else [Scheduling(args.scheduling)]

    if args.list:
        for s in matrix():
            print(f"{s.name:<32} {s.injected}  [expect {expected_text(s)}]")
        return 0

    def progress(done: int, total: int, result: ScenarioResult | None, name: str) -> None:
        if args.jobs > 1:  # runs overlap: one line per event
            print(f"[{done if result else done + 1:>2}/{total}] {name} "
                  + (f"{result.status.value} ({result.seconds:.0f} s)" if result else "..."),
                  file=sys.stderr, flush=True)
        elif result is None:
            print(f"[{done + 1:>2}/{total}] {name} ...", end="", file=sys.stderr, flush=True)
        else:
            print(f" {result.status.value} ({result.seconds:.0f} s)", file=sys.stderr,
                  flush=True)

    only = [n for n in (args.only or "").split(",") if n] or None
    with tempfile.TemporaryDirectory(prefix="kvguard-chaos-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_matrix(only, workdir, progress, schedulings=modes, jobs=args.jobs)
    print(render_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.model_dump(mode="json") for r in results],
                                              indent=2))
    bad = [r for r in results if r.status in (Status.FAILED, Status.ERROR)]
    return 1 if bad or mode_disagreements(results) else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvguard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="show the latest checkpoint report of each engine")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--run-dir", action="append",
                   help="where engines publish state (KVGUARD_RUN_DIR); repeat it to read "
                        "several, e.g. a prefill and a decode engine's")
    r.add_argument("--transfers", action="store_true",
                   help="P/D: each request's KV transfer joined across its two engines "
                        "(both sides, lease and read times, hazards) and judged (prefill "
                        "holds for an aborted decode, blocks freed before read, read not "
                        "received); --json: {transfers, links}")
    r.add_argument("--sidecar", action="append",
                   help="with --transfers: read this kvguard sidecar's /v1/report instead of "
                        "a run dir; repeat it to join engines on different nodes, e.g. the "
                        "prefill pod's sidecar and the decode pod's")
    r.set_defaults(func=_cmd_report)
    kv = sub.add_parser("kv-events", help="does each engine's KV-event mirror (what a router "
                        "believes it caches) match its pool? (asks the sidecar)")
    kv.add_argument("--sidecar", help="the sidecar's URL (default: KVGUARD_SIDECAR_HOST and "
                    "_PORT, http://127.0.0.1:9400)")
    kv.add_argument("--json", action="store_true", help="machine-readable output")
    kv.set_defaults(func=_cmd_kv_events)
    sc = sub.add_parser("sidecar", help="serve reports and Prometheus metrics over HTTP")
    sc.add_argument("--host", help="bind address (KVGUARD_SIDECAR_HOST, default 127.0.0.1)")
    sc.add_argument("--port", type=int, help="TCP port (KVGUARD_SIDECAR_PORT, default 9400)")
    sc.add_argument("--uds", help="serve on this Unix socket instead (KVGUARD_SIDECAR_UDS)")
    sc.add_argument("--run-dir", help="where engines publish state (KVGUARD_RUN_DIR)")
    sc.set_defaults(func=_cmd_sidecar)
    ch = sub.add_parser("chaos", help="run the leak scenario matrix on a real engine")
    ch.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ch.add_argument("--only", help="comma-separated scenario names")
    ch.add_argument("--json", help="write the results as JSON to this file (for CI)")
    ch.add_argument("--workdir", help="keep models, logs and state here")
    ch.add_argument("--scheduling", choices=[*SCHEDULINGS, "both"],
                    default="sync", help="vLLM's scheduling mode for the embedded engine: "
                    "sync, async (the CPU build's override undone, AsyncScheduler with a "
                    "batch queue) or both (each scenario twice; fails if the verdicts differ)")
    ch.add_argument("--jobs", type=int, default=1,
                    help="scenarios run at once, each in its own process with its own engine "
                         "(default 1; 2 on a 2-core host took 60 %% of the time)")
    ch.add_argument("--url", help="run the client-side scenarios against this vLLM server "
                    "(staging) instead of the embedded engine")
    ch.add_argument("--sidecar", help="with --url: that deployment's kvguard sidecar URL")
    ch.add_argument("--model", help="with --url: model name (default: the server's first)")
    ch.set_defaults(func=_cmd_chaos)
    d = sub.add_parser("demo", help="tiny real vLLM server + kvguard + a faulty workload")
    d.add_argument("--workdir", help="keep the model, logs and state here (default: temp dir)")
    d.add_argument("--no-fault", action="store_true", help="run the workload without the "
                   "injected abort-path leak")
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except KvguardError as exc:
        print(f"kvguard: {exc}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
