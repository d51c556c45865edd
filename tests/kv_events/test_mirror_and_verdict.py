"""The mirror's bookkeeping and the verdict rules, on hand-made events (no engine: the
real-server tests in test_kv_events_server.py check them against vLLM's pool)."""

from __future__ import annotations

from kvguard.kv_events.digest import SetDigest, block_key, digest_hex
from kvguard.kv_events.mirror import Cleared, Mirror, Removed, Stored
from kvguard.kv_events.snapshot import KvEventsSnapshot
from kvguard.kv_events.verdict import KvEventsVerdict, MirrorFacts, judge


def keys(*hs: int) -> list[str]:
    return [block_key(0, h) for h in hs]


def snap(pool: list[str], seq: int, *, clear_seq: int | None = None, pending: int = 0,
         with_keys: bool = True) -> KvEventsSnapshot:
    return KvEventsSnapshot(checkpoint_id=1, taken_at=0.0, last_seq=seq, clear_seq=clear_seq,
                            pending_events=pending, num_blocks=len(pool),
                            digest=digest_hex(pool),
                            block_keys=sorted(pool) if with_keys else None)


def facts(m: Mirror, *, lost: bool = False, epoch: str | None = "e1") -> MirrorFacts:
    return MirrorFacts(last_seq=m.last_seq, clear_seq=m.clear_seq, lost_since_reset=lost,
                       epoch=epoch)


def test_digest_is_order_free_and_follows_adds_and_removes() -> None:
    a = SetDigest(keys(1, 2, 3))
    b = SetDigest(keys(3, 1))
    b.add(block_key(0, 2))
    assert (a.count, a.hex) == (b.count, b.hex)
    b.remove(block_key(0, 2))
    assert b.hex == digest_hex(keys(1, 3)) and b.hex != a.hex
    assert block_key(1, 5) != block_key(0, 5) and block_key(0, b"\x05") != block_key(0, 5)


def test_mirror_view_at_an_earlier_batch_undoes_later_batches() -> None:
    m = Mirror("GPU")
    m.apply(0, [Stored(keys(1, 2), None, 64, "GPU")])
    m.apply(1, [Removed(keys(1), "GPU"), Stored(keys(3), keys(2)[0], 32, "GPU")])
    m.apply(2, [Cleared()])
    m.apply(3, [Stored(keys(4), None, 32, None), Stored(keys(9), None, 32, "CPU")])
    assert m.view_at(3).keys == set(keys(4))  # type: ignore[union-attr]
    assert m.view_at(1).keys == set(keys(2, 3))  # type: ignore[union-attr]
    assert m.view_at(0).keys == set(keys(1, 2))  # type: ignore[union-attr]
    assert m.view_at(4) is None
    assert m.digest.hex == digest_hex(keys(4)) and m.other_medium_events == 1
    m.skip_to(7)
    assert m.view_at(3) is None and m.view_at(7).keys == set(keys(4))  # type: ignore[union-attr]


def test_a_key_stays_until_its_last_copy_is_removed() -> None:
    """vLLM announces each cached copy of a key and each eviction of one
    (tests/scheduler/test_kv_event_copies.py drives vLLM's pool into it)."""
    m = Mirror("GPU")
    m.apply(0, [Stored(keys(1, 2), None, 64, "GPU")])
    m.apply(1, [Stored(keys(1), None, 32, "GPU")])  # a second block cached under key 1
    assert m.keys_with_copies == 1
    m.apply(2, [Removed(keys(1), "GPU")])  # one copy evicted: the other still serves hits
    assert set(m.blocks) == set(keys(1, 2)) and m.keys_with_copies == 0
    m.apply(3, [Removed(keys(1), "GPU")])
    assert set(m.blocks) == set(keys(2)) and m.digest.hex == digest_hex(keys(2))
    assert [m.view_at(q).keys for q in range(4)] == [  # type: ignore[union-attr]
        set(keys(1, 2)), set(keys(1, 2)), set(keys(1, 2)), set(keys(2))]
    m.apply(4, [Removed(keys(1), "GPU")])
    assert m.unknown_removes == 1


def test_undo_restores_a_key_stored_and_removed_within_one_batch_as_absent() -> None:
    m = Mirror("GPU")
    m.apply(0, [Stored(keys(1), None, 32, "GPU")])
    m.apply(1, [Stored(keys(2), None, 32, "GPU"), Removed(keys(2, 1), "GPU"),
                Stored(keys(1), None, 32, "GPU")])
    assert set(m.blocks) == set(keys(1))
    assert m.view_at(0).keys == set(keys(1))  # type: ignore[union-attr]


def test_verdicts_name_the_first_differing_blocks() -> None:
    m = Mirror("GPU")
    m.apply(0, [Stored(keys(1, 2, 3), None, 96, "GPU")])
    v = m.view_at(0)
    now = 1.0
    same = judge(snap(keys(1, 2, 3), 0), v, facts(m), engine_epoch="e1", now=now)
    assert same.verdict is KvEventsVerdict.CONSISTENT
    stale = judge(snap(keys(1, 2), 0), v, facts(m), engine_epoch="e1", now=now)
    assert (stale.verdict, stale.stale_blocks, stale.first_stale) == (
        KvEventsVerdict.STALE, 1, keys(3))
    missing = judge(snap(keys(1, 2, 3, 4), 0), v, facts(m), engine_epoch="e1", now=now)
    assert (missing.verdict, missing.missing_blocks, missing.first_missing) == (
        KvEventsVerdict.MISSING, 1, keys(4))
    gap = judge(snap(keys(1), 0), v, facts(m, lost=True), engine_epoch="e1", now=now)
    assert (gap.verdict, gap.stale_blocks) == (KvEventsVerdict.GAP, 2)
    cleared = judge(snap([], 0, clear_seq=0), v, facts(m), engine_epoch="e1", now=now)
    assert (cleared.verdict, cleared.stale_blocks) == (KvEventsVerdict.CLEARED_MISSED, 3)
    restarted = judge(snap([], 0), v, facts(m), engine_epoch="e2", now=now)
    assert restarted.verdict is KvEventsVerdict.CLEARED_MISSED
    counted = judge(snap(keys(1), 0, with_keys=False), v, facts(m), engine_epoch="e1", now=now)
    assert (counted.verdict, counted.stale_blocks, counted.first_stale) == (
        KvEventsVerdict.STALE, 2, [])


def test_nothing_is_compared_before_both_sides_reach_the_same_batch() -> None:
    m = Mirror("GPU")
    m.apply(0, [Stored(keys(1), None, 32, "GPU")])
    assert judge(None, None, facts(m), engine_epoch="e1", now=0).verdict \
        is KvEventsVerdict.PENDING
    ahead = snap(keys(1), 3)
    assert judge(ahead, m.view_at(3), facts(m), engine_epoch="e1", now=0).verdict \
        is KvEventsVerdict.PENDING
    queued = snap(keys(1), 0, pending=2)
    assert judge(queued, m.view_at(0), facts(m), engine_epoch="e1", now=0).verdict \
        is KvEventsVerdict.PENDING
