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
from kvguard.core.trend import TrendVerdict
from kvguard.core.types import BlockState, LeakCause, Verdict
from kvguard.sidecar.store import EngineStore


class KvguardCollector(Collector):
    def __init__(self, store: EngineStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        eng = ["engine"]
        up = GaugeMetricFamily("kvguard_engine_up",
                               "1 while the engine's published state is fresh (heartbeat).",
                               labels=eng)
        info = GaugeMetricFamily("kvguard_engine_info", "Engine identity (value is always 1).",
                                 labels=["engine", "epoch", "kvguard_version", "vllm_version"])
        cap = GaugeMetricFamily("kvguard_pool_capacity_blocks",
                                "Usable KV blocks in the pool (null block excluded).", labels=eng)
        blocks = GaugeMetricFamily("kvguard_pool_blocks",
                                   "Usable KV blocks by state at the last audit; states sum to "
                                   "capacity.", labels=["engine", "state"])
        sat = GaugeMetricFamily("kvguard_cache_saturation_ratio",
                                "Evictable cached blocks / capacity at the last audit.", labels=eng)
        holding = GaugeMetricFamily("kvguard_finished_requests_holding_blocks",
                                    "Finished requests that still own KV blocks now.", labels=eng)
        leaked = GaugeMetricFamily("kvguard_leaked_blocks",
                                   "Leaked KV blocks at the last drained checkpoint, by cause.",
                                   labels=["engine", "cause"])
        trend = GaugeMetricFamily("kvguard_leak_trend",
                                  "1 when leaked blocks or finished requests holding blocks grew "
                                  "over consecutive drained checkpoints.", labels=eng)
        last = GaugeMetricFamily("kvguard_last_checkpoint_timestamp_seconds",
                                 "Unix time of the last drained checkpoint.", labels=eng)
        checkpoints = CounterMetricFamily("kvguard_checkpoints",
                                          "Checkpoints taken, by verdict.",
                                          labels=["engine", "verdict"])
        events = CounterMetricFamily("kvguard_request_events",
                                     "Request lifecycle and block events seen by the hooks.",
                                     labels=["engine", "event"])
        errors = CounterMetricFamily("kvguard_hook_errors",
                                     "Failures inside kvguard hook code (contained).", labels=eng)
        allocator = GaugeMetricFamily(
            "kvguard_allocator_bytes", "Framework allocator bytes at the last drained "
            "checkpoint; allocated sits inside reserved (never add them).",
            labels=["engine", "kind"])
        device = GaugeMetricFamily(
            "kvguard_device_memory_bytes", "Device memory at the last drained checkpoint: used, "
            "and non_torch = used - torch reserved.", labels=["engine", "kind"])
        swap = GaugeMetricFamily(
            "kvguard_host_swap_used_bytes", "Host swap used at the most recent drained "
            "checkpoint of any engine on this host.")
        latest_swap: tuple[float, int] | None = None
        drain_eta = GaugeMetricFamily("kvguard_drain_eta_seconds",
                                      "Predicted seconds until the engine drains (fluid model); "
                                      "+Inf when arrivals keep up with completions.", labels=eng)
        for name, view in sorted(self.store.engines.items()):
            s = view.state
            if s.drain is not None:
                drain_eta.add_metric([name], s.drain.eta_seconds)
            up.add_metric([name], 1.0 if self.store.is_up(view, now) else 0.0)
            info.add_metric([name, s.epoch, s.kvguard_version, s.vllm_version or ""], 1.0)
            holding.add_metric([name], float(s.finished_requests_holding_blocks))
            if s.pool is not None:
                p = s.pool
                cap.add_metric([name], float(p.capacity))
                counts = {BlockState.FREE: p.free, BlockState.CACHED: p.cached,
                          BlockState.ACTIVE: p.active,
                          BlockState.HELD_BY_FINISHED: p.held_by_finished,
                          BlockState.ORPHANED: p.orphaned}
                for state, n in counts.items():
                    blocks.add_metric([name, state.value], float(n))
                sat.add_metric([name], p.cached / p.capacity if p.capacity else 0.0)
            drained = [r for r in view.history if r.drained and r.epoch == s.epoch]
            if drained:
                r = drained[-1]
                for cause in LeakCause:
                    leaked.add_metric([name, cause.value],
                                      float(r.leaked_blocks_by_cause.get(cause, 0)))
                last.add_metric([name], r.taken_at)
                _memory_samples(name, r, allocator, device)
                if r.host is not None and r.host.swap_used_bytes is not None and (
                        latest_swap is None or r.taken_at > latest_swap[0]):
                    latest_swap = (r.taken_at, r.host.swap_used_bytes)
            trend.add_metric([name], 1.0 if view.trend.verdict is TrendVerdict.LEAK_GROWING
                             else 0.0)
            for verdict in Verdict:
                checkpoints.add_metric([name, verdict.value],
                                       float(s.checkpoints_total.get(verdict.value, 0)))
            for event, n in sorted(s.events_total.items()):
                events.add_metric([name, event], float(n))
            errors.add_metric([name], float(s.hook_errors_total))
        read_errors = CounterMetricFamily("kvguard_sidecar_read_errors",
                                          "Engine state files the sidecar could not read.")
        read_errors.add_metric([], float(self.store.num_read_errors))
        if latest_swap is not None:
            swap.add_metric([], float(latest_swap[1]))
        yield from (up, info, cap, blocks, sat, holding, leaked, trend, last, checkpoints,
                    events, errors, read_errors, drain_eta, allocator, device, swap)


def _memory_samples(name: str, r: CheckpointReport, allocator: GaugeMetricFamily,
                    device: GaugeMetricFamily) -> None:
    """``kvguard_allocator_bytes`` and ``kvguard_device_memory_bytes`` from one report."""
    a = r.allocator
    if a is not None:
        kinds = {"allocated": a.allocated_bytes, "reserved": a.reserved_bytes,
                 "reserved_unallocated": a.reserved_unallocated_bytes,
                 "inactive_split": a.inactive_split_bytes}
        for kind, value in kinds.items():
            if value is not None:
                allocator.add_metric([name, kind], float(value))
    d = r.device
    if d is not None:
        for kind, value in (("used", d.used_bytes), ("non_torch", d.non_torch_bytes)):
            if value is not None:
                device.add_metric([name, kind], float(value))
