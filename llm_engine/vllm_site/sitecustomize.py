"""Imported by every Python process the engine service spawns (vLLM's engine
core and workers), through PYTHONPATH (llm_engine/spawned.py). Two changes:

1. LLaVA-NeXT / OneVision embeddings of different lengths may share a batch
   (prism_embedding_shapes.py says why vLLM needs telling).
2. vLLM's waits between steps call `os.sched_yield()` in a loop; here that call
sleeps `PRISM_SHM_WAIT_SLEEP_US` microseconds instead, so a waiting vLLM
process gives its core back rather than holding it for the whole generation.
   Nothing else in these processes calls `os.sched_yield` from Python; see
   llm_engine/shm_wait.py for why.
"""

import importlib.machinery
import importlib.util
import os
import sys
import time

import prism_embedding_shapes

prism_embedding_shapes.install()

_sleep_s = int(os.environ.get("PRISM_SHM_WAIT_SLEEP_US", "0")) / 1e6

if _sleep_s > 0:

    def _nap() -> None:
        time.sleep(_sleep_s)

    os.sched_yield = _nap


def _run_the_sitecustomize_this_one_hides() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [path for path in sys.path if os.path.abspath(path or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_the_sitecustomize_this_one_hides()
