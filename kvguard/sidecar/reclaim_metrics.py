"""``kvguard_reclaimed_blocks_total`` and ``kvguard_reclaims_refused_total``: the opt-in
reclaim (``KVGUARD_RECLAIM``) as Prometheus series.

Every series carries ``ENGINE_LABELS`` and one label of its own; no per-request label (the
reclaimed requests and their block ids are in ``/v1/report``'s engine state, field
``reclaim``). The families appear only when some engine's state has reclaim on; each
known cause and reason is exported from 0, so that ``increase()`` sees the first one.

========================================  ======= ===========================================
name                                      type    meaning
========================================  ======= ===========================================
``kvguard_reclaimed_blocks_total``        counter blocks freed through the engine's own free
                                                  path, by ``cause`` (the dead owner's kind)
``kvguard_reclaims_refused_total``        counter reclaims refused, by ``reason``
                                                  (:class:`~kvguard.core.reclaim.RefusalReason`)
========================================  ======= ===========================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from kvguard.core.reclaim import RefusalReason
from kvguard.core.wedge import DeadOwnerKind
from kvguard.sidecar.store import EngineStore

RECLAIMABLE_CAUSES = (DeadOwnerKind.FINISHED_REQUEST.value, DeadOwnerKind.DELAYED_FREE.value)
"""The dead-owner kinds reclaim can free (orphans, drift and offload jobs are refused)."""


def reclaim_families(store: EngineStore, labels: tuple[str, ...]) -> Iterator[Metric]:
    engines = [(name, view.state, view.state.reclaim)
               for name, view in sorted(store.engines.items())]
    if not any(r is not None for _, _, r in engines):
        return
    blocks = CounterMetricFamily("kvguard_reclaimed_blocks", "Blocks of dead owners freed "
                                 "through the engine's own free path (KVGUARD_RECLAIM; "
                                 "docs/wedge.md).", labels=[*labels, "cause"])
    refused = CounterMetricFamily("kvguard_reclaims_refused", "Reclaims refused as unsafe "
                                  "or impossible (docs/wedge.md).", labels=[*labels, "reason"])
    for name, s, r in engines:
        if r is None:
            continue
        ids = [name, s.model_name or "", str(s.engine_index)]
        for cause in sorted({*RECLAIMABLE_CAUSES, *r.reclaimed_blocks_total}):
            blocks.add_metric([*ids, cause], float(r.reclaimed_blocks_total.get(cause, 0)))
        for reason in sorted({*(x.value for x in RefusalReason), *r.refused_total}):
            refused.add_metric([*ids, reason], float(r.refused_total.get(reason, 0)))
    yield from (blocks, refused)
