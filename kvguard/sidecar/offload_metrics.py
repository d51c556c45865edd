"""``kvguard_offload_*``: the offload audit as Prometheus series (engines with an
offloading KV connector only).

Every series carries ``ENGINE_LABELS`` (``engine_name``, ``model_name``, ``engine``); no
per-request or per-job label (stuck jobs and waiting requests are named in
``/v1/report``'s engine state only).

============================================  ======= ==============================================
name                                          type    meaning
============================================  ======= ==============================================
``kvguard_offload_tier_chunks{state}``        gauge   the offload tier's chunks; ``state`` in
                                                      ``ready`` (stored, loadable, no load reading
                                                      it), ``read_pinned`` (a load in flight reads
                                                      it), ``write_pending`` (a store in flight
                                                      writes it), ``free``; they sum to capacity
``kvguard_offload_jobs_in_flight{kind}``      gauge   jobs the workers have not reported done;
                                                      ``kind`` in ``store``, ``load``
``kvguard_offload_oldest_job_age_seconds``    gauge   age of the oldest job in flight (0: none)
``kvguard_offload_stuck_jobs``                gauge   jobs in flight past the bound now
``kvguard_offload_jobs_stuck_total``          counter distinct jobs ever found stuck
``kvguard_offload_waiting_requests``          gauge   requests the connector keeps waiting for
                                                      chunks still being written
``kvguard_offload_verdict{verdict}``          gauge   1 for the offload audit's verdict
                                                      (``ok``, ``stuck``, ``tier_mismatch``), 0
                                                      for the others
============================================  ======= ==============================================

vLLM's own series beside them: ``vllm:kv_offload_store_bytes``/``_load_bytes`` (bytes
moved), ``vllm:kv_offload_cpu_cache_usage_perc`` (and its ``_write_``/``_read_`` parts),
``vllm:external_prefix_cache_hits`` (tokens loaded back), ``vllm:kv_offload_allocation_failure``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvguard.core.offload import JobKind, OffloadVerdict
from kvguard.sidecar.store import EngineStore


def offload_families(store: EngineStore, labels: tuple[str, ...]) -> Iterator[Metric]:
    """The families, with a series per engine whose state has an offload audit (no family
    at all when no engine has one)."""
    engines = [(name, view.state) for name, view in sorted(store.engines.items())
               if view.state.offload is not None]
    if not engines:
        return
    eng = list(labels)
    tier = GaugeMetricFamily("kvguard_offload_tier_chunks",
                             "The offload tier's chunks by state (sum: capacity).",
                             labels=[*eng, "state"])
    jobs = GaugeMetricFamily("kvguard_offload_jobs_in_flight",
                             "Offload jobs in flight by kind.", labels=[*eng, "kind"])
    oldest = GaugeMetricFamily("kvguard_offload_oldest_job_age_seconds",
                               "Age of the oldest offload job in flight, s.", labels=eng)
    stuck = GaugeMetricFamily("kvguard_offload_stuck_jobs",
                              "Offload jobs in flight past kvguard's bound.", labels=eng)
    stuck_total = CounterMetricFamily("kvguard_offload_jobs_stuck",
                                      "Distinct offload jobs ever found stuck.", labels=eng)
    waiting = GaugeMetricFamily("kvguard_offload_waiting_requests",
                                "Requests waiting for offload chunks still being written.",
                                labels=eng)
    verdict = GaugeMetricFamily("kvguard_offload_verdict",
                                "1 for the offload audit's current verdict.",
                                labels=[*eng, "verdict"])
    for name, s in engines:
        o = s.offload
        assert o is not None
        ids = [name, s.model_name or "", str(s.engine_index)]
        if o.tier is not None:
            t = o.tier
            for state, value in (("ready", t.ready - t.read_pinned),
                                 ("read_pinned", t.read_pinned),
                                 ("write_pending", t.write_pending), ("free", t.free)):
                tier.add_metric([*ids, state], float(value))
        for kind in JobKind:
            jobs.add_metric([*ids, kind.value], float(o.jobs_in_flight.get(kind.value, 0)))
        oldest.add_metric(ids, o.oldest_job_age_seconds)
        stuck.add_metric(ids, float(o.stuck_jobs))
        stuck_total.add_metric(ids, float(o.stuck_jobs_total))
        waiting.add_metric(ids, float(o.waiting_requests))
        for v in OffloadVerdict:
            verdict.add_metric([*ids, v.value], 1.0 if o.verdict is v else 0.0)
    yield from (tier, jobs, oldest, stuck, stuck_total, waiting, verdict)
