"""One engine process: a real in-process engine with kvguard runs one round and exits.

``python _engine_once.py MODEL_DIR``; kvguard is configured by the ``KVGUARD_*``
environment. Prints ``{"epoch": ..., "checkpoints": N, "verdict": ..., "held_blocks": N}``,
``held_blocks`` being vLLM's own count of referenced blocks at the end (ground truth: the
round ends drained, so each of them is lost).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _reliability import ReliabilityEngine, spec_for

    from kvguard.chaos.faults import SCHEDULER_CLS

    spec = spec_for(Path(sys.argv[1]))
    if os.environ.get("KVGUARD_FAULTS"):  # faults live in the chaos scheduler
        spec = dataclasses.replace(spec, extra={**spec.extra, "scheduler_cls": SCHEDULER_CLS})
    engine = ReliabilityEngine(spec, enabled=True)
    engine.mixed_round()
    g = engine.g
    g.publish()
    assert g.publisher.flush(30.0)
    pool = engine.scheduler.kv_cache_manager.block_pool
    held = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt > 0)
    print(json.dumps({"epoch": g.epoch, "checkpoints": len(g.reports),
                      "verdict": g.reports[-1].verdict.value, "held_blocks": held}), flush=True)
    os._exit(0)  # an engine process that ends; nothing else to shut down
