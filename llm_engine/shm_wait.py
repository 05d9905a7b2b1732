"""How vLLM's own processes wait for each other: spinning, or short sleeps.

vLLM's engine core and its workers hand each step over through shared memory
and, between steps, wait by calling `sched_yield` in a loop for up to a second
after the last message (vLLM's shm_broadcast; upstream issues #19036, #28836
and the open PRs #52814, #52848 that would make it configurable). During a
generation that loop never ends: it holds a core from the first token to the
last. On a GPU host with cores to spare that buys a few microseconds a step.
On a small CPU machine it takes the core the gateway, the encoder and every
client need: on a 2-core machine a process waiting for a socket or a timer
was not run for seconds during a long decode, so a client's hang-up or a new
request was seen only when the generation ended (docs/architecture.md, Known
issues).

With `engine.shm_wait_sleep_us` > 0, each of those checks sleeps instead: the
kernel gets the core back between checks. The setting reaches vLLM's spawned
processes through the environment (llm_engine/spawned.py), where
`vllm_site/sitecustomize.py` swaps `os.sched_yield`, the call vLLM's wait
makes, for the sleep. `python -m bench.shm_wait` measures both settings side
by side.
"""

SLEEP_ENV = "PRISM_SHM_WAIT_SLEEP_US"
