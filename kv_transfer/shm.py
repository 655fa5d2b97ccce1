"""Shared-memory staging for the same-node fast path: the sender owns a ring of fixed-size slots
in one ``multiprocessing.shared_memory`` segment; the receiver maps it once and copies each chunk
straight from the slot into its cache. The ring bounds the sender's memory and is reused across
transfers, so no page is faulted in per transfer and nothing is serialised."""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import socket
import threading
from functools import lru_cache
from multiprocessing import shared_memory
from pathlib import Path

from .types import KVTransferError, TransferStatus


@lru_cache(maxsize=1)
def node_id() -> str:
    """Identifies the host (and its boot): two workers with the same id can share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ShmRing:
    """Sender side: a pool of slots; ``acquire`` blocks (bounded) when every slot is in flight."""

    def __init__(self, total_bytes: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = max(1, total_bytes // slot_bytes)
        self.shm = shared_memory.SharedMemory(create=True, size=self.num_slots * slot_bytes)
        self.name = self.shm.name
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(self.num_slots):
            self._free.put(i * slot_bytes)

    def acquire(self, timeout: float) -> int:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise KVTransferError(
                TransferStatus.TIMEOUT, f"no free shared-memory slot within {timeout}s (receiver stalled)"
            ) from None

    def release(self, offset: int) -> None:
        self._free.put(offset)

    def write(self, offset: int, views: list[memoryview]) -> int:
        pos = offset
        for v in views:
            n = v.nbytes
            self.shm.buf[pos : pos + n] = v.cast("B")
            pos += n
        return pos - offset

    def close(self) -> None:
        self.shm.close()
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()


class _Mapping:
    """A segment mapped read/write by name. On Linux it is opened as /dev/shm/<name> directly, which
    keeps it out of this process's resource tracker (the tracker would otherwise unlink the
    sender's segment when this process exits, or double-unregister when the tracker is shared)."""

    def __init__(self, name: str) -> None:
        path = Path("/dev/shm") / name.lstrip("/")
        self._shm: shared_memory.SharedMemory | None = None
        if path.parent.is_dir():
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            self.buf = memoryview(self._mm)
        else:  # other platforms: the portable way
            self._shm = shared_memory.SharedMemory(name=name, create=False)
            self.buf = self._shm.buf

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            return
        self.buf.release()
        self._mm.close()


class ShmAttachments:
    """Receiver side: segments opened by name, kept open for the life of the receiver."""

    def __init__(self) -> None:
        self._segments: dict[str, _Mapping] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> _Mapping:
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                seg = _Mapping(name)
                self._segments[name] = seg
            return seg

    def probe(self, name: str) -> bool:
        try:
            self.get(name)
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        with self._lock:
            for seg in self._segments.values():
                # BufferError: a view of it is still alive; the mapping then goes with the process.
                with contextlib.suppress(BufferError):
                    seg.close()
            self._segments.clear()
