"""A listening Unix socket for processes of one node: the output sockets of the workers (``worker/output_socket.py``)
and the prefill workers' dispatch sockets (``bucket_manager/dispatch_socket.py``) both stand on it.

On Linux the socket has an abstract name (nothing is left on disk when a killed process cannot clean up) and a
connection from another user is refused; elsewhere it lives in a private directory (mode 0700).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable

logger = logging.getLogger(__name__)


def this_node_id() -> str:
    """This process's Ray node id, "" where Ray is not running: a peer takes a local socket only when the id it was
    handed with the socket's path is its own node's."""
    import ray  # here, not at the top: the sockets themselves need no Ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def peer_uid(conn: socket.socket) -> int | None:
    """The connecting process's user id (Linux), None where the platform does not tell."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from a blocking socket, or None when the stream ends first (also part-way)."""
    parts, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class LocalListener:
    """Listens on a new Unix socket (``path``) and hands each accepted connection of this user to ``accept(conn)``
    on the accept thread (a slow ``accept`` holds up the next connection); ``accept`` owns the connection."""

    def __init__(self, kind: str, accept: Callable[[socket.socket], None], thread_name: str) -> None:
        self._accept = accept
        self._kind = kind
        self._dir: str | None = None
        if sys.platform == "linux":
            self.path = f"\0bucketserve-{kind}-{uuid.uuid4().hex}"
        else:
            self._dir = tempfile.mkdtemp(prefix=f"bucketserve-{kind}-")
            self.path = os.path.join(self._dir, f"{kind}.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                logger.exception("%s socket: accept failed", self._kind)
                continue
            uid = peer_uid(conn)
            if uid is not None and uid != os.getuid():
                logger.warning(
                    "%s socket: refused a connection of user %d, not this process's", self._kind, uid
                )
                conn.close()
                continue
            self._accept(conn)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        self._thread.join(timeout=2.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
