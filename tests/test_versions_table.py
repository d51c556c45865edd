"""The docs' versions table is the version layer's: rendered from it, so it cannot drift.

``kvguard.vllm_plugin.versions`` is the one place that knows what kvguard touches in each
vLLM release (tests/scheduler/test_versions.py checks it against each installed vLLM);
the operator guide shows :func:`versions_table` verbatim between its markers.
"""

from __future__ import annotations

from pathlib import Path

from kvguard.vllm_plugin import hooks
from kvguard.vllm_plugin.versions import TOUCH_POINTS, feature_of, versions_table

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operator-guide.md"
BEGIN = "<!-- versions-table: rendered by kvguard.vllm_plugin.versions.versions_table() -->\n"
END = "<!-- /versions-table -->"


def test_the_operator_guides_versions_table_is_the_version_layers() -> None:
    text = GUIDE.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "markers missing in the guide"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert shown == versions_table(), (
        "docs/operator-guide.md's versions table differs from kvguard/vllm_plugin/"
        "versions.py: paste versions_table()'s output between the markers")


def test_every_method_kvguard_hooks_is_a_row_with_a_feature() -> None:
    hooked = {*hooks.POOL_HOOKS, *hooks.SCHEDULER_HOOKS, *hooks.CONNECTOR_HOOKS,
              *hooks.COORDINATOR_HOOKS}
    rows = {tp.name for tp in TOUCH_POINTS if tp.kind == "method" and not tp.source}
    assert rows == hooked
    assert all(feature_of(f"AnySubclass.{m}") is not None for m in hooked)
