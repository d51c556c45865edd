"""The sidecar's text exposition is prometheus_client's ``generate_latest``, byte for byte.

Ground truth is the library's own writer, run on the same families: the sidecar's real
collector over engine states, and families built to reach every branch (escaped label
values, special floats, the types and samples the fast path hands to the library).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from factories import report, state, write
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvguard.sidecar.app import create_app
from kvguard.sidecar.exposition import TextExposition
from kvguard.sidecar.metrics import KvguardCollector
from kvguard.sidecar.store import EngineStore


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self.families)


def _library(families: list[Metric]) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Fixed(families))
    return generate_latest(reg)


def _engines(run_dir: Path, n: int) -> EngineStore:
    for e in range(n):
        s = state([report(i, engine=f"dp{e}", holding=(i + e) % 3) for i in range(1, 9)],
                  engine=f"dp{e}", hook_errors=e)
        write(run_dir, s.model_copy(update={"live_requests": 7 * e,
                                            "events_total": {"admit": 10**e, "free": 3}}))
    store = EngineStore(run_dir)
    store.refresh()
    return store


def test_the_collectors_families_are_written_as_the_library_writes_them(
        tmp_path: Path) -> None:
    store = _engines(tmp_path, 3)
    families = list(KvguardCollector(store).collect())
    assert sum(len(f.samples) for f in families) > 50  # a real exposition, not an empty one
    ours = TextExposition()
    assert ours.render(families) == _library(families)
    assert ours.render(families) == _library(families)  # with its names remembered


def test_get_metrics_serves_the_librarys_bytes(tmp_path: Path) -> None:
    store = _engines(tmp_path, 2)
    with TestClient(create_app(store, poll_interval_seconds=60)) as c:
        got = c.get("/metrics")
    assert got.status_code == 200
    assert got.headers["content-type"] == CONTENT_TYPE_LATEST
    assert got.content == _library(list(KvguardCollector(store).collect()))


def test_label_values_documentation_and_values_are_escaped_like_the_library() -> None:
    g = GaugeMetricFamily("kvguard_x", 'help with \\ a backslash\nand a "newline"',
                          labels=["engine", "b", "a"])
    values = ['back\\slash', 'new\nline', 'quo"te', 'all \\ " \n', 'ünïcødé ✓', '', 'plain']
    for i, v in enumerate(values):
        g.add_metric([v, str(i), "z"], float(i))
    special = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e21, 1.5e-7, 123456789.0,
               2.0**53 + 1, -3.25, 1e300]
    c = CounterMetricFamily("kvguard_y", "a counter", labels=["engine"])
    for i, v in enumerate(special):
        c.add_metric([f"e{i}"], v)
    bare = GaugeMetricFamily("kvguard_bare", "no labels", value=42.0)
    empty = CounterMetricFamily("kvguard_empty", "no samples")
    families: list[Metric] = [g, c, bare, empty]
    assert TextExposition().render(families) == _library(families)


def test_families_the_fast_path_does_not_cover_are_the_librarys_own_in_place() -> None:
    before = GaugeMetricFamily("kvguard_before", "first", value=1.0)
    hist = HistogramMetricFamily("kvguard_h", "a histogram", labels=["engine"])
    hist.add_metric(["dp0"], [("0.5", 1.0), ("+Inf", 3.0)], sum_value=2.5)
    info = InfoMetricFamily("kvguard_i", "an info", value={"version": "1"})
    created = CounterMetricFamily("kvguard_c", "with created", value=4.0, created=1700.0)
    stamped = GaugeMetricFamily("kvguard_t", "with a timestamp", labels=["engine"])
    stamped.add_metric(["dp0"], 1.0, timestamp=1700.5)
    utf8 = GaugeMetricFamily("kvguard.dotted", "a UTF-8 metric name", value=2.0)
    odd_label = GaugeMetricFamily("kvguard_l", "a UTF-8 label name", labels=["eng.ine"])
    odd_label.add_metric(["dp0"], 1.0)
    after = CounterMetricFamily("kvguard_after", "last", value=9.0)
    families: list[Metric] = [before, hist, info, created, stamped, utf8, odd_label, after]
    text = TextExposition().render(families)
    assert text == _library(families)
    lines = text.decode().splitlines()
    assert lines[0] == "# HELP kvguard_before first"
    assert lines[-1] == "kvguard_after_total 9.0"  # the order of the families is kept
