"""Shared-memory staging for the same-node fast path: the sender owns a ring of fixed-size slots
in one ``multiprocessing.shared_memory`` segment; the receiver maps it once and copies each chunk
straight from the slot into its cache. The ring bounds the sender's memory and is reused across
transfers, so no page is faulted in per transfer and nothing is serialised."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import queue
import socket
import stat
import threading
from collections import OrderedDict
from functools import lru_cache
from multiprocessing import shared_memory
from pathlib import Path

from engine.shm_segment import SEGMENT_NAME_LEN, create_segment, is_segment_name

from .types import KVTransferError, TransferStatus

_SHM_DIR = Path("/dev/shm")


@lru_cache(maxsize=1)
def node_id() -> str:
    """Identifies the host (and its boot): two workers with the same id can share memory. A digest, so a
    peer learns nothing about the host (its name, its boot id) beyond whether it is this one."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).hexdigest()[:32]


def check_segment_name(name: str) -> str:
    """``name`` when it names a segment of ours; else a transfer error (the name is never opened)."""
    if not is_segment_name(name):
        shown = name[: SEGMENT_NAME_LEN + 8] + ("..." if len(name) > SEGMENT_NAME_LEN + 8 else "")
        raise KVTransferError(TransferStatus.INVALID, f"refused shared-memory segment name {shown!r}")
    return name


class ShmRing:
    """Sender side: a pool of slots; ``acquire`` blocks (bounded) when every slot is in flight."""

    def __init__(self, total_bytes: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = max(1, total_bytes // slot_bytes)
        self.shm = create_segment(self.num_slots * slot_bytes)
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
    """A segment of ours mapped read/write by name. On Linux it is opened as /dev/shm/<name> directly, which
    keeps it out of this process's resource tracker (the tracker would otherwise unlink the sender's segment
    when this process exits, or double-unregister when the tracker is shared). Only a name of our pattern is
    opened, never through a symbolic link, and only a regular file this user owns."""

    def __init__(self, name: str) -> None:
        check_segment_name(name)
        self._shm: shared_memory.SharedMemory | None = None
        if _SHM_DIR.is_dir():
            fd = os.open(_SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise KVTransferError(
                        TransferStatus.INVALID,
                        f"shared-memory segment {name!r} is not a segment of this user",
                    )
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
    """Receiver side: segments opened by name and kept open, at most ``max_segments`` of them (the least
    recently used one is let go first: its mapping ends once no chunk read from it is still in use)."""

    def __init__(self, max_segments: int = 64) -> None:
        if max_segments < 1:
            raise ValueError(f"ShmAttachments.max_segments must be >= 1, got {max_segments}")
        self.max_segments = max_segments
        self._segments: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> _Mapping:
        """The mapping of segment ``name``; a name not of our pattern is a :class:`KVTransferError`."""
        check_segment_name(name)
        with self._lock:
            seg = self._segments.get(name)
            if seg is not None:
                self._segments.move_to_end(name)
                return seg
            seg = _Mapping(name)
            self._segments[name] = seg
            while len(self._segments) > self.max_segments:
                # Not closed here: a stream may still be copying from it; the last reference unmaps it.
                self._segments.popitem(last=False)
            return seg

    def __len__(self) -> int:
        with self._lock:
            return len(self._segments)

    def probe(self, name: str) -> bool:
        try:
            self.get(name)
            return True
        except (OSError, ValueError, KVTransferError):
            return False

    def close(self) -> None:
        with self._lock:
            for seg in self._segments.values():
                # BufferError: a view of it is still alive; the mapping then goes with the process.
                with contextlib.suppress(BufferError):
                    seg.close()
            self._segments.clear()
