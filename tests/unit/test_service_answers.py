"""What the gateway's client of a service does with answers it cannot use (gateway/routing/clients.py),
over real sockets: a service of another kind at the address is refused, saying so, and nothing one
message does ends the client's only reader (every request to the service would wait out its
timeout, and the service's restarts would go unseen)."""

from __future__ import annotations

import asyncio
import logging

from gateway.routing.clients import EngineClient
from protocol.base import Hello
from protocol.stats import EngineStats
from protocol.to_engine import EngineInbound
from protocol.to_gateway import EncoderReady, ProcessorInfo
from tests.unit.test_client_cancellation import client_and_service
from tests.waiting import wait_until_async


def test_an_encoder_at_an_engine_s_address_is_refused_and_the_reader_outlives_a_message_it_fails_on(tmp_path, caplog):
    async def run() -> None:
        async with client_and_service(tmp_path, "engine", EngineClient, EngineInbound) as (client, service):
            await client._send_quietly(Hello("gateway"))
            peer, _, _ = await asyncio.wait_for(service.recv(), 5)
            with caplog.at_level(logging.ERROR, logger="prism.gateway"):
                await service.send(peer, EncoderReady("m", "fingerprint", ProcessorInfo(14, 2, 3136, 19600)))
                await wait_until_async(lambda: "answers as another kind of service (EncoderReady)" in caplog.text, 5,
                                       "the mixed-up answer logged")
                client._heartbeat = lambda stats: 1 / 0
                await service.send(peer, EngineStats("boot", 0, 0, 0, 0))
                await wait_until_async(lambda: "could not be taken" in caplog.text, 5, "the failure logged")
            del client._heartbeat  # the class's own again
            await service.send(peer, EngineStats("boot", 0, 0, 0, 0))
            await wait_until_async(lambda: client.stats is not None, 5, "the next heartbeat taken: the reader lives")
            assert client.info is None

    asyncio.run(run())



def test_a_first_heartbeat_from_another_process_than_answered_the_handshake_is_a_restart(tmp_path):
    """Restarted between its handshake and its first heartbeat (maybe with another config), the new
    process must answer a handshake of its own before it serves, as any restarted one does."""
    from protocol.stats import ServiceState
    from protocol.to_gateway import EngineReady

    async def run() -> tuple[bool, bool]:
        async with client_and_service(tmp_path, "engine", EngineClient, EngineInbound) as (client, service):
            client.info = EngineReady("m", 4096, boot_id="first")  # the handshake's answer
            await client._send_quietly(Hello("gateway"))
            peer, _, _ = await asyncio.wait_for(service.recv(), 5)
            await service.send(peer, EngineStats("second", 0, 0, 0, 0, ServiceState.SERVING))
            await wait_until_async(lambda: client.stats is not None, 5, "the heartbeat taken")
            return client.rejoining, client.up

    assert asyncio.run(run()) == (True, False)


def test_a_restarted_process_that_serves_what_its_predecessor_did_is_taken_back_whatever_its_boot_id(tmp_path):
    """Its Ready differs from the last one only by the process (boot id): alike, so a client no pool judges
    takes it back, as it did before Ready carried the boot id."""
    from protocol.stats import ServiceState
    from protocol.to_gateway import EngineReady

    async def run() -> bool:
        async with client_and_service(tmp_path, "engine", EngineClient, EngineInbound) as (client, service):
            client.info = EngineReady("m", 4096, boot_id="first")
            client.stats = EngineStats("second", 0, 0, 0, 0, ServiceState.SERVING)
            client.rejoining = True
            client._received(EngineReady("m", 4096, boot_id="second"), [])
            return client.up and not client.rejoining

    assert asyncio.run(run())


async def _start_up_error(tmp_path, answer) -> str:
    """What a handshake with a service that answers every Hello with `answer(service, peer, hello)` ends in."""
    async with client_and_service(tmp_path, "engine", EngineClient, EngineInbound) as (client, service):
        async def answering() -> None:
            while True:
                peer, hello, _ = await service.recv()
                await answer(service, peer, hello)

        answers = asyncio.create_task(answering())
        client.up = False  # not yet handshaken
        try:
            await client.connect(timeout_s=3)
        except RuntimeError as exc:
            assert not client.up
            return str(exc)
        finally:
            answers.cancel()
    return "connected"


def test_a_service_of_another_wire_version_is_named_as_such_when_the_handshake_times_out(tmp_path, caplog):
    """It answers every hello with the version it speaks (protocol/base.py): the gateway neither serves
    with it nor says it "did not answer"."""
    from protocol.base import PROTOCOL, WrongProtocol

    async def another_version(service, peer, hello) -> None:
        assert hello.protocol == PROTOCOL
        await service.send(peer, WrongProtocol(PROTOCOL + 1))

    with caplog.at_level(logging.ERROR, logger="prism.gateway"):
        said = asyncio.run(_start_up_error(tmp_path, another_version))
    assert f"speaks wire protocol v{PROTOCOL + 1}, this gateway v{PROTOCOL}, and served nothing within 3 s" in said, said
    assert caplog.text.count(f"speaks wire protocol v{PROTOCOL + 1}") == 1  # logged once, not at every hello


def test_a_service_of_a_release_from_before_wire_versions_is_named_as_such(tmp_path):
    """It reads the new Hello (its version is a trailing field it ignores) and answers in a tag with no
    version: unreadable here, but the start-up error says why."""
    import msgspec

    from protocol.base import PROTOCOL

    async def an_old_release(service, peer, _hello) -> None:
        await service.socket.send_multipart([peer, msgspec.msgpack.encode(["EngineReady", "m", 4096])])

    said = asyncio.run(_start_up_error(tmp_path, an_old_release))
    assert f"speaks wire protocol v0, this gateway v{PROTOCOL}" in said, said


def test_a_resend_to_the_same_engine_goes_under_another_id_so_the_last_try_s_late_tokens_reach_no_stream(tmp_path):
    """A re-encode (or a failover back) sends a request to an engine that may still be streaming its
    last try: the deltas already on their way after its abort must not land in the new try's stream."""
    from protocol.to_engine import AbortGenerate, GenerateRequest
    from protocol.to_gateway import TokenDelta

    async def run() -> tuple[list[str], list[int]]:
        async with client_and_service(tmp_path, "engine", EngineClient, EngineInbound) as (client, service):
            first = client.generate(GenerateRequest("r", b"{}"), timeout_s=5)
            pending = asyncio.ensure_future(anext(first))
            peer, sent, _ = await asyncio.wait_for(service.recv(), 5)
            await service.send(peer, TokenDelta("r", [], 1, 1))
            await pending
            await first.aclose()  # given up (a re-encode): aborted
            second = client.generate(GenerateRequest("r", b"{}"), timeout_s=5)
            pending = asyncio.ensure_future(anext(second))
            ids = [sent.request_id]
            while len(ids) < 3:  # the abort, then the resend
                _, message, _ = await asyncio.wait_for(service.recv(), 5)
                ids.append(message.request_id if isinstance(message, GenerateRequest) else f"abort:{message.request_id}"
                           if isinstance(message, AbortGenerate) else type(message).__name__)
            await service.send(peer, TokenDelta("r", [], 7, 1))  # the first try's, late
            await service.send(peer, TokenDelta(ids[-1], [], 2, 1, finished=True))
            got = [(await pending).completion_tokens] + [delta.completion_tokens async for delta in second]
            return ids, got

    ids, got = asyncio.run(run())
    assert ids == ["r", "abort:r", "r~1"] and got == [2], (ids, got)
