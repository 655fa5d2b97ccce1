"""Shared-memory staging for the same-node fast path: the sender owns a ring of fixed-size slots
in one ``multiprocessing.shared_memory`` segment; the receiver maps it once and copies each chunk
straight from the slot into its cache. The ring bounds the sender's memory and is reused across
transfers, so no page is faulted in per transfer and nothing is serialised."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from functools import lru_cache
from multiprocessing import resource_tracker, shared_memory
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


# Segments created by this process: its tracker must keep them (a receiver in the same process
# must not unregister them).
_OWN_SEGMENTS: set[str] = set()


class ShmRing:
    """Sender side: a pool of slots; ``acquire`` blocks (bounded) when every slot is in flight."""

    def __init__(self, total_bytes: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = max(1, total_bytes // slot_bytes)
        self.shm = shared_memory.SharedMemory(create=True, size=self.num_slots * slot_bytes)
        self.name = self.shm.name
        _OWN_SEGMENTS.add(self.name)
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
        _OWN_SEGMENTS.discard(self.name)


class ShmAttachments:
    """Receiver side: segments opened by name, kept open for the life of the receiver."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> shared_memory.SharedMemory:
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                seg = shared_memory.SharedMemory(name=name, create=False)
                # Opening registers the segment with this process's resource tracker, which would
                # unlink it at exit although the sender owns it.
                if name not in _OWN_SEGMENTS:
                    with contextlib.suppress(Exception):
                        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
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
