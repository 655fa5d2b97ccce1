"""Sender-side leases: blocks handed to a transfer stay allocated until the receiver acknowledges,
the transfer fails, or the lease's TTL passes (the prefill side never holds KV forever)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from engine.block_allocator import BlockAllocator

log = logging.getLogger(__name__)


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    expires_at: float
    # While a backend call is running on these blocks the lease is not expired under it; every
    # such call has a deadline, so a busy lease still ends.
    busy: int = 0


class LeaseTable:
    def __init__(self, allocator: BlockAllocator, ttl_s: float, lock: threading.RLock) -> None:
        self.allocator = allocator
        self.ttl_s = ttl_s
        self.lock = lock
        self._leases: dict[str, Lease] = {}

    def grant(self, request_id: str, block_ids: list[int]) -> Lease:
        with self.lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already has a lease")
            lease = Lease(request_id, list(block_ids), time.monotonic() + self.ttl_s)
            self._leases[request_id] = lease
            return lease

    def get(self, request_id: str) -> Lease | None:
        with self.lock:
            return self._leases.get(request_id)

    def release(self, request_id: str) -> bool:
        """Free the lease's blocks (ack, failure or abort). False when there was none."""
        with self.lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self.allocator.free(lease.block_ids)
            return True

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self.lock:
            gone = [r for r, lease in self._leases.items() if not lease.busy and now >= lease.expires_at]
            for rid in gone:
                self.allocator.free(self._leases.pop(rid).block_ids)
        for rid in gone:
            log.warning(
                "kv lease of %s expired after %ss without acknowledgement: blocks freed", rid, self.ttl_s
            )
        return gone

    def __len__(self) -> int:
        with self.lock:
            return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self._leases
