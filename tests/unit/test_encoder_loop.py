"""One turn of the encoder's loop reads a bounded number of messages, so a stream of
requests faster than the loop reads them cannot keep batches from finishing and starting."""

from __future__ import annotations

from vision_encoder.service import MESSAGES_PER_TURN, EncoderService


class WaitingMessages:
    """The router's side the loop reads: `count` messages waiting."""

    def __init__(self, count: int) -> None:
        self.count = count

    def poll(self, timeout_ms: int) -> bool:
        return self.count > 0

    def recv(self):
        self.count -= 1
        return b"gateway", f"message {self.count}", []


def test_a_turn_reads_at_most_its_share_of_the_waiting_messages():
    service = EncoderService.__new__(EncoderService)  # only the loop's reading, no tower
    service.router = WaitingMessages(MESSAGES_PER_TURN * 3 + 1)
    handled: list = []
    service._handle_safely = lambda peer, message, frames: handled.append(message)
    service._drain()
    assert len(handled) == MESSAGES_PER_TURN  # the rest wait for the next turn: the poller reports them at once
    service._drain(), service._drain(), service._drain()
    assert len(handled) == MESSAGES_PER_TURN * 3 + 1 and service.router.count == 0
