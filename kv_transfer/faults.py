"""Deliberate damage to KV transfers, for reliability tests and chaos drills (no torch: worker configs carry it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FaultInjector:
    """Deliberate damage on the sending side, for reliability tests and chaos drills: on the first
    ``corrupt_attempts`` attempts one payload byte of chunk ``corrupt_seq`` is flipped after its
    checksum is taken; on the first ``truncate_attempts`` attempts the last chunk is not sent;
    every chunk waits ``chunk_delay_s`` (to widen the in-flight window). Across all transfers of the
    transport, every ``corrupt_every``-th chunk sent is damaged and every ``drop_every``-th is not sent
    (0: never), whatever its transfer or attempt: damage a running cluster meets at random."""

    corrupt_attempts: int = 0
    corrupt_seq: int = 0
    truncate_attempts: int = 0
    chunk_delay_s: float = 0.0
    corrupt_every: int = 0
    drop_every: int = 0
    # Chunks this transport has handed out so far (counted by ``tick``; races between sender threads only
    # shift which chunk is hit).
    _chunks: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("corrupt_attempts", "truncate_attempts", "corrupt_every", "drop_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"FaultInjector.{name} must be an int >= 0, got {value!r}")

    def tick(self) -> int:
        """Count one more chunk about to be sent; its 1-based number."""
        self._chunks += 1
        return self._chunks

    def views(self, attempt: int, seq: int, views: list[memoryview], n: int = 0) -> list[memoryview]:
        hit = attempt <= self.corrupt_attempts and seq == self.corrupt_seq
        if hit or (self.corrupt_every and n and n % self.corrupt_every == 0):
            damaged = bytearray(b"".join(views))
            damaged[len(damaged) // 2] ^= 0xFF
            return [memoryview(bytes(damaged))]
        return views

    def drop(self, attempt: int, seq: int, num_chunks: int, n: int = 0) -> bool:
        if self.drop_every and n and n % self.drop_every == 0:
            return True
        return attempt <= self.truncate_attempts and seq == num_chunks - 1
