"""Prometheus metrics of design.md section 7, built from the store at scrape time.

A custom collector: nothing is kept between scrapes, so the cost of a scrape
depends on the number of engines, never on the number of requests served.
Counters come from the engines' own monotonic counts (they reset when an
engine restarts; Prometheus' ``rate``/``increase`` handle resets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvguard.core.report import CheckpointReport
from kvguard.core.transfers import HazardKind, TransferOutcome
from kvguard.core.trend import TrendVerdict, judged
from kvguard.core.types import Evidence, LeakCause, Verdict
from kvguard.sidecar.kv_events_metrics import kv_events_families
from kvguard.sidecar.offload_metrics import offload_families
from kvguard.sidecar.reclaim_metrics import reclaim_families
from kvguard.sidecar.store import EngineStore
from kvguard.sidecar.wedge_metrics import wedge_families
from kvguard.transport.state import EngineState

METRICS_CONTRACT_VERSION = 2
"""The version of the metric names and labels below (``kvguard_engine_info``'s
``metrics_contract``). 2: every per-engine series carries ``engine_name`` (kvguard's
name for the engine, unique in a fleet: ``<host>-dp<rank>`` by default), ``model_name``
and ``engine`` (the engine's index, as vLLM's own series label it), so that kvguard's
series join vLLM's ``on(model_name, engine)`` plus the scrape's pod labels. In contract
1, ``engine`` held kvguard's name (``dp0``, ``prefill``) and there was no
``model_name``."""

ENGINE_LABELS = ("engine_name", "model_name", "engine")
"""The labels of every per-engine series, in this order."""


class KvguardCollector(Collector):
    def __init__(self, store: EngineStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        eng = list(ENGINE_LABELS)
        up = GaugeMetricFamily("kvguard_engine_up",
                               "1 while the engine's published state is fresh (heartbeat).",
                               labels=eng)
        info = GaugeMetricFamily("kvguard_engine_info", "Engine identity (value is always 1); "
                                 "metrics_contract is the version of these metrics' names "
                                 "and labels.",
                                 labels=[*ENGINE_LABELS, "epoch", "kvguard_version",
                                         "engine_kind", "engine_version", "metrics_contract"])
        cap = GaugeMetricFamily("kvguard_pool_capacity_blocks",
                                "Usable KV blocks in the pool (null block excluded).", labels=eng)
        blocks = GaugeMetricFamily("kvguard_pool_blocks",
                                   "Usable KV blocks by state at the last audit; states sum to "
                                   "capacity.", labels=[*ENGINE_LABELS, "state"])
        sat = GaugeMetricFamily("kvguard_cache_saturation_ratio",
                                "Evictable cached blocks / capacity at the last audit.", labels=eng)
        holding = GaugeMetricFamily("kvguard_finished_requests_holding_blocks",
                                    "Finished requests that still own KV blocks now.", labels=eng)
        leaked = GaugeMetricFamily("kvguard_leaked_blocks",
                                   "Leaked KV blocks by cause at the latest judged checkpoint: "
                                   "drained, or an online audit under load (label evidence).",
                                   labels=[*ENGINE_LABELS, "cause", "evidence"])
        trend = GaugeMetricFamily("kvguard_leak_trend",
                                  "1 when leaked blocks or finished requests holding blocks grew "
                                  "over consecutive drained checkpoints.", labels=eng)
        started = GaugeMetricFamily("kvguard_engine_start_timestamp_seconds",
                                    "Unix time the engine process started (its epoch): the "
                                    "age of an engine no audit has judged yet.", labels=eng)
        last = GaugeMetricFamily("kvguard_last_checkpoint_timestamp_seconds",
                                 "Unix time of the last drained checkpoint.", labels=eng)
        checkpoints = CounterMetricFamily("kvguard_checkpoints",
                                          "Checkpoints taken, by verdict and evidence (drained "
                                          "checkpoints, online audit reports).",
                                          labels=[*ENGINE_LABELS, "verdict", "evidence"])
        sweeps = CounterMetricFamily("kvguard_online_sweeps",
                                     "Online audit sweeps completed (each covers the pool).",
                                     labels=eng)
        online_seconds = CounterMetricFamily("kvguard_online_audit_seconds",
                                             "Time the online audit spent at step boundaries.",
                                             labels=eng)
        sweep_steps = GaugeMetricFamily("kvguard_online_sweep_steps",
                                        "Engine steps the last online sweep took (K).",
                                        labels=eng)
        latency = GaugeMetricFamily("kvguard_online_detection_latency_seconds",
                                    "Worst case from a leak to its online report: three sweeps "
                                    "at the last sweep's pace.", labels=eng)
        last_sweep = GaugeMetricFamily("kvguard_online_last_sweep_timestamp_seconds",
                                       "Unix time the last online sweep ended.", labels=eng)
        events = CounterMetricFamily("kvguard_request_events",
                                     "Request lifecycle and block events seen by the hooks.",
                                     labels=[*ENGINE_LABELS, "event"])
        errors = CounterMetricFamily("kvguard_hook_errors",
                                     "Failures inside kvguard hook code (contained).", labels=eng)
        unaudited = CounterMetricFamily(
            "kvguard_drains_unaudited", "Drained moments not audited then: the checkpoint "
            "pace let them go (audited at a later drain or admission).", labels=eng)
        allocator = GaugeMetricFamily(
            "kvguard_allocator_bytes", "Framework allocator bytes at the last drained "
            "checkpoint; allocated sits inside reserved (never add them).",
            labels=[*ENGINE_LABELS, "kind"])
        device = GaugeMetricFamily(
            "kvguard_device_memory_bytes", "Device memory at the last drained checkpoint: used, "
            "and non_torch = used - torch reserved.", labels=[*ENGINE_LABELS, "kind"])
        swap = GaugeMetricFamily(
            "kvguard_host_swap_used_bytes", "Host swap used at the most recent drained "
            "checkpoint of any engine on this host.")
        latest_swap: tuple[float, int] | None = None
        drain_eta = GaugeMetricFamily("kvguard_drain_eta_seconds",
                                      "Predicted seconds until the engine drains (fluid model); "
                                      "+Inf when arrivals keep up with completions.", labels=eng)
        kv_info = GaugeMetricFamily(
            "kvguard_kv_connector_info", "The engine's KV connector (P/D), value always 1; "
            "kv_engine_id is what a decode engine's kv_transfer_params name.",
            labels=[*ENGINE_LABELS, "connector", "kv_role", "kv_engine_id", "hold_source"])
        kv_pending = GaugeMetricFamily(
            "kvguard_kv_transfers_pending", "Transfers in progress: prefill holds waiting "
            "for their read, decode requests waiting for their KV.", labels=eng)
        kv_outcomes = CounterMetricFamily(
            "kvguard_kv_transfers", "KV transfers ended, by outcome (expired_unread: the "
            "lease lapsed before any read).", labels=[*ENGINE_LABELS, "outcome"])
        kv_hazards = CounterMetricFamily(
            "kvguard_kv_transfer_hazards", "Transfer hazards that are not leaks, by kind "
            "(freed_before_read: a read arrived after the blocks were freed on lease "
            "expiry).", labels=[*ENGINE_LABELS, "kind"])
        cost_steps = CounterMetricFamily(
            "kvguard_cost_sampled_steps", "Engine steps kvguard metered its own time in "
            "(one window of steps per KVGUARD_COST_SAMPLE_EVERY_STEPS).", labels=eng)
        cost_self = CounterMetricFamily(
            "kvguard_cost_self_seconds", "kvguard's own time on the engine thread in the "
            "sampled steps (hooks, audits, publishing; the engine's methods they wrap "
            "excluded). rate() over rate(kvguard_cost_scheduler_seconds_total) is its "
            "share of scheduler time.", labels=eng)
        cost_sched = CounterMetricFamily(
            "kvguard_cost_scheduler_seconds", "The engine's scheduler entry points "
            "(admission, schedule, update_from_output, aborts) in the sampled steps, "
            "kvguard's time included.", labels=eng)
        cost_skipped = CounterMetricFamily(
            "kvguard_cost_windows_skipped", "Metering windows not taken: a wrapper set "
            "over one of kvguard's hooks after it (the meter never replaces one).",
            labels=eng)
        trace_exported = CounterMetricFamily(
            "kvguard_trace_spans_exported", "kvguard's spans (leaks, transfers, hazards) the "
            "OTLP trace backend took; only engines with tracing on.", labels=eng)
        trace_dropped = CounterMetricFamily(
            "kvguard_trace_spans_dropped", "kvguard's spans dropped at the engine thread: the "
            "export queue was full (the engine never waits for export).", labels=eng)
        trace_failed = CounterMetricFamily(
            "kvguard_trace_export_failures", "kvguard's spans whose OTLP export failed "
            "(backend unreachable or refusing).", labels=eng)
        for name, view in sorted(self.store.engines.items()):
            s = view.state
            ids = engine_label_values(name, s)
            if s.tracing is not None:
                tr = s.tracing
                trace_exported.add_metric(ids, float(tr.spans_exported_total))
                trace_dropped.add_metric(ids, float(tr.spans_dropped_total))
                trace_failed.add_metric(ids, float(tr.export_failures_total))
            if s.cost is not None:
                c = s.cost
                cost_steps.add_metric(ids, float(c.sampled_steps_total))
                cost_self.add_metric(ids, c.self_seconds_total)
                cost_sched.add_metric(ids, c.scheduler_seconds_total)
                cost_skipped.add_metric(ids, float(c.windows_skipped_total))
            if s.transfers is not None:
                t = s.transfers
                kv_info.add_metric([*ids, t.connector, t.kv_role or "", t.kv_engine_id or "",
                                    t.hold_source], 1.0)
                kv_pending.add_metric(ids, float(t.pending))
                for outcome in TransferOutcome:
                    if outcome is not TransferOutcome.PENDING:
                        kv_outcomes.add_metric([*ids, outcome.value],
                                               float(t.outcomes_total.get(outcome.value, 0)))
                for kind in HazardKind:
                    kv_hazards.add_metric([*ids, kind.value],
                                          float(t.hazards_total.get(kind.value, 0)))
            if s.drain is not None:
                drain_eta.add_metric(ids, s.drain.eta_seconds)
            up.add_metric(ids, 1.0 if self.store.is_up(view, now) else 0.0)
            started.add_metric(ids, s.started_at)
            info.add_metric([*ids, s.epoch, s.kvguard_version, s.engine_kind,
                             s.engine_version or "", str(METRICS_CONTRACT_VERSION)], 1.0)
            holding.add_metric(ids, float(s.finished_requests_holding_blocks))
            if s.pool is not None:
                p = s.pool
                cap.add_metric(ids, float(p.capacity))
                for state, n in p.by_state().items():
                    blocks.add_metric([*ids, state.value], float(n))
                sat.add_metric(ids, p.saturation_ratio)
            # The newest report of each kind, searched from the end (a scrape reads each
            # engine's history, 256 reports: a full scan of every one was most of the
            # collector's time).
            history = view.history
            r = next((r for r in reversed(history) if r.epoch == s.epoch and judged(r)), None)
            if r is not None:
                for cause in LeakCause:
                    leaked.add_metric([*ids, cause.value, r.evidence.value],
                                      float(r.leaked_blocks_by_cause.get(cause, 0)))
            r = next((r for r in reversed(history)
                      if r.drained and r.epoch == s.epoch and r.evidence is Evidence.DRAINED),
                     None)
            if r is not None:
                last.add_metric(ids, r.taken_at)
                _memory_samples(ids, r, allocator, device)
                if r.host is not None and r.host.swap_used_bytes is not None and (
                        latest_swap is None or r.taken_at > latest_swap[0]):
                    latest_swap = (r.taken_at, r.host.swap_used_bytes)
            trend.add_metric(ids, 1.0 if view.trend.verdict is TrendVerdict.LEAK_GROWING
                             else 0.0)
            for verdict in Verdict:
                total = s.checkpoints_total.get(verdict.value, 0)
                online = s.online_checkpoints_total.get(verdict.value, 0)
                checkpoints.add_metric([*ids, verdict.value, Evidence.DRAINED.value],
                                       float(total - online))
                if verdict is not Verdict.SKIPPED:
                    checkpoints.add_metric([*ids, verdict.value, Evidence.ONLINE.value],
                                           float(online))
            if s.online is not None:
                o = s.online
                sweeps.add_metric(ids, float(o.sweeps_total))
                online_seconds.add_metric(ids, o.audit_seconds_total)
                if o.sweeps_total:
                    sweep_steps.add_metric(ids, float(o.last_sweep_steps))
                    latency.add_metric(ids, o.detection_latency_seconds)
                if o.last_sweep_at is not None:
                    last_sweep.add_metric(ids, o.last_sweep_at)
            for event, n in sorted(s.events_total.items()):
                events.add_metric([*ids, event], float(n))
            errors.add_metric(ids, float(s.hook_errors_total))
            unaudited.add_metric(ids, float(s.drains_unaudited_total))
        read_errors = CounterMetricFamily("kvguard_sidecar_read_errors",
                                          "Engine state files the sidecar could not read.")
        read_errors.add_metric([], float(self.store.num_read_errors))
        if latest_swap is not None:
            swap.add_metric([], float(latest_swap[1]))
        yield from (up, started, info, cap, blocks, sat, holding, leaked, trend, last, checkpoints,
                    events, errors, unaudited, read_errors, drain_eta, allocator, device, swap,
                    sweeps, online_seconds, sweep_steps, latency, last_sweep, kv_info,
                    kv_pending, kv_outcomes, kv_hazards, cost_steps, cost_self, cost_sched,
                    cost_skipped, trace_exported, trace_dropped, trace_failed)
        yield from kv_events_families(self.store, ENGINE_LABELS)
        yield from offload_families(self.store, ENGINE_LABELS)
        yield from wedge_families(self.store, ENGINE_LABELS)
        yield from reclaim_families(self.store, ENGINE_LABELS)


def engine_label_values(name: str, state: EngineState) -> list[str]:
    """The values of ``ENGINE_LABELS`` for one engine, in that order."""
    return [name, state.model_name or "", str(state.engine_index)]


def _memory_samples(ids: list[str], r: CheckpointReport, allocator: GaugeMetricFamily,
                    device: GaugeMetricFamily) -> None:
    """``kvguard_allocator_bytes`` and ``kvguard_device_memory_bytes`` from one report."""
    a = r.allocator
    if a is not None:
        kinds = {"allocated": a.allocated_bytes, "reserved": a.reserved_bytes,
                 "reserved_unallocated": a.reserved_unallocated_bytes,
                 "inactive_split": a.inactive_split_bytes}
        for kind, value in kinds.items():
            if value is not None:
                allocator.add_metric([*ids, kind], float(value))
    d = r.device
    if d is not None:
        for kind, value in (("used", d.used_bytes), ("non_torch", d.non_torch_bytes)):
            if value is not None:
                device.add_metric([*ids, kind], float(value))
