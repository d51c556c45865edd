"""The KV-event mirror check on a real vLLM OpenAI server, real ZMQ (``ipc://``) and kvguard in
its EngineCore. vLLM's own pool is the truth: the test scheduler
(:mod:`kv_truth_scheduler`) writes ``BlockPool.cached_block_hash_to_block`` after every step,
read with vLLM's functions, independently of kvguard.

One server for the module (a start costs over a minute on this machine); each test builds its
own sidecar-side watch, whose subscriber joins late and catches up from the replay endpoint,
and judges the engine's drained snapshot after its own workload. Losses are made on purpose,
below kvguard:

* a burst past the publisher's high-water mark: this server publishes with ``hwm`` 10 (vLLM's
  default is 100,000), and a subscriber whose own receive mark is 10 stalls on its first
  live batch while 160 requests run; ZMQ drops what does not fit on either side, and replay
  gives it back;
* a batch lost on the way to the subscriber: a test-side input filter discards it (SUB only:
  replay repairs it; SUB and replay: nothing can repair it), so that the lost sequence
  number is exactly the one the test names;
* a ``BlockRemoved`` (or ``BlockStored``) the engine never published (the test scheduler takes
  it out of its batch before vLLM's publisher sees it): the pool evicted (or cached) the
  block, the sequence has no gap.

The tests run in file order on the one server, and a loss made below kvguard stays in the
engine's stream until the next clear or restart (every new subscriber replays it): the
``BlockRemoved`` loss comes before ``reset_prefix_cache``, the ``BlockStored`` loss after the
sidecar test, the restart last.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn
from _kv_server import ENGINE, KvServer, kv_server, prompts, wait_for
from browser import launch_chromium, open_page
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.cli.main import main as cli_main
from kvguard.cli.render import render_kv_events
from kvguard.kv_events.verdict import FIRST_BLOCKS, KvEventsCheck, KvEventsVerdict
from kvguard.sidecar.app import create_app
from kvguard.sidecar.kv_events import KvEventsWatch
from kvguard.sidecar.metrics import ENGINE_LABELS
from kvguard.sidecar.models import ReportsResponse
from kvguard.sidecar.store import EngineStore
from kvguard.testing.ports import free_loopback_port
from kvguard.testing.tiny_model import make_tiny_model
from kvguard.transport.state import EngineState

ENGINE_LABELS_SORTED = sorted(ENGINE_LABELS)
PUBLISHER_HWM = 10
"""The server's ZMQ send high-water mark (batches); the replay socket has none."""


@pytest.fixture(scope="module")
def ks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvServer]:
    base = tmp_path_factory.mktemp("kvev")
    with kv_server(make_tiny_model(base / "model"), base / "srv",
                   publisher={"hwm": PUBLISHER_HWM}) as server:
        yield server


def watch(ks: KvServer, *, drop: Callable[[int, bool], bool] | None = None,
          receive_hwm: int = 0) -> KvEventsWatch:
    """A sidecar-side watch on the engine, caught up with every batch published so far."""
    w = KvEventsWatch(input_filter_for=(lambda _name: drop) if drop else None,
                      receive_hwm=receive_hwm)
    state = ks.state()
    assert state is not None and state.kv_events is not None
    w.update([state])
    sub = w.engines[ENGINE].subscriber
    # vLLM's own count of the batches its publisher sent (the truth file): the state file
    # kvguard wrote may be older than the last of them on a loaded machine (a fresh-clone
    # run once saw it before the warm-up's batches, and the watch then waited for nothing)
    through = max(state.kv_events.batches_published, int(ks.truth()["batches"])) - 1  # type: ignore[call-overload]
    sub.want_through(through)
    wait_for(lambda: sub.mirror.last_seq >= through,
             "the late subscriber to catch up from the replay endpoint")
    return w


def judged(ks: KvServer, w: KvEventsWatch) -> tuple[EngineState, KvEventsCheck]:
    """The verdict on the engine's drained snapshot after the last workload."""
    st = ks.drained_state()
    snap = st.kv_events.snapshot  # type: ignore[union-attr]
    assert snap is not None and snap.block_keys is not None
    assert set(snap.block_keys) == ks.truth_keys()  # kvguard read vLLM's pool right
    deadline = time.monotonic() + 30
    while True:
        w.update([st])
        check = w.checks[ENGINE]
        if check.verdict is not KvEventsVerdict.PENDING:
            assert check.seq == snap.last_seq
            return st, check
        assert time.monotonic() < deadline, check.explanation
        time.sleep(0.1)


def mirror_keys(w: KvEventsWatch, seq: int) -> frozenset[str]:
    sub = w.engines[ENGINE].subscriber
    with sub.lock:
        view = sub.mirror.view_at(seq)
    assert view is not None
    return view.keys


def batches_published(ks: KvServer) -> int:
    st = ks.state()
    assert st is not None and st.kv_events is not None
    return st.kv_events.batches_published


def test_late_subscriber_mirror_equals_vllms_pool_after_prefix_heavy_load_with_evictions(
        ks: KvServer) -> None:
    removed_before = int(ks.truth()["removed"])  # type: ignore[call-overload]
    w = watch(ks)
    try:
        sub = w.engines[ENGINE].subscriber
        assert sub.replays_total >= 1 and sub.replayed_batches_total >= 1  # the warm-up's
        ks.run(prompts(1, 6) + prompts(2, 6) + prompts(3, 6))
        _, check = judged(ks, w)
        truth = ks.truth_keys()
        assert int(ks.truth()["removed"]) > removed_before  # type: ignore[call-overload]
        assert check.verdict is KvEventsVerdict.CONSISTENT, check.explanation
        assert check.pool_blocks == check.mirror_blocks == len(truth) > 0
        assert mirror_keys(w, check.seq or 0) == truth
        assert sub.lost_batches_total == 0 and sub.received_total > 0 and not sub.gap_open
    finally:
        w.close()


def test_a_burst_past_the_publishers_hwm_is_dropped_by_zmq_and_replay_repairs_the_mirror(
        ks: KvServer) -> None:
    go, stalled = threading.Event(), threading.Event()

    def stall_on_first_live_batch(_seq: int, replayed: bool) -> bool:
        if not replayed and not stalled.is_set():
            stalled.set()
            go.wait(180)  # the subscriber's thread stops reading: its socket fills
        return True

    w = watch(ks, drop=stall_on_first_live_batch, receive_hwm=PUBLISHER_HWM)
    try:
        sub = w.engines[ENGINE].subscriber
        first = batches_published(ks)
        received, replayed = sub.received_total, sub.replayed_batches_total
        burst = [p for family in range(20, 40) for p in prompts(family, 8)]
        ks.run(burst, concurrency=8, max_tokens=40)
        assert stalled.is_set()
        go.set()
        st, check = judged(ks, w)
        published = st.kv_events.batches_published - first  # type: ignore[union-attr]
        over_sub = sub.received_total - received
        assert published > 4 * PUBLISHER_HWM and over_sub < published, (published, over_sub)
        # every batch ZMQ dropped came back from vLLM's replay buffer, none counted twice
        assert sub.replayed_batches_total - replayed >= published - over_sub
        assert sub.lost_batches_total == 0 and not sub.gap_open and not sub.gaps
        assert check.verdict is KvEventsVerdict.CONSISTENT, check.explanation
        assert mirror_keys(w, check.seq or 0) == ks.truth_keys()
    finally:
        go.set()
        w.close()


def test_batch_dropped_before_the_subscriber_is_replayed_and_the_mirror_stays_consistent(
        ks: KvServer) -> None:
    first = batches_published(ks)
    dropped: list[int] = []

    def drop_first_sub_batch(seq: int, replayed: bool) -> bool:
        if not replayed and seq >= first and not dropped:
            dropped.append(seq)
            return False
        return True

    w = watch(ks, drop=drop_first_sub_batch)
    try:
        sub = w.engines[ENGINE].subscriber
        replays_before = sub.replays_total
        ks.run(prompts(4, 6) + prompts(5, 6))
        _, check = judged(ks, w)
        assert dropped and sub.filtered_total == 1
        assert sub.replays_total > replays_before and sub.lost_batches_total == 0
        assert check.verdict is KvEventsVerdict.CONSISTENT, check.explanation
        assert mirror_keys(w, check.seq or 0) == ks.truth_keys()
    finally:
        w.close()


def test_batch_replay_cannot_give_back_is_a_gap_naming_the_blocks_the_mirror_got_wrong(
        ks: KvServer) -> None:
    first = batches_published(ks)
    lost_seq = first + 1

    w = watch(ks, drop=lambda seq, _replayed: seq != lost_seq)
    try:
        sub = w.engines[ENGINE].subscriber
        ks.run(prompts(6, 6) + prompts(7, 6))
        _, check = judged(ks, w)
        truth = ks.truth_keys()
        mirror = mirror_keys(w, check.seq or 0)
        assert sub.lost_batches_total == 1 and list(sub.gaps) == [(lost_seq, lost_seq)]
        assert mirror != truth
        assert check.verdict is KvEventsVerdict.GAP, check.explanation
        assert (check.stale_blocks, check.missing_blocks) == (len(mirror - truth),
                                                              len(truth - mirror))
        assert check.first_stale == sorted(mirror - truth)[:FIRST_BLOCKS]
        assert check.first_missing == sorted(truth - mirror)[:FIRST_BLOCKS]
    finally:
        w.close()


def test_blockremoved_never_published_leaves_a_stale_mirror_naming_the_evicted_block(
        ks: KvServer) -> None:
    w = watch(ks)
    try:
        sub = w.engines[ENGINE].subscriber
        (ks.truth_dir / "arm_drop_removed").write_text("1")
        ks.run(prompts(8, 6) + prompts(9, 6))
        _, check = judged(ks, w)
        truth = ks.truth_keys()
        dropped = ks.dropped_keys()
        evicted = dropped - truth  # evicted by vLLM and never announced
        assert len(dropped) == 1 and evicted == dropped
        assert sub.lost_batches_total == 0 and not sub.gaps  # no sequence gap at all
        assert check.verdict is KvEventsVerdict.STALE, check.explanation
        assert (check.stale_blocks, check.missing_blocks) == (1, 0)
        assert check.first_stale == sorted(evicted)
        assert mirror_keys(w, check.seq or 0) - truth == evicted
    finally:
        w.close()


def test_reset_prefix_cache_clears_the_mirror_and_one_that_misses_the_clear_is_cleared_missed(
        ks: KvServer) -> None:
    """At idle, ``reset_prefix_cache`` empties vLLM's pool at once, but its
    ``AllBlocksCleared`` waits in the pool's event queue for vLLM's next step: until then the
    verdict is ``pending`` (the pre-reset comparison no longer describes the pool)."""
    clear_seq = batches_published(ks)  # idle: the next batch carries AllBlocksCleared
    before = ks.truth_keys()
    ok = watch(ks)
    missed = watch(ks, drop=lambda seq, _replayed: seq != clear_seq)
    try:
        st, _ = judged(ks, ok)  # the pre-reset comparison (stale: the test before left a loss)
        ks.reset_prefix_cache()
        truth = ks.truth()
        assert before and not ks.truth_keys()  # vLLM's pool dropped every hash
        assert truth["pending"] == 1 and truth["batches"] == clear_seq  # queued, unpublished
        idle_checkpoint = st.kv_events.snapshot.checkpoint_id  # type: ignore[union-attr]
        wait_for(lambda: (s := ks.state()) is not None and s.kv_events is not None
                 and s.kv_events.snapshot is not None
                 and s.kv_events.snapshot.checkpoint_id > idle_checkpoint,
                 "the checkpoint the reset asks for")
        at_idle = ks.state()
        assert at_idle is not None
        ok.update([at_idle])
        check = ok.checks[ENGINE]
        assert check.verdict is KvEventsVerdict.PENDING, check.explanation
        assert check.checkpoint_id != idle_checkpoint and "AllBlocksCleared" in check.explanation
        assert ks.truth()["batches"] == clear_seq  # still nothing published: no step ran
        ks.run(prompts(10, 3))
        st, check = judged(ks, ok)
        snap = st.kv_events.snapshot  # type: ignore[union-attr]
        assert snap is not None and snap.clear_seq == clear_seq
        assert check.verdict is KvEventsVerdict.CONSISTENT, check.explanation
        assert ok.engines[ENGINE].subscriber.mirror.clear_seq == clear_seq

        _, check = judged(ks, missed)
        truth = ks.truth_keys()
        mirror = mirror_keys(missed, check.seq or 0)
        assert check.verdict is KvEventsVerdict.CLEARED_MISSED, check.explanation
        assert before - truth <= mirror  # the blocks the clear dropped are still mirrored
        assert check.stale_blocks == len(mirror - truth) >= len(before - truth) > 0
        assert missed.engines[ENGINE].subscriber.lost_batches_total == 1
    finally:
        ok.close()
        missed.close()


def test_sidecar_serves_the_mirror_verdict_in_report_metrics_cli_and_status_page(
        ks: KvServer, tmp_path: Path) -> None:
    store = EngineStore(ks.run_dir, kv_events=KvEventsWatch())
    try:
        store.refresh()
        ks.run(prompts(12, 3))
        snap = ks.drained_state().kv_events.snapshot  # type: ignore[union-attr]
        assert snap is not None
        deadline = time.monotonic() + 30
        while (c := store.kv_events.checks.get(ENGINE)) is None \
                or c.verdict is KvEventsVerdict.PENDING or c.seq != snap.last_seq:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, c
            time.sleep(0.1)
            store.refresh()
        truth = ks.truth_keys()
        client = TestClient(create_app(store))  # not started: no refresh task, read as is
        body = client.get("/v1/report").text
        eng = ReportsResponse.model_validate_json(body).engines[0]
        assert eng.kv_events is not None and eng.kv_events.verdict is KvEventsVerdict.CONSISTENT
        assert eng.kv_events.pool_blocks == len(truth)
        prompt = prompts(12, 1)[0]
        assert json.dumps(prompt[:8])[1:-1] not in body  # no token ids, only hashes
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(client.get("/metrics").text)
                   for s in fam.samples if s.name.startswith("kvguard_kv_events_")}
        st = ks.state()
        assert st is not None
        ids = (("engine", str(st.engine_index)), ("engine_name", ENGINE),
               ("model_name", st.model_name or ""))
        assert samples[("kvguard_kv_events_mirror_blocks", (*ids, ("state", "matched")))] \
            == len(truth)
        assert samples[("kvguard_kv_events_mirror_blocks", (*ids, ("state", "stale")))] == 0
        assert samples[("kvguard_kv_events_verdict", (*ids, ("verdict", "consistent")))] == 1
        assert samples[("kvguard_kv_events_batches_lost_total", ids)] == 0
        assert {tuple(k for k, _ in labels if k not in ("state", "verdict"))
                for _, labels in samples} == {tuple(ENGINE_LABELS_SORTED)}
        text = render_kv_events(ENGINE, eng.kv_events)
        assert "KV-event mirror CONSISTENT" in text and f"pool {len(truth)} block(s)" in text
        with serving(store) as url:
            out = _kv_events_cli(url)
            shown, counts = _status_page_kv_events(url, tmp_path / "chromium")
        assert f"== {ENGINE}: KV-event mirror CONSISTENT" in out, out
        assert shown == "consistent" and f"pool {len(truth)} block(s)" in counts, counts
    finally:
        store.kv_events.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def serving(store: EngineStore) -> Iterator[str]:
    """The real sidecar app on a loopback port (its refresh task runs): its base URL."""
    port = free_loopback_port()
    server = uvicorn.Server(uvicorn.Config(create_app(store), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "the sidecar to serve")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _kv_events_cli(url: str) -> str:
    """``kvguard kv-events --sidecar URL``."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(["kv-events", "--sidecar", url])
    assert rc == 0, buf.getvalue()
    return buf.getvalue()


def _status_page_kv_events(url: str, tmp: Path) -> tuple[str, str]:
    """The status page's KV-event panel in a real browser: (verdict, counts) as shown."""
    with launch_chromium(tmp) as context, open_page(context) as page:
        page.goto(url + "/")
        verdict = page.get_by_test_id("kv-events-verdict")
        verdict.wait_for(timeout=20_000)
        return verdict.inner_text(), page.get_by_test_id("kv-events-counts").inner_text()


def test_blockstored_never_published_leaves_the_cached_blocks_missing_from_the_mirror(
        ks: KvServer) -> None:
    w = watch(ks)
    try:
        sub = w.engines[ENGINE].subscriber
        (ks.truth_dir / "arm_drop_stored").write_text("1")
        ks.run(prompts(14, 2), concurrency=1)
        _, check = judged(ks, w)
        truth = ks.truth_keys()
        unannounced = ks.dropped_keys("dropped_stored.json") & truth  # cached, never stored
        assert unannounced and sub.lost_batches_total == 0 and not sub.gaps
        assert check.verdict is KvEventsVerdict.MISSING, check.explanation
        assert (check.stale_blocks, check.missing_blocks) == (0, len(unannounced))
        assert check.first_missing == sorted(unannounced)[:FIRST_BLOCKS]
        assert truth - mirror_keys(w, check.seq or 0) == unannounced
    finally:
        w.close()


def test_engine_restart_starts_the_mirror_over_from_the_new_sequence(ks: KvServer) -> None:
    w = watch(ks)
    try:
        old = ks.state()
        before = ks.truth_keys()
        assert old is not None and before
        ks.server.stop()
        ks.server.start()  # same ipc endpoints; vLLM numbers batches from 0 again
        ks.run(prompts(13, 3))
        st, check = judged(ks, w)
        truth = ks.truth_keys()
        sub = w.engines[ENGINE].subscriber
        assert st.epoch != old.epoch and sub.restarts_total == 1
        assert check.verdict is KvEventsVerdict.CONSISTENT, check.explanation
        assert mirror_keys(w, check.seq or 0) == truth and not (before - truth) & truth
    finally:
        w.close()
