"""``kvguard_engine_wedged`` and its companions: the wedge verdict as Prometheus series.

Every series carries ``ENGINE_LABELS``; no per-request label (the dead owners are named
in ``/v1/report``'s engine state and in ``/v1/ready``'s reason only). A family appears
only when some engine's state has a wedge monitor.

=====================================  ======= ============================================
name                                   type    meaning
=====================================  ======= ============================================
``kvguard_engine_wedged``              gauge   1 while the engine is wedged, else 0
``kvguard_wedge_verdicts_total``       counter wedges named since the engine started
``kvguard_wedge_dead_blocks``          gauge   blocks dead owners held at the last
                                               judgment (0 when nothing waited long)
=====================================  ======= ============================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvguard.sidecar.store import EngineStore


def wedge_families(store: EngineStore, labels: tuple[str, ...]) -> Iterator[Metric]:
    engines = [(name, view.state, view.state.wedge)
               for name, view in sorted(store.engines.items())]
    engines = [e for e in engines if e[2] is not None]
    if not engines:
        return
    eng = list(labels)
    wedged = GaugeMetricFamily("kvguard_engine_wedged", "1 while requests wait behind "
                               "blocks that dead owners hold (docs/wedge.md).", labels=eng)
    total = CounterMetricFamily("kvguard_wedge_verdicts", "Wedges named.", labels=eng)
    dead = GaugeMetricFamily("kvguard_wedge_dead_blocks", "Blocks held by dead owners at "
                             "the last wedge judgment.", labels=eng)
    for name, s, w in engines:
        if w is None:
            continue
        ids = [name, s.model_name or "", str(s.engine_index)]
        wedged.add_metric(ids, 1.0 if w.wedged else 0.0)
        total.add_metric(ids, float(w.verdicts_total))
        dead.add_metric(ids, float(w.last.dead_blocks if w.last is not None else 0))
    yield from (wedged, total, dead)
