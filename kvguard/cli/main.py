"""``kvguard`` command line: ``report``, ``sidecar`` and ``demo``.

Every option also reads a ``KVGUARD_*`` environment variable (see README).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvguard.config import KvguardConfig
from kvguard.errors import KvguardError
from kvguard.transport.reader import read_run_dir


def _cmd_report(args: argparse.Namespace) -> int:
    from kvguard.cli.render import render_state

    run_dir = Path(args.run_dir) if args.run_dir else KvguardConfig.from_env().run_dir
    result = read_run_dir(run_dir)
    for name, err in result.errors.items():
        print(f"kvguard: skipped {name}: {err}", file=sys.stderr)
    if not result.states:
        print(f"kvguard: no engine state in {run_dir}. Is vLLM running with "
              "VLLM_PLUGINS=kvguard and the same KVGUARD_RUN_DIR?", file=sys.stderr)
        return 2
    if args.json:
        payload = [s.latest_report.model_dump(mode="json") if s.latest_report else
                   {"engine": s.engine, "verdict": None} for s in result.states]
        print(json.dumps(payload, indent=2))
    else:
        print("\n\n".join(render_state(s) for s in result.states))
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvguard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="show the latest checkpoint report of each engine")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--run-dir", help="where engines publish state (KVGUARD_RUN_DIR)")
    r.set_defaults(func=_cmd_report)
    sc = sub.add_parser("sidecar", help="serve reports and Prometheus metrics over HTTP")
    sc.add_argument("--host", help="bind address (KVGUARD_SIDECAR_HOST, default 127.0.0.1)")
    sc.add_argument("--port", type=int, help="TCP port (KVGUARD_SIDECAR_PORT, default 9400)")
    sc.add_argument("--uds", help="serve on this Unix socket instead (KVGUARD_SIDECAR_UDS)")
    sc.add_argument("--run-dir", help="where engines publish state (KVGUARD_RUN_DIR)")
    sc.set_defaults(func=_cmd_sidecar)
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
