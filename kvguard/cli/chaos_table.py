"""The chaos matrix's results as plain text (``kvguard chaos``, embedded or ``--url``).

Apart from the matrix runner (which imports vLLM) so that ``kvguard chaos --url`` runs from
an install without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvguard.chaos.result import ScenarioResult, Status, mode_disagreements


def render_table(results: Sequence[ScenarioResult]) -> str:
    """The chaos matrix's results as a table, each result's why, then a summary line."""
    rows = [("SCENARIO", "MODE", "INJECTED", "EXPECTED", "KVGUARD CONCLUDED", "RESULT")]
    for r in results:
        mark = {Status.PASSED: "ok", Status.FAILED: "WRONG", Status.ERROR: "ERROR",
                Status.UNSUPPORTED: "unsupported"}[r.status]
        rows.append((r.name, r.scheduling.value, r.injected, r.expected, r.concluded or "-",
                     mark))
    widths = [min(48, max(len(row[i]) for row in rows)) for i in range(len(rows[0]))]
    lines = ["  ".join(cell[:w].ljust(w) for cell, w in zip(row, widths, strict=True))
             for row in rows]
    for r in results:
        if r.why:
            lines.append(f"  {r.name} [{r.scheduling.value}]: {r.why}")
    passed = sum(r.status is Status.PASSED for r in results)
    unsupported = sum(r.status is Status.UNSUPPORTED for r in results)
    lines.append(f"{passed} passed, {len(results) - passed - unsupported} failed"
                 + (f", {unsupported} unsupported on this build" if unsupported else ""))
    differ = mode_disagreements(list(results))
    if differ:
        lines.append("sync and async verdicts differ: " + "; ".join(differ))
    return "\n".join(lines)
