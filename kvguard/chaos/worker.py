"""Child process of ``kvguard chaos``: run one scenario, print its result as one JSON line.

``python -m kvguard.chaos.worker NAME WORKDIR [sync|async]``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from kvguard.chaos.runner import RESULT_PREFIX, run_in_this_process
from kvguard.testing.scheduling import Scheduling


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    name, workdir = argv[0], Path(argv[1])
    scheduling = Scheduling(argv[2]) if len(argv) > 2 else Scheduling.SYNC
    result = run_in_this_process(name, workdir, scheduling)
    sys.stdout.write(RESULT_PREFIX + result.model_dump_json() + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine's threads and vLLM's teardown add seconds and nothing of value here.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
