"""A worker's output socket (``worker/output_socket.py``) with its output buffers: a same-node gateway attaches and
reads each put as a frame; what the socket cannot carry whole goes to the drain, never lost and never twice."""

from __future__ import annotations

import asyncio
import pickle
import socket
import time

import pytest
import uvloop

from engine.request import RequestOutput
from worker.outbox import OutputBuffers
from worker.output_socket import OutputSocketServer, connect_output_socket, encode_hello
from worker.output_socket import read_frame as read_frame_async


def out(rid: str, n: int) -> RequestOutput:
    return RequestOutput(rid, [n], [0.0], False, None, 3, n + 1)


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None at the end of the stream (a partial frame at the end counts as none)."""
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_frame(sock: socket.socket) -> list[RequestOutput] | None:
    head = recv_exactly(sock, 4)
    if head is None:
        return None
    body = recv_exactly(sock, int.from_bytes(head, "big"))
    return None if body is None else pickle.loads(body)


def attach(server: OutputSocketServer, buffers: OutputBuffers, consumer_id: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.path)
    sock.sendall(encode_hello(consumer_id))
    deadline = time.monotonic() + 5
    while not _attached(buffers, consumer_id):
        assert time.monotonic() < deadline, "the server never attached the connection"
        time.sleep(0.005)
    return sock


def _attached(buffers: OutputBuffers, consumer_id: str) -> bool:
    with buffers._cond:
        c = buffers._consumers.get(consumer_id)
        return c is not None and c.sink is not None


@pytest.fixture
def served():
    buffers = OutputBuffers()
    server = OutputSocketServer(buffers.attach, "test")
    yield buffers, server
    server.close()
    buffers.close()


def test_outputs_put_after_attaching_arrive_on_the_socket_in_order_and_not_by_drain(served):
    buffers, server = served
    buffers.put("gw", [out("a", 0)])  # before the gateway attached: waits for its drain
    sock = attach(server, buffers, "gw")
    sock.settimeout(5)
    buffers.put_many([("gw", out("a", 1)), ("other", out("b", 0)), ("gw", out("c", 0))])
    buffers.put("gw", [out("a", 2)])
    assert [(o.request_id, o.new_token_ids) for o in read_frame(sock)] == [("a", [1]), ("c", [0])]
    assert [(o.request_id, o.new_token_ids) for o in read_frame(sock)] == [("a", [2])]
    _, drained = buffers.drain("gw", 0.0)
    assert [(o.request_id, o.new_token_ids) for o in drained] == [("a", [0])]
    _, other = buffers.drain("other", 0.0)  # a consumer without a socket drains as before
    assert [o.request_id for o in other] == ["b"]
    assert (buffers.sent_by_socket, buffers.sent_by_drain) == (3, 2)
    sock.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_gateways_event_loop_attaches_and_reads_frames(served, loop):
    """The gateway's way in (a Serve replica runs uvloop, whose own Unix connect refuses the abstract name)."""
    buffers, server = served

    async def gateway() -> list[str]:
        reader, writer = await asyncio.open_unix_connection(sock=connect_output_socket(server.path))
        writer.write(encode_hello("gw"))
        await writer.drain()
        while not _attached(buffers, "gw"):
            await asyncio.sleep(0.005)
        buffers.put("gw", [out("a", 0), out("b", 0)])
        got = await read_frame_async(reader)
        writer.close()
        return [o.request_id for o in got]

    run = asyncio.run if loop == "asyncio" else uvloop.run
    assert run(asyncio.wait_for(gateway(), 10)) == ["a", "b"]


def test_a_gateway_that_stops_reading_loses_nothing_the_rest_goes_by_drain(served):
    buffers, server = served
    sock = attach(server, buffers, "gw")
    # Put more than the socket buffers while nobody reads (how much it buffers depends on the kernel's limits), then
    # 100 more: the engine's thread must never block on it.
    big = "x" * 2000
    t0 = time.monotonic()
    n = 0
    while _attached(buffers, "gw"):
        assert n < 20_000, "40 MB put and the socket still takes them"
        buffers.put("gw", [RequestOutput(big, [n], [0.0], False, None, 3, n + 1)])
        n += 1
    for _ in range(100):
        buffers.put("gw", [RequestOutput(big, [n], [0.0], False, None, 3, n + 1)])
        n += 1
    assert time.monotonic() - t0 < 30, "puts blocked on a gateway that does not read"
    sock.settimeout(5)
    got: list[int] = []
    while (frame := read_frame(sock)) is not None:  # the complete frames, then the end of the stream
        got += [o.new_token_ids[0] for o in frame]
    _, drained = buffers.drain("gw", 0.0)
    rest = [o.new_token_ids[0] for o in drained]
    assert got and rest, (len(got), len(rest))
    assert got + rest == list(range(n)), "an output was lost or came twice"
    assert buffers.sent_by_socket == len(got) and buffers.sent_by_drain == len(rest)
    # The gateway attaches again: outputs go by socket again.
    again = attach(server, buffers, "gw")
    again.settimeout(5)
    buffers.put("gw", [out("z", 0)])
    assert [o.request_id for o in read_frame(again)] == ["z"]
    again.close()


def test_a_closed_gateway_socket_sends_the_outputs_by_drain(served):
    buffers, server = served
    sock = attach(server, buffers, "gw")
    sock.close()
    for i in range(3):  # the first write may still land in the closed peer's buffer; a later one fails
        buffers.put("gw", [out("a", i)])
    assert not _attached(buffers, "gw")
    _, drained = buffers.drain("gw", 0.0)
    assert drained and [o.new_token_ids[0] for o in drained] == list(range(3 - len(drained), 3))


def test_a_connection_that_does_not_name_its_consumer_is_refused_and_the_server_goes_on(served):
    buffers, server = served
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bad.connect(server.path)
    bad.sendall((0).to_bytes(2, "big"))  # an empty consumer id
    bad.settimeout(5)
    assert bad.recv(1) == b"", "the server kept a connection without a consumer id"
    bad.close()
    good = attach(server, buffers, "gw")
    good.settimeout(5)
    buffers.put("gw", [out("a", 0)])
    assert [o.request_id for o in read_frame(good)] == ["a"]
    good.close()


def test_a_closed_server_takes_no_connection():
    buffers = OutputBuffers()
    server = OutputSocketServer(buffers.attach, "test")
    server.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        sock.connect(server.path)
    sock.close()


def test_a_consumer_id_must_be_short_and_non_empty():
    with pytest.raises(ValueError, match="consumer id"):
        encode_hello("")
    with pytest.raises(ValueError, match="consumer id"):
        encode_hello("g" * 300)
