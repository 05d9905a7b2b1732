"""The test stacks' ports come from outside the kernel's ephemeral range, where vLLM's own bind(0)s draw."""

import socket
from pathlib import Path

from testing import stack
from testing.stack import _ephemeral_ports, free_port, log_tail


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range():
    ports = {free_port() for _ in range(20)}
    assert not ports & set(_ephemeral_ports())
    assert len(ports) > 1  # a random start: two callers rarely meet
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_taken_port_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        candidates = [p for p in range(20000, 32768) if p not in _ephemeral_ports()]
        monkeypatch.setattr(stack.random, "randrange", lambda n: candidates.index(port))  # the search starts there
        assert free_port() != port


def test_the_log_tail_is_the_end_of_the_log(tmp_path: Path):
    log = tmp_path / "stack.log"
    log.write_text("start\n" + "x" * 10_000 + "\nOSError: [Errno 98] address already in use\n")
    tail = log_tail(log)
    assert tail.endswith("address already in use\n") and "start" not in tail
    assert "unreadable" in log_tail(tmp_path / "missing.log")
