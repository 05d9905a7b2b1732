"""How vLLM's own processes wait for each other: spinning, or short sleeps.

vLLM's engine core and its workers hand each step over through shared memory
and, between steps, wait by calling `sched_yield` in a loop for up to a second
after the last message (vLLM's shm_broadcast; upstream issues #19036, #28836
and the open PRs #52814, #52848 that would make it configurable). During a
generation that loop never ends: it holds a core from the first token to the
last. On a GPU host with cores to spare that buys a few microseconds a step.
On a small CPU machine it takes the core the gateway, the encoder and every
client need: on the 2-core machines here, a process waiting for a socket or a
timer was not run for 1.6-35 s during a long decode, so a client's hang-up or
a new request was seen only when the generation ended (docs, Known issues).

With `engine.shm_wait_sleep_us` > 0, each of those checks sleeps instead: the
kernel gets the core back between checks. The vLLM processes are spawned
(fresh interpreters), so the change travels the only way into them that needs
no change to vLLM: the environment. `PYTHONPATH` gains `vllm_site/`, whose
`sitecustomize` (imported by every Python start-up) swaps `os.sched_yield`,
the call vLLM's wait makes, for the sleep. `python -m bench.shm_wait` measures
both settings side by side.
"""

from __future__ import annotations

import os
from pathlib import Path

SITE_DIR = Path(__file__).with_name("vllm_site")
SLEEP_ENV = "PRISM_SHM_WAIT_SLEEP_US"


def sleep_in_spawned_vllm_processes(sleep_us: int) -> None:
    """Call before vLLM starts: the processes it spawns inherit the environment."""
    if sleep_us <= 0:
        return
    os.environ[SLEEP_ENV] = str(sleep_us)
    paths = [str(SITE_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
