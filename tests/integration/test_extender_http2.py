"""The extender's HTTP/2 protocol (``gpushared/extender/http/http2.py``) against clients that misbehave: what
it answers is the routes' business (a stand-in here; the real ones over h2 are in test_extender_faults.py),
what is checked is the protocol's — many streams on one connection, flow control both ways, the body limit,
resets, broken frames, idle and stopping connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import uvloop
from h2.errors import ErrorCodes

from gpushared.extender.http.calls import Answer, BodyTooLarge, Call
from gpushared.extender.http.config import ServerConfig
from gpushared.extender.http.http2 import MAX_STREAMS, Http2Protocol
from tests.h2client import H2Client
from tests.harness import wait_until


@dataclass
class StandIn:
    """Routes that echo, answer big, hold until released, or read with a deadline."""

    release: asyncio.Event | None = None
    held: int = 0
    calls: list[Call] = field(default_factory=list)

    async def answer(self, call: Call) -> Answer:
        self.calls.append(call)
        if call.path == "/echo":
            try:
                async with asyncio.timeout(0.5):
                    return Answer(200, await call.read())
            except BodyTooLarge:
                return Answer(413, b"too large")
            except TimeoutError:
                return Answer(408, b"too slow")
        if call.path.startswith("/big/"):
            return Answer(200, b"x" * int(call.path.removeprefix("/big/")))
        if call.path == "/hold":
            assert self.release is not None
            self.held += 1
            await self.release.wait()
            return Answer(200, b"released")
        if call.path == "/boom":
            raise RuntimeError("a bug")
        return Answer(404, b"")


class Server:
    def __init__(self, config: ServerConfig, *, new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.routes = StandIn()
        self.live: set[Http2Protocol] = set()
        self.loop = new_loop()
        started = threading.Event()

        async def main() -> None:
            self.routes.release = asyncio.Event()
            self.server = await self.loop.create_server(
                lambda: Http2Protocol(self.routes, config, live=self.live),  # type: ignore[arg-type]
                "127.0.0.1",
                0,
            )
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(main(), self.loop).result(5)
        started.wait(5)

    def release(self) -> None:
        assert self.routes.release is not None
        self.loop.call_soon_threadsafe(self.routes.release.set)

    def client(self, **kwargs: object) -> H2Client:
        return H2Client(self.port, **kwargs)  # type: ignore[arg-type]

    def stop(self) -> None:
        async def stopping() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stopping(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(params=[asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def new_loop(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop]:
    """The extender runs on uvloop; both loops' transports are held to the protocol."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def server(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> Iterator[Server]:
    served = Server(ServerConfig(max_body_bytes=64 << 10, keepalive_timeout=30), new_loop=new_loop)
    yield served
    served.stop()


def test_many_streams_on_one_connection_each_get_their_own_answer(server: Server) -> None:
    client = server.client()
    sids = [client.open("POST", "/echo", f"body {i}".encode() * (i + 1)) for i in range(50)]
    answers = client.wait(*sids)
    assert [a.body for a in answers] == [f"body {i}".encode() * (i + 1) for i in range(50)]
    assert {a.status for a in answers} == {200}
    assert client.settings[3] == MAX_STREAMS  # SETTINGS_MAX_CONCURRENT_STREAMS, as announced


def test_a_big_answer_waits_for_a_small_client_window(server: Server) -> None:
    client = server.client(window=1000)
    (answer,) = client.wait(client.open("GET", "/big/300000"))
    assert answer.status == 200 and answer.body == b"x" * 300_000
    assert answer.headers["content-length"] == "300000"


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
def test_a_body_past_the_limit_is_413_and_the_rest_is_not_wanted(server: Server, declared: bool) -> None:
    client = server.client()
    headers = {"content-length": str(1 << 20)} if declared else {}
    sid = client.open("POST", "/echo", b"y" * (40 << 10), end=False, headers=headers)
    client.send(sid, b"y" * (40 << 10))  # past 64 KiB: the server stops keeping it
    (answer,) = client.wait(sid)
    assert answer.status == 413
    client.wait(sid)
    client.pump()
    assert answer.reset in (None, ErrorCodes.NO_ERROR)  # answered, then the stream's rest refused
    assert client.request("POST", "/echo", b"small").body == b"small"  # the connection serves on


def test_a_body_that_never_ends_is_408(server: Server) -> None:
    client = server.client()
    sid = client.open("POST", "/echo", b"part", end=False)
    (answer,) = client.wait(sid)
    assert answer.status == 408


def test_resetting_streams_buys_no_more_work_than_waiting_for_answers(server: Server) -> None:
    """The rapid-reset attack: streams opened and reset at once start at most MAX_STREAMS answers."""
    client = server.client()
    for _ in range(3 * MAX_STREAMS):
        client.reset(client.open("GET", "/hold"))
        client.pump(0)
    client.pump(0.5)
    assert server.routes.held <= MAX_STREAMS  # streams reset in the read that opened them start nothing
    while server.routes.held < MAX_STREAMS:  # streams reset after their answer started: up to the bound
        sid = client.open("GET", "/hold")
        client.pump(0.05)
        client.reset(sid)
    client.pump(0.3)
    assert server.routes.held == MAX_STREAMS
    (refused,) = client.wait(client.open("POST", "/echo", b"x"))
    assert refused.reset == ErrorCodes.REFUSED_STREAM and not client.closed, (client.goaway, client.closed)
    server.release()
    client.pump(0.3)  # the held answers finish (theirs are dropped)
    assert client.request("POST", "/echo", b"after").body == b"after"


def test_a_client_that_keeps_every_stream_busy_is_never_refused(server: Server) -> None:
    """kube-scheduler at full rate: MAX_STREAMS calls in flight, a new one as soon as one is answered."""
    client = server.client()
    open_ = {client.open("POST", "/echo", b"%d" % i) for i in range(MAX_STREAMS)}
    sent = MAX_STREAMS
    while open_:
        client.pump(0.05)
        for sid in [s for s in open_ if client.responses[s].done]:
            open_.discard(sid)
            assert client.responses[sid].reset is None and client.responses[sid].status == 200
            if sent < 5 * MAX_STREAMS:
                open_.add(client.open("POST", "/echo", b"%d" % sent))
                sent += 1
    assert len(server.routes.calls) == 5 * MAX_STREAMS


def test_broken_frames_end_that_connection_only(server: Server) -> None:
    client = server.client()
    # A HEADERS frame on stream 0, which no request may use: a connection error
    client.raw(b"\x00\x00\x01\x01\x05\x00\x00\x00\x00\x82")
    client.wait_closed()
    assert client.goaway == ErrorCodes.PROTOCOL_ERROR
    garbage = server.client()
    garbage.raw(b"\xff" * 64)  # a frame header of a length past any frame size
    garbage.wait_closed()
    assert garbage.goaway == ErrorCodes.FRAME_SIZE_ERROR
    assert server.client().request("POST", "/echo", b"still").body == b"still"


def test_a_client_that_floods_pings_and_reads_nothing_is_not_buffered_for(server: Server) -> None:
    """Each PING asks for an acknowledgement; a client that never reads them must not make the server hold
    them all (CVE-2019-9512): once what it owes the client passes the transport's high-water mark, the
    server stops reading from it."""
    client = server.client()
    (connection,) = server.live
    assert connection.transport is not None
    # Small socket buffers on both sides, so what the server owes backs up into its own buffer at once.
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    ping = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678"
    batch = ping * 4096  # 68 KiB of pings
    client.sock.setblocking(False)
    owed = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        with contextlib.suppress(BlockingIOError):
            client.sock.send(batch)
        owed = max(owed, connection.transport.get_write_buffer_size())
        time.sleep(0.001)
    assert owed < 1 << 20, f"{owed} bytes of acknowledgements held for a client that reads nothing"


@pytest.fixture
def impatient(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> Iterator[Server]:
    """A server whose read timeout (also how long an answer may wait for its reader) is half a second."""
    served = Server(ServerConfig(read_timeout=0.5, keepalive_timeout=30), new_loop=new_loop)
    yield served
    served.stop()


def test_an_answer_whose_client_opens_no_window_is_cancelled(impatient: Server) -> None:
    client = impatient.client(window=0)
    (answer,) = client.wait(client.open("GET", "/big/1000"), timeout=5)
    assert answer.status == 200 and answer.reset == ErrorCodes.CANCEL and answer.body == b""
    assert client.request("GET", "/big/0").status == 200  # the connection serves on


def test_a_client_that_reads_no_answer_loses_the_connection(impatient: Server) -> None:
    client = impatient.client(window=1 << 30)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    (connection,) = impatient.live
    assert connection.transport is not None
    connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client.open("GET", f"/big/{32 << 20}")  # and never read again
    wait_until(lambda: not impatient.live, timeout=5, message="the connection closed")
    assert connection.tasks == set()


def test_headers_past_the_list_size_end_the_connection(server: Server) -> None:
    client = server.client()
    client.pump()  # the server's settings, so its header-list size is in force once acknowledged
    client.open("GET", "/echo", headers={"x-big": "z" * (32 << 10)})
    client.wait_closed()
    assert client.goaway is not None and client.goaway != ErrorCodes.NO_ERROR
    assert server.routes.calls == []


def test_a_bug_in_the_routes_is_a_500_not_a_dead_connection(server: Server) -> None:
    client = server.client()
    assert client.request("GET", "/boom").status == 500
    assert client.request("POST", "/echo", b"on").body == b"on"


def test_an_idle_connection_is_sent_away_but_not_one_waiting_for_an_answer(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    server = Server(ServerConfig(keepalive_timeout=0.3), new_loop=new_loop)
    try:
        waiting = server.client()
        sid = waiting.open("GET", "/hold")
        idle = server.client()
        pinging = server.client()
        for _ in range(20):  # pings every 0.1 s do not keep a connection with no request open
            if pinging.closed or pinging.goaway is not None:
                break
            pinging.conn.ping(b"12345678")
            pinging.flush()
            time.sleep(0.1)
            pinging.pump()
        assert pinging.goaway is not None or pinging.closed, "pings kept an idle connection open"
        pinging.wait_closed(timeout=1)
        assert pinging.closed and pinging.goaway == ErrorCodes.NO_ERROR  # within the 2 s of pings
        idle.wait_closed(timeout=5)
        assert idle.goaway == ErrorCodes.NO_ERROR
        waiting.pump(0.6)
        assert not waiting.closed and waiting.goaway is None
        server.release()
        assert waiting.wait(sid)[0].body == b"released"
    finally:
        server.stop()


def test_stopping_answers_what_is_in_flight_refuses_new_streams_then_goaway(server: Server) -> None:
    client = server.client()
    held = client.open("GET", "/hold")
    client.pump(0.3)
    (connection,) = server.live
    draining = asyncio.run_coroutine_threadsafe(connection.drain(10), server.loop)
    wait_until(lambda: connection.draining, timeout=5, message="draining")
    late = client.open("POST", "/echo", b"late")
    assert client.wait(late)[0].reset == ErrorCodes.REFUSED_STREAM
    server.release()
    assert client.wait(held)[0].body == b"released"
    draining.result(5)
    client.wait_closed()
    assert client.goaway == ErrorCodes.NO_ERROR
