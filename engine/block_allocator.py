"""Block allocator of the paged KV cache: which block ids are free, which are used.

Invariant (checked by :meth:`check_integrity`, in tests and when a worker is idle):
``num_free + num_used == num_blocks`` and the free and used sets are disjoint.
"""

from __future__ import annotations

import threading


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free; nothing is allocated."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # A stack: the most recently freed block is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        # KV-transfer receiver threads allocate while the engine loop runs: every method holds this.
        self._lock = threading.RLock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        with self._lock:
            if n > len(self._free):
                raise NoFreeBlocksError(
                    f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}"
                )
            out = [self._free.pop() for _ in range(n)]
            self._used.update(out)
            return out

    def free(self, block_ids: list[int]) -> None:
        """Return blocks; freeing a block that is not in use is a bug and raises (all or nothing)."""
        with self._lock:
            bad = [b for b in block_ids if b not in self._used]
            if bad or len(set(block_ids)) != len(block_ids):
                raise ValueError(f"freeing blocks that are not in use (or twice): {bad or block_ids}")
            # Pushed in reverse, so a request's blocks come back out of the stack in the order it held
            # them: ascending runs stay ascending, and KV transfer moves a run with one copy instead of
            # one per block (a descending run is a run of single blocks to it).
            for b in reversed(block_ids):
                self._used.remove(b)
                self._free.append(b)

    def check_integrity(self) -> None:
        with self._lock:
            self._check_integrity()

    def _check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("block allocator: duplicate ids in the free list")
        if free & self._used:
            raise AssertionError(f"block allocator: ids both free and used: {sorted(free & self._used)[:10]}")
        if len(free) + len(self._used) != self.num_blocks:
            raise AssertionError(
                f"block allocator: free {len(free)} + used {len(self._used)} != total {self.num_blocks}"
            )
        if any(not 0 <= b < self.num_blocks for b in free | self._used):
            raise AssertionError("block allocator: id out of range")

    def stats(self) -> dict[str, int]:
        return {"total": self.num_blocks, "free": self.num_free, "used": self.num_used}
