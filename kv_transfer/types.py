"""Typed messages that cross the process boundary, transfer metrics and errors."""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field


class TransferStatus(enum.Enum):
    """Verdict of a transfer; the values match ``TransferAck.Status`` of the .proto where they overlap."""

    OK = "ok"
    CHECKSUM = "checksum"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    UNKNOWN = "unknown"
    INVALID = "invalid"
    FULL = "full"
    MISMATCH = "mismatch"
    DUPLICATE = "duplicate"
    TIMEOUT = "timeout"
    UNAUTHENTICATED = "unauthenticated"
    UNAVAILABLE = "unavailable"

    @property
    def retryable(self) -> bool:
        """Bytes damaged or lost in transit: sending the same blocks again can succeed."""
        return self in (TransferStatus.CHECKSUM, TransferStatus.TRUNCATED)


class KVTransferError(RuntimeError):
    """A transfer did not complete. ``recompute`` tells the prefill side to recompute the KV
    (the receiver holds nothing); ``status`` says why."""

    def __init__(self, status: TransferStatus, detail: str = "", request_id: str = "") -> None:
        super().__init__(
            f"KV transfer {request_id!r} failed: {status.value}{': ' + detail if detail else ''}"
        )
        self.status = status
        self.detail = detail
        self.request_id = request_id

    @property
    def receiver_full(self) -> bool:
        return self.status is TransferStatus.FULL


@dataclass(frozen=True)
class Handshake:
    """What the receiver checks before it accepts a byte."""

    request_id: str
    fingerprint: dict
    sender_block_size: int
    num_tokens: int
    first_token: int
    num_chunks: int
    attempt: int = 1
    num_streams: int = 1
    # Tokens the request may grow to on the receiver (prompt + max_tokens), admitted with the KV's blocks: the
    # receiver's owner judges its room at this one moment (0: the KV's own blocks only).
    reserve_tokens: int = 0

    def validate(self) -> None:
        if not self.request_id:
            raise ValueError("Handshake.request_id must be non-empty")
        if self.sender_block_size <= 0:
            raise ValueError(f"Handshake.sender_block_size must be > 0, got {self.sender_block_size}")
        if self.num_tokens <= 0:
            raise ValueError(f"Handshake.num_tokens must be > 0, got {self.num_tokens}")
        if self.num_chunks <= 0:
            raise ValueError(f"Handshake.num_chunks must be > 0, got {self.num_chunks}")
        if self.num_streams <= 0:
            raise ValueError(f"Handshake.num_streams must be > 0, got {self.num_streams}")
        if self.reserve_tokens < 0:
            raise ValueError(f"Handshake.reserve_tokens must be >= 0, got {self.reserve_tokens}")


@dataclass(frozen=True)
class HandshakeResult:
    status: TransferStatus
    receiver_block_size: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    detail: str = ""


@dataclass(frozen=True)
class ChunkInfo:
    """Where one chunk's payload goes: ``num_blocks`` sender blocks from sender block index
    ``first_block`` of the request, for one layer and K (kv=0) or V (kv=1)."""

    request_id: str
    seq: int
    layer: int
    kv: int
    first_block: int
    num_blocks: int
    crc32: int
    nbytes: int


@dataclass(frozen=True)
class ReceivedKV:
    """A completed transfer handed to the decode worker, which now owns ``block_ids``."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    first_token: int
    bytes_received: int
    latency_s: float
    # The sender's commit: what the receiver runs the request on (the cluster's prefilled request); empty when
    # the sender committed nothing.
    commit: bytes = b""
    reserve_tokens: int = 0  # as the handshake admitted it


@dataclass
class TransferMetrics:
    """Per-transfer figures for the monitor (``kv_transfer_bytes``, ``kv_transfer_latency``, speed)."""

    request_id: str
    backend: str
    peer: str
    num_tokens: int = 0
    bytes: int = 0
    chunks: int = 0
    attempts: int = 0
    status: str = TransferStatus.OK.value
    started_at: float = field(default_factory=time.time)
    latency_s: float = 0.0

    @property
    def throughput_gbps(self) -> float:
        """Gigabytes (1e9) per second over the whole transfer, handshake and ack included."""
        return self.bytes / self.latency_s / 1e9 if self.latency_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["throughput_gbps"] = self.throughput_gbps
        return d
