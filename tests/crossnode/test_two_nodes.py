"""A P/D pair on two nodes: the cross-engine verdicts without a shared file.

Two network namespaces joined by a veth pair (``_netns``) stand for two hosts. The
prefill node runs a real vLLM server (``kv_producer``, NixlConnector) with kvguard and a
kvguard sidecar over its own run dir; the decode node the same as ``kv_consumer``, plus
the P/D proxy, a real Prometheus scraping both nodes' sidecars and vLLM servers, and a
real trace store (Arize Phoenix, ``tests/tracing/_phoenix.py``) that both servers export
their spans to over OTLP/HTTP (``--otlp-traces-endpoint``), vLLM's and kvguard's. The
servers are started the way vLLM starts them (the stock multiprocess executor: NIXL's
worker side in a ``Worker`` process). NIXL reads the KV across the veth (``UCX_TLS=tcp``,
the node's device). Nothing is shared but the link: each node has its own run dir, and
the verdicts that need both engines are joined over the sidecars' HTTP APIs
(``kvguard report --transfers --sidecar URL --sidecar URL``, run on the decode node) and
in the request's own trace, where each engine's spans land under the caller's
``traceparent`` (forwarded by the proxy, or sent with each half).

Ground truth is vLLM's own: each server's blocks in use (``vllm:kv_cache_usage_perc``
times its capacity), request gauges, NIXL's counters and log lines, and the kernel's
byte counters on the link.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _netns import Node, TwoNodes, entered, link_bytes, two_nodes
from _nodes import (
    PROXY_PORT,
    SIDECAR_PORT,
    NodeProcess,
    get,
    get_json,
    kvguard_cli,
    post_json,
    prometheus,
    promql,
    proxy,
    sidecar,
    start_servers,
    until,
)
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tracing"))
from _phoenix import Phoenix, phoenix_server

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.core.state import EngineState
from kvguard.testing.engine import ServerProcess
from kvguard.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(900)

PROMPT_WORDS = 150
"""A prompt of 5 blocks (32 tokens each) with the tiny model's tokenizer."""
EXPIRED_LINE = "Releasing expired KV blocks for request"
LATE_LINE = "Potentially invalid KV blocks for unrecognized request"
PHOENIX_PORT = 6006
PHOENIX_GRPC_PORT = 4317
VLLM_SPAN = "llm_request"
"""vLLM's own span per request (vllm/tracing), the trace's ground truth that the
caller's context reached that engine."""


@dataclass
class Cluster:
    nodes: TwoNodes
    servers: dict[str, ServerProcess]
    sidecars: dict[str, NodeProcess]
    proxy: NodeProcess
    prometheus: NodeProcess
    phoenix: Phoenix
    work: Path

    def node(self, engine: str) -> Node:
        return self.nodes.prefill if engine == "prefill" else self.nodes.decode

    def sidecar_url(self, engine: str) -> str:
        return f"http://{self.node(engine).address}:{SIDECAR_PORT}"

    def body(self, tag: str, max_tokens: int = 8) -> dict[str, Any]:
        return {"model": self.servers["prefill"].spec.served_model_name,
                "prompt": f"{tag} " + " ".join(f"w{i}" for i in range(PROMPT_WORDS)),
                "max_tokens": max_tokens, "temperature": 0.0}

    def vllm(self, engine: str, name: str) -> float:
        """A vLLM series of ``engine``'s server, summed over its labels, read on its node."""
        text = get(self.node(engine), self.servers[engine].base_url + "/metrics").decode()
        return float(sum(s.value for fam in text_string_to_metric_families(text)
                         for s in fam.samples if s.name in (name, name + "_total")))

    def blocks_in_use(self, engine: str) -> int:
        usable: int = self.servers[engine].spec.num_gpu_blocks_override - 1
        return round(self.vllm(engine, "vllm:kv_cache_usage_perc") * usable)

    def logged(self, engine: str, line: str) -> set[str]:
        text = self.servers[engine].log_path.read_text(errors="replace")
        return set(re.findall(re.escape(line) + r" (\S+?)(?: which| were|$)", text, re.M))

    def prefill_only(self, tag: str, rid: str,
                     headers: dict[str, str]) -> dict[str, Any]:
        from pd_proxy import REMOTE_DECODE_PARAMS  # tests/pd, on the path from _nodes

        body = {**self.body(tag), "max_tokens": 1,
                "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)}
        out = post_json(self.nodes.decode, self.servers["prefill"].base_url
                        + "/v1/completions", body, {"X-Request-Id": rid, **headers})
        params: dict[str, Any] = out["kv_transfer_params"]
        return params

    def plain(self, engine: str, tag: str) -> None:
        """One completion with no transfer: an idle engine steps (NIXL's worker reads
        its notifications only in a step)."""
        post_json(self.node(engine), self.servers[engine].base_url + "/v1/completions",
                  {**self.body(tag), "max_tokens": 2})

    def spans(self, trace_id: str, names: set[str],
              ready: Any = None) -> list[dict[str, Any]]:
        """The trace's spans (Phoenix's REST API, read on the decode node) once it holds a
        span of each name in ``names`` (and ``ready(spans)`` holds); idle engines get a
        plain request now and then (kvguard's last news of a transfer goes out with a
        step)."""
        kicks = [time.monotonic()]

        def got() -> list[dict[str, Any]] | None:
            with entered(self.nodes.decode.netns):
                spans = self.phoenix.spans(trace_id)
            if names <= {sp["name"] for sp in spans} and (ready is None or ready(spans)):
                return spans
            if time.monotonic() - kicks[-1] > 10.0:
                for engine in ("prefill", "decode"):
                    self.plain(engine, f"trace-kick{len(kicks)}")
                kicks.append(time.monotonic())
            return None
        spans: list[dict[str, Any]] = until(f"spans {sorted(names)} in trace {trace_id}", got)
        return spans

    def state(self, engine: str) -> EngineState:
        from kvguard.transport.reader import read_run_dir

        (st,) = read_run_dir(self.work / engine / "run").states
        return st

    def report_transfers(self, *, as_json: bool = True) -> Any:
        """``kvguard report --transfers [--json]`` over both nodes' sidecars, run on the
        decode node: the joined view (``{"transfers": [...], "links": [...]}``) or its text."""
        cmd = [kvguard_cli(), "report", "--transfers", *(["--json"] if as_json else []),
               "--sidecar", self.sidecar_url("prefill"), "--sidecar", self.sidecar_url("decode")]
        with entered(self.nodes.decode.netns):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout) if as_json else out.stdout

    def joined(self) -> list[dict[str, Any]]:
        """The cross-engine verdicts of :meth:`report_transfers`."""
        links: list[dict[str, Any]] = self.report_transfers()["links"]
        return links


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("two-nodes")
    model = make_tiny_model(work / "model")
    faults = {"KVGUARD_ALLOW_FAULTS": "1", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    with two_nodes() as nodes, ExitStack() as stack:
        with entered(nodes.decode.netns):  # its readiness is asked on the decode node
            px = stack.enter_context(phoenix_server(
                nodes.decode.address, PHOENIX_PORT, work / "phoenix",
                grpc_port=PHOENIX_GRPC_PORT,
                command_prefix=("ip", "netns", "exec", nodes.decode.netns)))
        servers = start_servers(nodes, model, work, scheduler_cls=SCHEDULER_CLS, env={
            "prefill": {**faults, "KVGUARD_FAULTS": "send_completion_lost=1@lost"},
            "decode": {**faults, "KVGUARD_FAULTS": "remote_kv_never_arrives=1@abort"}},
            extra={"otlp_traces_endpoint": px.otlp_traces_endpoint})
        for s in servers.values():
            stack.callback(s.stop)
        started: dict[str, NodeProcess] = {}
        for name, node in (("prefill", nodes.prefill), ("decode", nodes.decode)):
            started[name] = sidecar(node, work / name / "run", work)
            stack.callback(started[name].stop)
        px_proc = proxy(nodes.decode, servers["prefill"].base_url, servers["decode"].base_url,
                        work)
        stack.callback(px_proc.stop)
        targets = {"kvguard-prefill": f"{nodes.prefill.address}:{SIDECAR_PORT}",
                   "kvguard-decode": f"{nodes.decode.address}:{SIDECAR_PORT}",
                   "vllm-prefill": f"{nodes.prefill.address}:{servers['prefill'].port}",
                   "vllm-decode": f"{nodes.decode.address}:{servers['decode'].port}"}
        prom = prometheus(nodes.decode, targets, work / "prometheus")
        stack.callback(prom.stop)
        c = Cluster(nodes, servers, started, px_proc, prom, px, work)
        _first_transfer(c)
        yield c


def _trace() -> tuple[str, str, dict[str, str]]:
    """A new W3C trace context, as a caller (client or gateway) starts one: trace id,
    parent span id, and the header that carries them."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent, {"traceparent": f"00-{trace_id}-{parent}-01"}


def _one(spans: list[dict[str, Any]], name: str, engine: str) -> dict[str, Any]:
    found = [sp for sp in spans if sp["name"] == name
             and sp["attributes"].get("kvguard.engine.name") == engine]
    assert len(found) == 1, (name, engine, spans)
    return found[0]


def _first_transfer(c: Cluster) -> None:
    """One completion through the proxy before the tests, retried: the decode worker's
    first read handshakes with the prefill node's NIXL side channel (vLLM waits 5 s for
    its reply; on 2 loaded cores that has come too late and failed the request)."""
    for attempt in range(3):
        try:
            post_json(c.nodes.decode, f"http://{c.nodes.decode.address}:{PROXY_PORT}"
                      "/v1/completions", c.body(f"handshake{attempt}"),
                      {"X-Request-Id": f"handshake-{attempt}"})
            return
        except OSError:
            continue
    raise AssertionError("no P/D completion across the two nodes in 3 tries")


def test_nixl_reads_the_kv_across_the_link(cluster: Cluster) -> None:
    """A completion routed by the proxy: the decode engine's NIXL read crossed the veth
    (the link carried at least the bytes vLLM says it transferred)."""
    before_link = link_bytes(cluster.nodes.decode)
    before_read = cluster.vllm("decode", "vllm:nixl_bytes_transferred_sum")
    trace_id, parent, tp = _trace()
    out = post_json(cluster.nodes.decode, f"http://{cluster.nodes.decode.address}:{PROXY_PORT}"
                    "/v1/completions", cluster.body("ok"), {"X-Request-Id": "ok-1", **tp})
    assert out["usage"]["completion_tokens"] == 8
    read = until("vLLM's decode side to count the read", lambda: (
        b := cluster.vllm("decode", "vllm:nixl_bytes_transferred_sum") - before_read) > 0 and b)
    assert link_bytes(cluster.nodes.decode) - before_link >= read
    until("the prefill side to free its held blocks",
          lambda: cluster.blocks_in_use("prefill") == 0)
    # One trace across the two nodes: the proxy forwarded the caller's context to both
    # halves; each node's vLLM span and kvguard's transfer span are children of it.
    spans = cluster.spans(trace_id, {VLLM_SPAN, "kvguard.kv_transfer"}, ready=lambda sp: sum(
        x["name"] == VLLM_SPAN for x in sp) == 2 and sum(
        x["name"] == "kvguard.kv_transfer" for x in sp) == 2)
    assert sorted(x["parent_id"] for x in spans) == [parent] * len(spans)
    p_span = _one(spans, "kvguard.kv_transfer", "prefill")["attributes"]
    d_span = _one(spans, "kvguard.kv_transfer", "decode")["attributes"]
    p_state = cluster.state("prefill").transfers
    assert p_state is not None
    assert p_span["kvguard.kv.engine_id"] == d_span["kvguard.transfer.remote_engine_id"] \
        == p_state.kv_engine_id
    assert p_span["kvguard.request.id"] == d_span["kvguard.transfer.remote_request_id"]
    assert d_span["kvguard.transfer.outcome"] == "received"
    assert p_span["kvguard.transfer.outcome"] in ("read", "expired_unread")
    # The GenAI attributes join kvguard's spans with vLLM's on both nodes: one request id,
    # vLLM's own (both halves got the same X-Request-Id), and the model each engine serves.
    vllm_ids = {x["attributes"]["gen_ai.request.id"] for x in spans if x["name"] == VLLM_SPAN}
    assert len(vllm_ids) == 1 and "ok-1" in next(iter(vllm_ids)), vllm_ids
    assert {p_span["gen_ai.request.id"], d_span["gen_ai.request.id"]} == vllm_ids
    model = cluster.servers["prefill"].spec.served_model_name
    assert p_span["gen_ai.response.model"] == d_span["gen_ai.response.model"] == model


def test_each_node_keeps_its_own_files_and_its_sidecar_sees_only_its_engine(
        cluster: Cluster) -> None:
    for engine, other in (("prefill", "decode"), ("decode", "prefill")):
        run_dir = cluster.work / engine / "run"
        names = {p.name for p in run_dir.iterdir()}
        assert any(n.startswith(engine) for n in names), names
        assert not any(n.startswith(other) for n in names), names
        report = get_json(cluster.node(engine), cluster.sidecar_url(engine) + "/v1/report")
        assert [e["engine"] for e in report["engines"]] == [engine]
        assert report["transfer_links"] == []  # one sidecar alone cannot join


def test_a_read_after_the_lease_lapsed_is_joined_across_nodes(cluster: Cluster) -> None:
    """Prefill now, decode after the lease lapsed: vLLM frees the blocks (its log says
    so), then the decode node reads them (the prefill node logs the late read)."""
    trace_id, _, tp = _trace()
    params = cluster.prefill_only("late", "late-1", tp)
    until("vLLM to free on lease expiry", lambda: any(
        "late-1" in r for r in cluster.logged("prefill", EXPIRED_LINE)),
        2 * 12 + 60)
    post_json(cluster.nodes.decode, cluster.servers["decode"].base_url + "/v1/completions",
              {**cluster.body("late"), "kv_transfer_params": params},
              {"X-Request-Id": "late-1", **tp})
    # When it is reported: the join over both sidecars judges it from the decode node's
    # receipt as soon as that is published; the prefill engine, idle since it freed the
    # blocks, has not read the decode side's notification yet (NIXL reads them in a step):
    # neither vLLM's warning nor kvguard's hazard exists there until its next step.
    def late_row() -> Any:
        rows = [r for r in cluster.report_transfers()["transfers"] if r["prefill"]
                and "late-1" in r["prefill"]["client_request_id"] and r["link"]]
        return rows[0] if rows else None
    row = until("the joined view to judge the late read from the decode's receipt", late_row)
    assert not any("late-1" in r for r in cluster.logged("prefill", LATE_LINE)), (
        "the prefill engine read the late notification without a request to step it")
    assert row["link"]["kind"] == "freed_before_read" and row["hazards"] == [], row
    p_rec, d_rec = row["prefill"], row["decode"]
    assert (p_rec["outcome"], d_rec["outcome"]) == ("expired_unread", "received")
    assert p_rec["hold_deadline"] <= p_rec["ended_at"] <= d_rec["ended_at"]
    assert p_rec["request_id"] in cluster.logged("prefill", EXPIRED_LINE)  # vLLM's lapse
    kicked = time.time()
    kicks = [time.monotonic()]

    def logged_late() -> bool:
        if any("late-1" in r for r in cluster.logged("prefill", LATE_LINE)):
            return True
        if time.monotonic() - kicks[-1] > 5.0:
            cluster.plain("prefill", f"kick{len(kicks)}")
            kicks.append(time.monotonic())
        return False
    cluster.plain("prefill", "kick0")
    until("vLLM's own warning of a read after expiry", logged_late)
    truth = cluster.logged("prefill", EXPIRED_LINE) & cluster.logged("prefill", LATE_LINE)

    def links() -> Any:
        got = {ln["prefill_request_id"] for ln in cluster.joined()
               if ln["kind"] == "freed_before_read"}
        return got if got == {r.rsplit("-", 1)[0] for r in truth} else None
    assert any("late-1" in r for r in until("the cross-node links to match vLLM's log", links))
    # The joined view now has the prefill engine's hazard too, reported at the step the
    # kick gave it; its transfers lapsed and read late are those vLLM logged.
    def with_hazard() -> Any:
        doc = cluster.report_transfers()
        rows = [r for r in doc["transfers"] if r["prefill"] and r["hazards"]]
        return doc if {r["prefill"]["request_id"] for r in rows} == truth else None
    doc = until("the joined view to carry the prefill engine's hazard", with_hazard)
    [row] = [r for r in doc["transfers"] if r["prefill"] and r["hazards"]]
    [hz] = row["hazards"]
    assert hz["read_at"] >= kicked >= row["decode"]["ended_at"] >= hz["freed_at"]
    assert {r["prefill"]["request_id"] for r in doc["transfers"] if r["prefill"] and r[
        "prefill"]["outcome"] in ("expired_unread", "expired_partly_read")} == cluster.logged(
        "prefill", EXPIRED_LINE)
    text = cluster.report_transfers(as_json=False)
    [block] = [b for b in text.split("\n\n") if "late-1" in b.splitlines()[0]]
    lines = block.splitlines()
    assert lines[0].endswith(": FREED_BEFORE_READ"), block
    assert lines[1].startswith("  prefill prefill: ") and " expired_unread, " in lines[1] \
        and ", lease until " in lines[1] and ", lapsed " in lines[1], block
    assert lines[2].startswith("  decode  decode: ") and " received, " in lines[2], block
    assert lines[3].startswith("  hazard  freed_before_read: ") and lines[4].startswith(
        "  finding freed_before_read: "), block
    print("\n" + block)
    # The fleet's view: the prefill node's hazards, scraped across the link, equal vLLM's
    # own count of reads after expiry on that node.
    def scraped() -> Any:
        ours = promql(cluster.nodes.decode, 'sum(kvguard_kv_transfer_hazards_total'
                                            '{engine_name="prefill",kind="freed_before_read"})')
        vllm = promql(cluster.nodes.decode, "sum(vllm:nixl_num_notifications_after_expiry_total"
                                            '{job="vllm-prefill"})')
        if ours and vllm and float(ours[0]["value"][1]) == float(vllm[0]["value"][1]) > 0:
            return float(ours[0]["value"][1])
        return None
    assert until("Prometheus to scrape both sides' counts", scraped) >= 1
    # In the request's trace: the prefill node's hazard and lapsed hold, the decode node's
    # receipt of what it read.
    spans = cluster.spans(trace_id, {"kvguard.kv_transfer_hazard", "kvguard.kv_transfer"},
                          ready=lambda sp: sum(x["name"] == "kvguard.kv_transfer"
                                               for x in sp) == 2)
    hz = _one(spans, "kvguard.kv_transfer_hazard", "prefill")["attributes"]
    assert hz["kvguard.hazard.kind"] == "freed_before_read"
    assert "late-1" in hz["kvguard.request.client_id"]
    assert _one(spans, "kvguard.kv_transfer", "prefill")["attributes"][
        "kvguard.transfer.outcome"] == "expired_unread"
    assert _one(spans, "kvguard.kv_transfer", "decode")["attributes"][
        "kvguard.transfer.outcome"] == "received"


def test_a_decode_abort_that_leaves_prefill_blocks_held_is_joined_across_nodes(
        cluster: Cluster) -> None:
    """The decode half is abandoned while its KV never arrives (decode fault), and the
    prefill side never hears its blocks were read (prefill fault): vLLM holds blocks on
    both nodes; only the join over both sidecars names the pair."""
    # Runs after the late read: with this order reversed, the decode node's worker hung
    # for minutes on the late read that followed the abort ("No available shared memory
    # broadcast block"), seen once; on one host the same sequence runs.
    trace_id, _, tp = _trace()
    params = cluster.prefill_only("both", "abort-lost-1", tp)
    held_before = cluster.blocks_in_use("decode")
    _decode_hung_up(cluster, "both", params, "abort-lost-1", held_before, tp)
    until("vLLM's decode engine to have aborted it", lambda: cluster.vllm(
        "decode", "vllm:num_requests_running") + cluster.vllm(
        "decode", "vllm:num_requests_waiting") == 0)
    assert cluster.blocks_in_use("prefill") > 0 and cluster.blocks_in_use("decode") > 0

    def link() -> Any:
        return [ln for ln in cluster.joined() if "abort-lost-1" in ln["decode_request_id"]]
    (ln,) = until("the cross-node link", link)
    assert ln["kind"] == "prefill_holds_for_aborted_decode"
    assert (ln["prefill_engine"], ln["decode_engine"]) == ("prefill", "decode")
    assert "abort-lost-1" in ln["prefill_request_id"]
    # One trace shows both halves: the prefill node's hold (a leak once the hold ended
    # and the blocks stayed, valued at what vLLM holds there) and the decode node's abort.
    held = cluster.blocks_in_use("prefill")
    def both(sp: list[dict[str, Any]]) -> bool:
        seen = {(x["name"], x["attributes"].get("kvguard.engine.name")) for x in sp}
        return {("kvguard.leak", "prefill"), ("kvguard.kv_transfer", "decode")} <= seen
    # (The decode node's own leak, past its bound, may land there too: it holds blocks.)
    spans = cluster.spans(trace_id, {"kvguard.leak", "kvguard.kv_transfer"}, ready=both)
    leak = _one(spans, "kvguard.leak", "prefill")["attributes"]
    assert leak["kvguard.leak.cause"] == "finished_request"
    assert leak["kvguard.leak.path"] == "delayed_free" and leak["kvguard.leak.blocks"] == held
    assert _one(spans, "kvguard.kv_transfer", "decode")["attributes"][
        "kvguard.transfer.outcome"] == "aborted_waiting"
    for engine in ("prefill", "decode"):
        tr = cluster.state(engine).tracing
        assert tr is not None and tr.spans_dropped_total == 0 and tr.export_failures_total == 0


def _decode_hung_up(c: Cluster, tag: str, params: dict[str, Any], rid: str,
                    held_before: int, headers: dict[str, str]) -> None:
    """Send the decode half from the decode node; hang up once vLLM's decode engine holds
    blocks for it (a client that gives up on KV that never arrives)."""
    import http.client

    node = c.nodes.decode
    with entered(node.netns):
        conn = http.client.HTTPConnection(node.address, c.servers["decode"].port, timeout=30)
        conn.request("POST", "/v1/completions",
                     json.dumps({**c.body(tag), "kv_transfer_params": params}),
                     {"Content-Type": "application/json", "X-Request-Id": rid, **headers})
    try:
        until(f"the decode engine to hold blocks for {rid}",
              lambda: c.blocks_in_use("decode") > held_before)
    finally:
        conn.close()
