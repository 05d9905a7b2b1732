"""http(s) image URLs through the stack, against image servers on loopback.

The SSRF guard is on. 127.0.0.2 is opted in (fetch_allowed_networks), so
fetches from it work; 127.0.0.1 is refused under every spelling, including
when a redirect from the allowed server points at it. No traffic leaves
loopback: refused addresses are never connected to.
"""

from __future__ import annotations

import gzip
import re
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from gateway.intake.memory import BODY_COPIES
from testing.stack import free_port
from tests.integration.conftest import ALLOWED_LOOPBACK, MAX_IMAGE_BYTES, MODEL_NAME
from tests.integration.corpus import b64, save, scene
from tests.integration.helpers import metric_total
from tests.waiting import wait_until

PNG = save(scene((120, 90), "fetched"), "PNG")


class ImageServer(BaseHTTPRequestHandler):
    refused_port = 0  # the 127.0.0.1 server's port, for redirects into it
    slow_fates: list[str] = []  # per /slow request: "hung up" (the client gave up first) or "answered"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path
        if path == "/ok.png":
            self._send(200, PNG, {"Content-Type": "text/html"})  # the bytes decide, not the type
        elif path.startswith("/hop/"):
            left = int(path.removeprefix("/hop/"))
            self._send(302, headers={"Location": f"/hop/{left - 1}" if left else "/ok.png"})
        elif path == "/to-refused":
            self._send(302, headers={"Location": f"http://127.0.0.1:{self.refused_port}/ok.png"})
        elif path == "/to-localhost":
            self._send(302, headers={"Location": f"http://localhost:{self.refused_port}/ok.png"})
        elif path == "/huge":
            self._stream_huge()
        elif path == "/huge-declared":
            self._send(200, b"\x89PNG", {"Content-Length": str(MAX_IMAGE_BYTES * 10)})
        elif path == "/gzipped":  # served compressed whatever was asked: a 64 KiB body could inflate to gigabytes
            self._send(200, gzip.compress(PNG), {"Content-Encoding": "gzip", "Content-Type": "image/png"})
        elif path == "/slow":
            self._slow()
        elif path == "/slow-body":
            self._slow_body()
        elif path == "/late-404":  # after the other fetches of its request have started
            time.sleep(0.5)
            self._send(404, b"not here")
        else:
            self._send(404, b"not here")

    def _slow(self) -> None:
        """Answers after 6 s, past the gateway's fetch timeouts (the behaviour under test),
        unless the client hangs up first; which of the two happened goes in `slow_fates`."""
        if self._waited_out(6):
            self._send(200, PNG)

    def _slow_body(self) -> None:
        """Declares the largest image taken, sends its first bytes, then stalls as `_slow` does: a
        fetch that runs on holds twice the declared length of the memory budget meanwhile."""
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(MAX_IMAGE_BYTES))
        self.end_headers()
        self.wfile.write(PNG[:8])
        self.wfile.flush()
        self._waited_out(6)

    def _waited_out(self, seconds: float) -> bool:
        """True once `seconds` passed; False if the client hung up first (`slow_fates` says which)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self.connection], [], [], left)[0]:
                break
            try:
                hung_up = self.connection.recv(1, socket.MSG_PEEK) == b""
            except ConnectionError:
                hung_up = True
            if hung_up:
                ImageServer.slow_fates.append("hung up")
                return False
            time.sleep(max(0.0, deadline - time.monotonic()))  # bytes from the client, not a hang-up: wait it out
        ImageServer.slow_fates.append("answered")
        return True

    def _stream_huge(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"\x89PNG" + bytes(65532)
        try:
            for _ in range(MAX_IMAGE_BYTES // len(chunk) + 64):
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway stopped reading at its cap


def serve(host: str) -> tuple[ThreadingHTTPServer, int]:
    port = free_port()
    server = ThreadingHTTPServer((host, port), ImageServer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port


@pytest.fixture(scope="module")
def servers():
    refused, refused_port = serve("127.0.0.1")
    allowed, allowed_port = serve(ALLOWED_LOOPBACK)
    ImageServer.refused_port = refused_port
    yield f"http://{ALLOWED_LOOPBACK}:{allowed_port}", refused_port
    refused.shutdown()
    allowed.shutdown()


def fetch_through(stack, url: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def test_allowed_loopback_fetch_equals_the_same_image_as_data_url(stack, servers):
    allowed, _ = servers
    fetched = fetch_through(stack, f"{allowed}/ok.png")
    inline = fetch_through(stack, b64(PNG))
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"] == inline.json()["choices"]


SPELLINGS = ["127.0.0.1", "localhost", "2130706433", "0177.0.0.1", "0x7f.0.0.1", "127.1", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "0.0.0.0"]


@pytest.mark.parametrize("host", SPELLINGS)
def test_every_spelling_of_loopback_is_refused(stack, servers, host):
    _, refused_port = servers
    response = fetch_through(stack, f"http://{host}:{refused_port}/ok.png")
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "refused" in message and message.startswith("messages[0].content[0]")


@pytest.mark.parametrize("path", ["/to-refused", "/to-localhost"])
def test_redirect_into_a_refused_address_is_refused(stack, servers, path):
    allowed, _ = servers
    response = fetch_through(stack, f"{allowed}{path}")
    assert response.status_code == 400 and "does not resolve to a public address" in response.json()["error"]["message"]


def test_redirects_are_followed_up_to_the_cap(stack, servers):
    allowed, _ = servers
    assert fetch_through(stack, f"{allowed}/hop/2").status_code == 200  # 3 redirects: at the cap
    over = fetch_through(stack, f"{allowed}/hop/3")
    assert over.status_code == 400 and "more than 3 redirects" in over.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/huge", "/huge-declared"])
def test_byte_cap_is_enforced_while_streaming(stack, servers, path):
    allowed, _ = servers
    response = fetch_through(stack, f"{allowed}{path}")
    assert response.status_code == 413 and f"the limit is {MAX_IMAGE_BYTES} bytes" in response.json()["error"]["message"]


def test_slow_server_is_a_504_within_the_total_timeout(stack, servers):
    allowed, _ = servers
    ImageServer.slow_fates.clear()
    response = fetch_through(stack, f"{allowed}/slow")
    message = response.json()["error"]["message"]
    assert response.status_code == 504 and "timed out" in message and re.search(r"gateway\.fetch_(read|total)_timeout_s", message)
    # The gateway gave up (total timeout 4 s) before the server answered (6 s): it hung up first.
    wait_until(lambda: ImageServer.slow_fates, 10, "the slow server seeing the fetch end")
    assert ImageServer.slow_fates and set(ImageServer.slow_fates) == {"hung up"}, ImageServer.slow_fates


def test_upstream_error_status_is_a_clear_400(stack, servers):
    allowed, _ = servers
    response = fetch_through(stack, f"{allowed}/missing.png")
    assert response.status_code == 400 and "HTTP 404" in response.json()["error"]["message"]


def test_a_compressed_body_is_refused_not_inflated(stack, servers):
    """The fetch asks for identity; a body sent compressed anyway is never inflated past the byte cap's back."""
    allowed, _ = servers
    response = fetch_through(stack, f"{allowed}/gzipped")
    assert response.status_code == 400 and "gzip-encoded body" in response.json()["error"]["message"], response.text


def test_a_url_with_a_control_character_is_a_400(stack, servers):
    allowed, _ = servers
    response = fetch_through(stack, f"{allowed}/a\x7f.png")
    assert response.status_code == 400 and "invalid URL" in response.json()["error"]["message"], response.text


def test_a_request_refused_for_one_image_stops_fetching_its_others(stack, servers):
    """Its other fetches are cancelled before the 400 leaves: they no longer run on to their
    timeout, each holding its share of the memory budget, behind an answered request."""
    allowed, _ = servers
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"{allowed}/slow-body"}},
        {"type": "image_url", "image_url": {"url": f"{allowed}/late-404"}}]}]}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "HTTP 404" in response.json()["error"]["message"]
    # Run on, the stalled fetch would hold twice its declared length until its total timeout (4 s): it is back.
    assert metric_total(stack, "prism_gateway_memory_held_bytes") < BODY_COPIES * MAX_IMAGE_BYTES
