"""What the integration tests start ahead of need, so that it starts while the
unit tests run (they keep about one core busy) rather than in front of the
first test that needs it.

- The vLLM reference runs (`Reference`): one at a time, in the order they were
  queued, on a thread of their own (`ReferenceRunner`), so that they add one
  vLLM run to what starts at once, not six.
- The session's stack (`SessionStack`): launched beside the first reference
  (and test_api_parity's vLLM server), and waited for by the first test that
  uses it.

`conftest.pytest_collection_finish` queues what the collected tests need. A
fixture asks for the same objects and waits for them; a test run alone
queues and waits for its own at once.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack, log_tail
from tests.integration.cases import write_images

REFERENCE_TIMEOUT_S = 600  # one run's limit, once it has started


class Reference:
    """A vLLM reference run (reference_vllm.py) over the test cases, in a child process."""

    def __init__(self, out: Path, images: Path, log: Path, model: Path = RANDOM_MODEL, videos: bool = False,
                 cases: list[str] | None = None) -> None:
        """`cases`: the names of cases.CASES to answer (all when None)."""
        self.out = out
        self.log = log
        self.command = ([sys.executable, str(Path(__file__).with_name("reference_vllm.py")), str(model), str(images), str(out)]
                        + (["--videos"] if videos else []) + (["--cases", ",".join(cases)] if cases is not None else []))
        self.process: subprocess.Popen | None = None
        self.launched = threading.Event()
        self.launch_error: OSError | None = None
        self._results: dict | None = None

    def launch(self) -> None:
        try:
            self.process = subprocess.Popen(self.command, cwd=REPO_ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        except OSError as exc:  # told to its test, which would otherwise wait for a run that never comes
            self.launch_error = exc
        self.launched.set()

    def results(self) -> dict:
        if self._results is None:
            if not self.launched.wait(timeout=REFERENCE_TIMEOUT_S * 4):  # the runs queued before it
                raise TimeoutError(f"vLLM reference run for {self.out} never started")
            if self.launch_error is not None:
                raise RuntimeError(f"vLLM reference run for {self.out} could not start: {self.launch_error}")
            if self.process.wait(timeout=REFERENCE_TIMEOUT_S) != 0:
                raise RuntimeError(f"vLLM reference run failed; the end of {self.log}:\n{log_tail(self.log)}")
            self._results = json.loads(self.out.read_text())
        return self._results

    def __getitem__(self, case: str) -> dict:
        return self.results()[case]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


class ReferenceRunner:
    """Runs queued references one after another on a daemon thread."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Reference | None] = queue.Queue()
        self._all: list[Reference] = []
        self._lock = threading.Lock()  # a run launches, or the runner stops: never both at once
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="vllm-references", daemon=True)
        self._thread.start()

    def queue(self, reference: Reference) -> Reference:
        self._all.append(reference)
        self._queue.put(reference)
        return reference

    def _run(self) -> None:
        while (reference := self._queue.get()) is not None:
            with self._lock:
                if self._stopped:
                    return
                reference.launch()
            if reference.process is not None:
                reference.process.wait()

    def stop(self) -> None:
        """Nothing further starts; what runs is killed."""
        with self._lock:
            self._stopped = True
        self._queue.put(None)
        for reference in self._all:
            reference.stop()


class SessionStack:
    """The session's stack (`stack_overrides` on the demo model) and its reference run."""

    def __init__(self, tmp, runner: ReferenceRunner, stack_overrides: dict[str, str]) -> None:
        self.tmp = tmp  # pytest's TempPathFactory
        self.runner = runner
        self.stack_overrides = stack_overrides
        self._images: dict[str, Path] | None = None
        self.stack: LocalStack | None = None
        self.reference: Reference | None = None
        self._ready = False

    @property
    def images(self) -> dict[str, Path]:
        if self._images is None:
            self._images = write_images(self.tmp.mktemp("images"))
        return self._images

    def launch(self) -> None:
        if self.stack is not None:
            return
        ensure_demo_model(RANDOM_MODEL)
        run_dir = self.tmp.mktemp("stack")
        self.reference = self.runner.queue(Reference(run_dir / "reference.json", self.image_dir, run_dir / "reference.log"))
        self.stack = LocalStack(run_dir, self.stack_overrides)
        self.stack.launch()

    @property
    def image_dir(self) -> Path:
        return next(iter(self.images.values())).parent

    def started(self) -> tuple[LocalStack, Reference]:
        self.launch()
        if not self._ready:
            self.stack.wait_ready()
            self._ready = True
        return self.stack, self.reference

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
