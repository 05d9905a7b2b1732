"""A child for tests/unit/test_supervisor.py's restart tests: with $CHILD_SLEEPS set it waits
(a service that runs), else it exits at once with $CHILD_EXITS or 3 (a service that fails at
start-up)."""

from __future__ import annotations

import os
import sys
import time

from common.supervisor import stop_with_supervisor

if __name__ == "__main__":
    stop_with_supervisor()
    if os.environ.get("CHILD_SLEEPS"):
        time.sleep(600)
    sys.exit(int(os.environ.get("CHILD_EXITS", 3)))
