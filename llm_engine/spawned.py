"""What Prism changes in the processes vLLM spawns (its engine core and
workers). They are fresh interpreters, so the only way in that needs no change
to vLLM is the environment: `PYTHONPATH` gains `vllm_site/`, whose
`sitecustomize` runs at every Python start-up there. Fresh because Prism has
vLLM spawn them (`VLLM_WORKER_MULTIPROC_METHOD=spawn`): vLLM forks by default
where CUDA is not initialised yet, which is a GPU host starting its engine, and
a forked process runs no `sitecustomize`. It installs
- the embedding-length fix for LLaVA-NeXT / OneVision
  (vllm_site/prism_embedding_shapes.py), always;
- the short sleep in vLLM's wait loop (shm_wait.py), when
  `engine.shm_wait_sleep_us` > 0.
"""

from __future__ import annotations

import os
from pathlib import Path

from llm_engine.shm_wait import SLEEP_ENV

SITE_DIR = Path(__file__).with_name("vllm_site")


def customize_spawned_vllm_processes(shm_wait_sleep_us: int) -> None:
    """Call before vLLM starts: the processes it spawns inherit the environment."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if shm_wait_sleep_us > 0:
        os.environ[SLEEP_ENV] = str(shm_wait_sleep_us)
    paths = [str(SITE_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
