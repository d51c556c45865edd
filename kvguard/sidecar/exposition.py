"""The Prometheus text format of the sidecar's metric families, byte for byte
``prometheus_client.generate_latest``'s, at a fraction of its cost.

``generate_latest`` (prometheus_client 0.26) validates and escapes every metric and label
name again on every sample: 13 us per sample, 5.8 of the 7.6 ms that the collector's 441
samples for 8 engines take (measured in one process on 2026-12-03). kvguard's names are
fixed where its families are defined, so here each name is checked once and remembered,
and per sample only the label values are escaped (backslash, newline and double quote,
as the library does) and the value is formatted by the library's own
``floatToGoString``. A family this writer does not cover (a type other than gauge or
counter, a sample with a timestamp or exemplar, a sample named other than the family's
own name, e.g. ``_created``, or a name the legacy character set does not admit, which
the library escapes) is written by ``generate_latest`` itself, so the output is always
what the library would write. ``tests/sidecar/test_exposition.py`` compares the two
byte for byte.

Kept for benchmark target 3 (GET /metrics < 10 ms, 8 engines): measured again on
2026-12-06 on ``bench/bench_scrape.py``'s 441 samples, ``generate_latest`` took 2.6 ms
at best and 5.7 ms as median on this shared 2-core VM, this writer 0.8 ms.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Final, cast

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_go: Final = cast(Callable[[float], str], floatToGoString)
"""The library's own float formatting (Go's: ``+Inf``, ``NaN``, exponents from 1e7)."""
_METRIC_NAME: Final = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RESERVED_LABEL: Final = re.compile(r"^__")
_SUFFIX: Final = {"gauge": "", "counter": "_total"}
"""The family types written here, and the one sample name each has (family name + this)."""


class _One(Collector):
    """One family, for ``generate_latest`` (which takes any collector)."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return (self.metric,)


class TextExposition:
    """Writes families in the text format; keeps only what it learnt about names (bounded by
    the number of distinct metric and label names: kvguard's fixed set)."""

    def __init__(self) -> None:
        self._names: dict[str, bool] = {}
        """Metric name -> whether it is written as is (legacy character set)."""
        self._orders: dict[tuple[str, ...], tuple[str, ...] | None] = {}
        """A sample's label names, in its order -> them sorted, or None when one is not
        written as is."""

    def _plain_metric(self, name: str) -> bool:
        ok = self._names.get(name)
        if ok is None:
            ok = self._names[name] = bool(name) and _METRIC_NAME.match(name) is not None
        return ok

    def _label_order(self, keys: tuple[str, ...]) -> tuple[str, ...] | None:
        """The label names ``keys`` sorted (the library's order), or None when one of them
        is not written as is."""
        if keys in self._orders:
            return self._orders[keys]
        ok = all(k and _LABEL_NAME.match(k) is not None and _RESERVED_LABEL.match(k) is None
                 for k in keys)
        order = self._orders[keys] = tuple(sorted(keys)) if ok else None
        return order

    def render(self, families: Iterable[Metric]) -> bytes:
        """The text format of ``families``, UTF-8: what ``generate_latest`` writes for a
        collector yielding them, in their order."""
        out: list[str] = []
        for metric in families:
            if not self._family(metric, out):
                out.append(generate_latest(_One(metric)).decode("utf-8"))
        return "".join(out).encode("utf-8")

    def _family(self, metric: Metric, out: list[str]) -> bool:
        """Append ``metric``'s lines to ``out`` and say True, or append nothing and say
        False when this writer does not cover it."""
        suffix = _SUFFIX.get(metric.type)
        if suffix is None:
            return False
        name = metric.name + suffix
        if not self._plain_metric(name):
            return False
        label_order = self._label_order
        lines: list[str] = []
        for s in metric.samples:
            if s.name != name or s.timestamp is not None or s.exemplar is not None:
                return False
            labels = s.labels
            if labels:
                order = label_order(tuple(labels))
                if order is None:
                    return False
                parts = []
                for k in order:
                    v = labels[k]
                    if "\\" in v or "\n" in v or '"' in v:
                        v = v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
                    parts.append(f'{k}="{v}"')
                lines.append(f"{name}{{{','.join(parts)}}} {_go(s.value)}\n")
            else:
                lines.append(f"{name} {_go(s.value)}\n")
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        out.extend(lines)
        return True
