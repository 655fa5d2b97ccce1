"""A worker's same-node output channel: a Unix socket that pushes each engine step's outputs to a gateway.

On one node the Ray drain reply is the slow part of a token's way out: 2.5-3 ms p50 from a prefill worker's
``put_many`` to the gateway's awaiting task on a 2-core host (the reply waits for the worker's interpreter lock,
then crosses two core workers' threads), against a few tens of microseconds for a write to a local socket that
the gateway's event loop reads. A gateway on the worker's node connects, names itself (its consumer id), and from
then on :class:`~worker.outbox.OutputBuffers` writes that consumer's outputs to the connection as they are put.

The drain long-poll stays: it is how a gateway learns a worker is alive, and it carries whatever the socket could
not: outputs put before the gateway attached, and those of a write that would block (a gateway that stopped
reading) or failed, after which the worker closes the connection and the gateway attaches again.

Wire format. Gateway -> worker, once: a 2-byte big-endian length and the consumer id in UTF-8. Worker -> gateway,
per put: a 4-byte big-endian length and a pickled ``list[RequestOutput]``. A connection closed in the middle of
a frame loses only that frame on the gateway's side; its outputs go to the drain path instead.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
from typing import TYPE_CHECKING

from bucket_manager.local_socket import LocalListener, recv_exactly

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.request import RequestOutput

logger = logging.getLogger(__name__)

# How long an accepted connection may take to name its consumer.
HELLO_TIMEOUT_S = 5.0
# A consumer id is a short token ("gw-" and 12 hex digits); anything longer is not a gateway.
MAX_CONSUMER_ID = 256
# Room for bursts of outputs while the gateway's loop is busy: a write that would block falls back to the drain.
SEND_BUFFER_BYTES = 4 << 20


def encode_frame(outputs: list[RequestOutput]) -> bytes:
    body = pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL)
    return len(body).to_bytes(4, "big") + body


async def read_frame(reader: asyncio.StreamReader) -> list[RequestOutput]:
    """The next frame of outputs on a gateway's connection; IncompleteReadError at the end of the stream, also in
    the middle of a frame (whose outputs the worker sends by drain instead)."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    return pickle.loads(await reader.readexactly(size))


def encode_hello(consumer_id: str) -> bytes:
    raw = consumer_id.encode()
    if not 0 < len(raw) <= MAX_CONSUMER_ID:
        raise ValueError(f"consumer id must be 1-{MAX_CONSUMER_ID} bytes, got {len(raw)}")
    return len(raw).to_bytes(2, "big") + raw


def connect_output_socket(path: str) -> socket.socket:
    """A connected, non-blocking socket to a worker's output socket, for an event loop's streams. Connected here,
    not by the loop: uvloop's Unix connect refuses abstract names (EINVAL). A local connect does not wait."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(1.0)
        sock.connect(path)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = recv_exactly(sock, n)
    if buf is None:
        raise ConnectionError("closed before the consumer id")
    return buf


class OutputSocketServer:
    """Listens on a Unix socket (``bucket_manager/local_socket.py``: abstract name on Linux, this user only) and
    hands each connecting gateway's connection to ``attach(consumer id, socket)`` (``OutputBuffers.attach``),
    under the consumer id it sends."""

    def __init__(self, attach: Callable[[str, socket.socket], None], name: str = "worker") -> None:
        self._attach = attach
        self._listener = LocalListener("out", self._hello, f"{name}-output-socket")
        self.path = self._listener.path

    def _hello(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            n = int.from_bytes(_recv_exactly(conn, 2), "big")
            if not 0 < n <= MAX_CONSUMER_ID:
                raise ValueError(f"consumer id of {n} bytes")
            consumer_id = _recv_exactly(conn, n).decode()
            # Writes happen on the engine's thread and must never stall it: a full buffer means fall back.
            conn.setblocking(False)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            logger.warning("output socket: refused a connection: %s", e)
            conn.close()
            return
        self._attach(consumer_id, conn)

    def close(self) -> None:
        self._listener.close()
