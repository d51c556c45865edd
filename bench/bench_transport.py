"""Target 5: the engine side of the transport never waits on the reader.

``StatePublisher.offer`` (what the engine thread calls) with a real writer thread and
disk, then with each write slowed to 50 ms: the engine must never wait.

Reported: offers per second, latency per offer, states written and dropped (superseded
before they were written; each state is complete, so a dropped one loses nothing).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import save, stats

from kvguard.transport.publisher import StatePublisher
from kvguard.transport.state import EngineState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sidecar"))

OFFERS = 20_000


def state_for_bench() -> EngineState:
    """A realistic engine state: 64 reports of history (the sidecar tests' factories)."""
    from factories import report, state

    return state([report(i, holding=i % 3) for i in range(1, 65)])


def run(slow_seconds: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-transport-"))
    pub = StatePublisher(tmp, "dp0", heartbeat_seconds=60)
    if slow_seconds:
        real = pub._write

        def slow(state):  # type: ignore[no-untyped-def]
            time.sleep(slow_seconds)
            real(state)

        pub._write = slow  # type: ignore[method-assign]
    s = state_for_bench()
    lat = []
    t0 = time.perf_counter()
    for _ in range(OFFERS):
        t = time.perf_counter_ns()
        pub.offer(s)
        lat.append((time.perf_counter_ns() - t) / 1000)
    elapsed = time.perf_counter() - t0
    pub.flush(10)
    pub.close()
    return {"writer_delay_s": slow_seconds, "offers_per_s": OFFERS / elapsed,
            "offer_us": stats(lat), "written": pub.writes, "dropped": pub.drops}


if __name__ == "__main__":
    rows = [run(0.0), run(0.05)]
    for r in rows:
        print(f"writer delay {r['writer_delay_s']} s: {r['offers_per_s']:.0f} offers/s, "
              f"median offer {r['offer_us']['median']:.2f} us, written {r['written']}, "
              f"dropped {r['dropped']}")
    save("transport", {"rows": rows})
