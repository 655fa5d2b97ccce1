"""Same-node wires of pickled frames over a Unix socket, one way: the controller hands a prefill worker each
planned batch here, and a gateway hands the controller each request it submits.

Why: on one node the Ray actor call that hands a prefill worker its batch was the largest part of the unloaded
prefill queue: 1.2-2.6 ms from the controller's send to the worker's ``enqueue`` on a 2-core host (the call
crosses two core workers' threads and waits for the worker's interpreter lock), then 0.2-1.0 ms more for the
worker's loop to wake, against tens of microseconds for a write to a local socket that a thread of the worker
reads. The controller writes a batch here when the worker is on its node and every payload is the message
itself; a batch that holds an object reference (a long prompt left in Ray's object store) goes by the Ray call,
which tracks who borrows the reference, as does every batch when the socket is not there or a write fails.

Nothing is lost by the choice: the worker runs a batch from either path the same way (``enqueue``), and a write
is all or nothing: one the socket cannot take whole closes the connection (the worker drops the partial frame)
and the batch goes by Ray. A worker that dies takes the batches of either path with it, and the controller
re-plans them from its ledger as before.

The gateway's submits (``Controller.submit_channel``) take the same wire for the same reason: the gateway's Ray
call to ``submit`` took 2.0-2.9 ms to reach the controller on a 2-core Zen 5 host, most of an unloaded request's
controller queue (1.6-2.1 ms p50 there, 4.9 ms on a slower Zen 4 host). A submit whose payload is an object reference, or one
the socket does not take whole, goes by the Ray call. Aborts stay on Ray and may overtake a submit still in the
socket: the controller remembers the ids of recent aborts it did not know (``Controller.abort``) and drops a
submit that comes after its abort.

Wire format, one way (writer -> listener): per frame a 4-byte big-endian length and a pickle; a batch is the tuple
``(batch_id, items, dispatched_at, borrow_cores)``, the arguments of ``enqueue``, a submit ``(summary, payload)``.
On Linux the socket has an abstract name (nothing left on disk) and a connection from another user is refused
(``local_socket.py``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import socket
import threading
from collections.abc import Callable
from typing import Any

from bucket_manager.local_socket import LocalListener, recv_exactly

logger = logging.getLogger(__name__)

# A batch is a few KB a prompt; anything near this is not one of ours.
MAX_FRAME_BYTES = 64 << 20
# Room for a burst of batches while the worker's reader waits for the interpreter lock.
SEND_BUFFER_BYTES = 4 << 20

Batch = tuple[int, list[tuple[Any, str]], float, tuple[int, ...]]


class _NoReferences(pickle.Pickler):
    """Pickles a batch unless it holds a Ray object reference, which only Ray's own serialisation may carry
    (it records the borrower; a plain pickle would let the object go before the worker fetched it)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj).__name__ == "ObjectRef" and type(obj).__module__.startswith("ray"):
            raise _HoldsReference
        return NotImplemented


class _HoldsReference(Exception):
    pass


def encode_frame(obj: Any) -> bytes | None:
    """The frame of one batch or submit, or None when it holds an object reference (it goes by Ray)."""
    buf = io.BytesIO()
    buf.write(b"\0\0\0\0")
    try:
        _NoReferences(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except _HoldsReference:
        return None
    frame = buf.getbuffer()
    frame[:4] = (len(frame) - 4).to_bytes(4, "big")
    return bytes(frame)


class DispatchChannel:
    """The writer's end (the controller's to a worker, a gateway's to the controller): a connected, non-blocking socket; :meth:`send` writes one frame whole or closes."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(1.0)
            sock.connect(path)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock: socket.socket | None = sock

    @property
    def open(self) -> bool:
        return self._sock is not None

    def send(self, frame: bytes) -> bool:
        """Whether the whole frame went; False (and the channel closed) when the socket took part of it or none:
        the listener then never sees it, and the caller sends it the other way."""
        if self._sock is None:
            return False
        try:
            sent = self._sock.send(frame)
        except OSError:  # BlockingIOError (full), BrokenPipeError / ConnectionResetError (the reader is gone)
            sent = 0
        if sent == len(frame):
            return True
        self.close()
        return False

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


class FrameListener:
    """The reader's end: listens on a Unix socket and, for each frame of each connection, calls ``handle(obj)``
    with the unpickled frame on the connection's reader thread."""

    def __init__(self, kind: str, handle: Callable[[Any], None], name: str) -> None:
        self._handle = handle
        self._kind = kind
        self._name = name
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.frames = 0  # handled from this socket
        self._listener = LocalListener(kind, self._reader, f"{name}-{kind}")
        self.path = self._listener.path

    def _reader(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        threading.Thread(
            target=self._read_loop, args=(conn,), name=f"{self._name}-{self._kind}-read", daemon=True
        ).start()

    def _read_loop(self, conn: socket.socket) -> None:
        try:
            while not self._listener.closed:
                head = recv_exactly(conn, 4)
                if head is None:
                    return
                size = int.from_bytes(head, "big")
                if size > MAX_FRAME_BYTES:
                    logger.warning("%s socket: a frame of %d bytes; closing the connection", self._kind, size)
                    return
                body = recv_exactly(conn, size)
                if body is None:
                    return  # the writer closed it mid-frame: it sent that one by Ray instead
                try:
                    self._handle(pickle.loads(body))
                    self.frames += 1
                except Exception:
                    # As a failed Ray call would: logged, and the connection kept for the next frame.
                    logger.exception("%s socket: a frame could not be handled", self._kind)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class DispatchListener(FrameListener):
    """A prefill worker's end: calls ``run(batch_id, items, dispatched_at, borrow_cores)`` for each batch."""

    def __init__(self, run: Callable[..., None], name: str = "worker") -> None:
        def handle(batch: Batch) -> None:
            batch_id, items, dispatched_at, cores = batch
            run(batch_id, items, dispatched_at, tuple(cores))

        super().__init__("dispatch", handle, name)

    @property
    def batches(self) -> int:
        """Batches run from this socket."""
        return self.frames
