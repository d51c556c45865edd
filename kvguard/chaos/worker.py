"""Child process of ``kvguard chaos``: run one scenario, print its result as one JSON line."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from kvguard.chaos.runner import RESULT_PREFIX, run_in_this_process


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    name, workdir = argv[0], Path(argv[1])
    result = run_in_this_process(name, workdir)
    sys.stdout.write(RESULT_PREFIX + result.model_dump_json() + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine's threads and vLLM's teardown add seconds and nothing of value here.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
