"""Soak: a bounded mixed workload keeps kvguard's memory flat and reports no false leak.

CI runs it for ``KVGUARD_SOAK_SECONDS`` (default 30 s); a longer soak:

    KVGUARD_SOAK_SECONDS=900 .venv/bin/python -m pytest tests/reliability/test_soak.py -s

Each cycle is one ``mixed_round`` with fresh prompts (normal requests, two
cancellations, preemptions in an 11-block pool, a shared prefix with six
sharers) on a real in-process engine, without resetting the prefix cache (it
fills and churns), ending in a drained checkpoint. The sidecar's store reads the
state file after every cycle. After a warm-up that fills every bounded
structure (report history, the store's history, the drain window), the sizes
of kvguard's structures and the memory allocated by kvguard's code
(``tracemalloc``, filtered to the kvguard package) must stay flat to the end.
"""

from __future__ import annotations

import os
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _reliability import WAIT_SECONDS, EngineFactory

import kvguard
from kvguard.core.types import Verdict
from kvguard.sidecar.store import EngineStore
from kvguard.vllm_plugin.guard import EngineGuard

pytestmark = pytest.mark.engine

SOAK_SECONDS = float(os.environ.get("KVGUARD_SOAK_SECONDS", "30"))
ENGINE_HISTORY = 4
STORE_HISTORY = 8
DRAIN_WINDOW_SECONDS = 4.0
"""Shortened for the soak (30 s in production) so that warm-up fills it quickly."""
MIN_WARMUP_CYCLES = STORE_HISTORY + 2
KVGUARD_DIR = str(Path(kvguard.__file__).resolve().parent)
ALLOWED_GROWTH_BYTES = 64 * 1024
"""Noise: deque blocks, dict resizes, counters crossing an int size."""


def _sizes(g: EngineGuard, store: EngineStore) -> dict[str, int]:
    ledger = g.ledger
    view = store.engines[g.engine]
    return {
        "ledger_records": ledger.num_records,
        "ledger_ownerships": ledger.num_ownerships,
        "ledger_blocks_owned": len(list(ledger.owned_block_ids())),
        "ledger_double_free_events": len(ledger.double_frees),
        "ledger_event_kinds": len(ledger.num_events),
        "finished_holding": len(ledger.finished_holding()),
        "guard_reports": len(g.reports),
        "guard_verdict_kinds": len(g.checkpoints_total),
        "guard_hook_error_kinds": len(g.errors.by_hook),
        "publisher_pending": int(g.publisher._pending is not None),
        "online_confirmed": len(g.online.confirmed) if g.online is not None else -1,
        "store_engines": len(store.engines),
        "store_history": len(view.history),
        "store_epochs": len(view.epochs_seen),
        "store_read_errors": len(store.read_errors),
    }


def _kvguard_bytes(snapshot: tracemalloc.Snapshot) -> int:
    only = snapshot.filter_traces([tracemalloc.Filter(True, f"{KVGUARD_DIR}/*")])
    return sum(stat.size for stat in only.statistics("filename"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# At least 2 x MIN_WARMUP_CYCLES rounds whatever the clock says: a round can take a minute
# on a loaded 2-core host, so the limit is generous (the suite's default is 10 minutes).
@pytest.mark.timeout(max(3600, 4 * SOAK_SECONDS))
def test_a_mixed_workload_soak_keeps_memory_flat_and_reports_no_false_leak(
    rel_engines: EngineFactory, tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    e = rel_engines(run_dir=run_dir, name="rel-soak",
                    extra_env={"KVGUARD_HISTORY": str(ENGINE_HISTORY),
                               "KVGUARD_PUBLISH_INTERVAL_SECONDS": "0.2"})
    g = e.g
    g.drain.window_seconds = DRAIN_WINDOW_SECONDS
    store = EngineStore(run_dir, history=STORE_HISTORY)
    verdicts: Counter[str] = Counter()
    false_leaks: list[Any] = []
    last_seen = 0

    def cycle(i: int) -> None:
        nonlocal last_seen
        out = e.mixed_round(seed=i, reset_prefix_cache=False, extra_sharers=3)
        assert len(out) == 9, sorted(out)  # everything not cancelled finished
        g.publish()
        assert g.publisher.flush(WAIT_SECONDS)
        store.refresh()
        new = [r for r in g.reports if r.checkpoint_id > last_seen]
        assert new, "every cycle ends in a drained checkpoint"
        for r in new:
            verdicts[r.verdict.value] += 1
            if r.verdict is Verdict.LEAK or r.leaks or r.finished_requests_holding_blocks:
                false_leaks.append(r)
        last_seen = g.reports[-1].checkpoint_id

    tracemalloc.start(1)
    try:
        t0 = time.monotonic()
        i = 0
        while i < MIN_WARMUP_CYCLES or time.monotonic() - t0 < max(
                DRAIN_WINDOW_SECONDS + 1, 0.25 * SOAK_SECONDS):
            cycle(i)
            i += 1
        warm_cycles, warm_at = i, time.monotonic() - t0
        sizes0 = _sizes(g, store)
        state0 = len(g.state().model_dump_json())
        bytes0 = _kvguard_bytes(tracemalloc.take_snapshot())
        rss0 = _rss_bytes()
        while time.monotonic() - t0 < SOAK_SECONDS or i < 2 * warm_cycles:
            cycle(i)
            i += 1
        sizes1 = _sizes(g, store)
        state1 = len(g.state().model_dump_json())
        bytes1 = _kvguard_bytes(tracemalloc.take_snapshot())
        rss1 = _rss_bytes()
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - t0
    print(f"[reliability] soak: {i} cycles in {elapsed:.0f} s (warm-up {warm_cycles} cycles, "
          f"{warm_at:.0f} s), {sum(verdicts.values())} checkpoints {dict(verdicts)}, "
          f"events {dict(g.ledger.num_events)}; kvguard-allocated memory "
          f"{bytes0} -> {bytes1} bytes, state file {state0} -> {state1} bytes, "
          f"process RSS {rss0 >> 20} -> {rss1 >> 20} MiB; sizes {sizes1}")
    assert not false_leaks, [r.explanation for r in false_leaks[:3]]  # online reports too
    assert g.errors.total == 0
    assert g.online is not None and g.online.stats.sweeps_total > 0
    assert sizes1 == sizes0
    assert sizes1["ledger_records"] == sizes1["ledger_ownerships"] == 0
    assert sizes1["guard_reports"] == ENGINE_HISTORY
    assert sizes1["store_history"] == STORE_HISTORY
    assert state1 <= state0 + 512  # only counters' digits may grow
    assert bytes1 - bytes0 <= ALLOWED_GROWTH_BYTES
    assert g.ledger.num_events["preempt"] >= i and g.ledger.num_events["prefix_hit"] >= i
    assert g.ledger.num_events["finish_aborted"] >= 2 * i
    view = store.engines[g.engine]
    assert view.history[-1].checkpoint_id == g.reports[-1].checkpoint_id
