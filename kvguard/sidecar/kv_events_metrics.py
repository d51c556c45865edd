"""``kvguard_kv_events_*``: the KV-event mirror check as Prometheus series (one family each).

Every series carries ``ENGINE_LABELS`` (``engine_name``, ``model_name``, ``engine``) like the
other per-engine series; no per-request or per-block label (block keys are in
``/v1/report`` only).

=============================================  ======= =============================================
name                                           type    meaning
=============================================  ======= =============================================
``kvguard_kv_events_mirror_blocks{state}``     gauge   at the last comparison; ``state`` in
                                                       ``matched`` (mirror and pool), ``stale``
                                                       (mirror only), ``missing`` (pool only)
``kvguard_kv_events_verdict{verdict}``         gauge   1 for the last comparison's verdict, 0 for
                                                       the others
``kvguard_kv_events_batches_received_total``   counter batches applied (SUB and replay)
``kvguard_kv_events_batches_lost_total``       counter batches replay could not give back
``kvguard_kv_events_replays_total``            counter replay requests sent to the engine
``kvguard_kv_events_replays_truncated_total``  counter replay answers that stopped early (no
                                                       end marker, or a hole), each resumed
``kvguard_kv_events_restarts_total``           counter sequence restarts seen (engine restarts)
``kvguard_kv_events_gap_open``                 gauge   1 while lost batches may still matter
=============================================  ======= =============================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvguard.kv_events.verdict import KvEventsVerdict
from kvguard.sidecar.store import EngineStore


def kv_events_families(store: EngineStore, labels: tuple[str, ...]) -> Iterator[Metric]:
    """The families (none when the sidecar watches no KV events); ``labels``: the collector's
    ``ENGINE_LABELS``, whose values each series carries in that order."""
    watch = store.kv_events
    if watch is None:
        return
    eng = list(labels)
    blocks = GaugeMetricFamily("kvguard_kv_events_mirror_blocks",
                               "Blocks of the KV-event mirror by state at the last comparison "
                               "with the pool.", labels=[*eng, "state"])
    verdict = GaugeMetricFamily("kvguard_kv_events_verdict",
                                "1 for the last mirror comparison's verdict.",
                                labels=[*eng, "verdict"])
    received = CounterMetricFamily("kvguard_kv_events_batches_received",
                                   "KV-event batches applied to the mirror.", labels=eng)
    lost = CounterMetricFamily("kvguard_kv_events_batches_lost",
                               "KV-event batches lost (replay could not give them back).",
                               labels=eng)
    replays = CounterMetricFamily("kvguard_kv_events_replays",
                                  "Replay requests sent to the engine's ROUTER endpoint.",
                                  labels=eng)
    truncated = CounterMetricFamily("kvguard_kv_events_replays_truncated",
                                    "Replay answers that stopped early (no end marker, or a "
                                    "hole between batches); each is resumed.", labels=eng)
    restarts = CounterMetricFamily("kvguard_kv_events_restarts",
                                   "KV-event sequence restarts seen (engine restarts).",
                                   labels=eng)
    gap_open = GaugeMetricFamily("kvguard_kv_events_gap_open",
                                 "1 while batches were lost since the mirror last matched the "
                                 "pool, was cleared or restarted.", labels=eng)
    for name, w in sorted(watch.engines.items()):
        view = store.engines.get(name)
        if view is None:
            continue
        s = view.state
        ids = [name, s.model_name or "", str(s.engine_index)]
        sub = w.subscriber
        with sub.lock:
            applied = sub.mirror.batches_applied
            n_lost, n_replays, n_restarts = (sub.lost_batches_total, sub.replays_total,
                                             sub.restarts_total)
            n_truncated = sub.replays_truncated_total
            is_open = sub.gap_open
        received.add_metric(ids, float(applied))
        lost.add_metric(ids, float(n_lost))
        replays.add_metric(ids, float(n_replays))
        truncated.add_metric(ids, float(n_truncated))
        restarts.add_metric(ids, float(n_restarts))
        gap_open.add_metric(ids, 1.0 if is_open else 0.0)
        check = watch.checks.get(name)
        if check is None:
            continue
        for v in KvEventsVerdict:
            verdict.add_metric([*ids, v.value], 1.0 if check.verdict is v else 0.0)
        if check.verdict is not KvEventsVerdict.PENDING:
            blocks.add_metric([*ids, "matched"], float(check.mirror_blocks - check.stale_blocks))
            blocks.add_metric([*ids, "stale"], float(check.stale_blocks))
            blocks.add_metric([*ids, "missing"], float(check.missing_blocks))
    yield from (blocks, verdict, received, lost, replays, truncated, restarts, gap_open)
