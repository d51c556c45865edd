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


READ_IN_PLACE = ("kv_transfers", "offload_reader", "worker_half", "idle", "adapter",
                 "waiting_reader", "connector_bounds", "finish", "trace_setup",
                 "pool_reader", "kv_event_tap", "hooks")
"""The plugin modules that read vLLM's scheduler, pool, connector and engine objects in
place."""
NOT_VLLMS = {
    "reports": "kvguard's own worker metadata (KvguardWorkerMeta.reports)",
    "get_new_notifs": "NIXL's agent, not vLLM",
    "name": "Enum.name (of vLLM's KVConnectorRole, compared with the KV_ROLE_WORKER row)",
    "_kvguard_worker_half": "kvguard's mark on a connector",
    "faults_enabled": "kvguard's fault-injecting scheduler (kvguard.chaos), not vLLM",
    "_kvguard": "kvguard's guard, set on the scheduler by attach",
}


def _names_read_in_place(module: str) -> tuple[set[str], set[str]]:
    """(string names given to getattr/hasattr/setattr, private attributes read off objects
    other than ``self``) in the source of ``kvguard.vllm_plugin.<module>``."""
    import ast

    path = Path(hooks.__file__).with_name(f"{module}.py")
    literal: set[str] = set()
    private: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in {"getattr", "hasattr", "setattr"} and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value,
                                                                          str):
            literal.add(node.args[1].value)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}):
            private.add(node.attr)
    return literal, private


def test_the_plugin_reads_vllms_connector_and_engine_fields_only_through_the_version_layer(
) -> None:
    """No vLLM name is spelt in place in these modules: each is a row (read with
    ``versions.read``), so a release that moves one is handled in the version layer only."""
    rows = {tp.name for tp in TOUCH_POINTS}
    for module in READ_IN_PLACE:
        literal, private = _names_read_in_place(module)
        assert literal - NOT_VLLMS.keys() == set(), (module, "getattr of a vLLM name by "
                                                     "string: make it a row and use read()")
        assert private - rows - NOT_VLLMS.keys() == set(), (module, "a private vLLM "
                                                            "attribute read in place")
