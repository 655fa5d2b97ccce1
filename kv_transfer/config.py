"""Typed, frozen configuration of the KV transfer components; every check names the offending field."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields
from pathlib import Path

# What a cluster of worker actors can run: both ends need only the receiver's address. ``local`` needs
# both ends in one process and ``torch_dist`` a process group with ranks; they stay for the engine
# API and their contract tests, but the cluster launcher does not offer them.
CLUSTER_TRANSPORTS = ("grpc", "shm")


# Longest auth token accepted: it travels in every call's metadata.
MAX_TOKEN_CHARS = 1024


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``): only this host can reach it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every address of this host (``0.0.0.0``, ``::``)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class TransferConfig:
    """Settings shared by both sides of every backend (fields a backend does not use are ignored)."""

    # Target payload of one gRPC chunk: big enough to amortise per-message costs, small enough that a
    # 16K-token prompt never becomes one huge message and the receiver can write while bytes arrive.
    # With 2 streams (below), 4 MiB was within 15% of the best of 1-8 MiB x 1-4 streams in `bench kv --grid`
    # on both a 2-core and a 16-core host (best on the 16-core one), where no other setting was.
    chunk_bytes: int = 4 << 20
    # Chunk size of the same-node shared-memory path: only a header crosses gRPC per chunk there,
    # so bigger chunks mean fewer messages; 8 MiB beat 2, 4 and 16 MiB in `bench kv --grid` runs.
    shm_chunk_bytes: int = 8 << 20
    # How many times a transfer rejected for a bad checksum or truncation is re-sent before the
    # sender gives up and reports it for recompute.
    max_retries: int = 1
    # The sender frees leased blocks after this long without an acknowledgement.
    lease_ttl_s: float = 60.0
    # Deadline of every RPC (handshake, each transfer stream, abort, stats).
    rpc_timeout_s: float = 30.0
    # The receiver frees a transfer that made no progress for this long (sender died mid-way), and a
    # received transfer that the decode worker did not take.
    receive_timeout_s: float = 60.0
    # How often leases and stale receives are swept.
    reap_interval_s: float = 0.5
    # Parallel gRPC streams per transfer: a second stream overlaps one stream's copies with the other's
    # socket work (see chunk_bytes).
    num_streams: int = 2
    # Chunks a sender may have queued but not yet handed to the transport (bounded memory).
    max_inflight_chunks: int = 4
    verify_checksums: bool = True
    # Where the receiving endpoint listens. Any address other than a loopback one needs TLS (tls_cert_file and
    # tls_key_file): KV and the token would otherwise cross the network in the clear.
    host: str = "127.0.0.1"
    # Shared secret: the receiver refuses every call without it (the cluster launcher always sets one).
    auth_token: str | None = None
    # TLS when both are set (server); tls_ca_file alone is enough for a client.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    # The name prefill workers expect in the KV certificate instead of the address they dial: one certificate
    # (made out to, say, "bucketserve-kv") then serves every worker, whatever address its node is given.
    tls_server_name: str | None = None
    # Same-node fast path: use shared memory when the peer reports the same node id.
    same_node_fast_path: bool = True
    # Same-node fast path from a KV cache allocated in shared memory (KVCache(shared_memory=True)):
    # the receiver copies the leased blocks straight out of the sender's cache, with no staging copy.
    shm_zero_copy: bool = True
    # Size of the sender's shared-memory ring (bounded staging for the fast path).
    shm_ring_bytes: int = 64 << 20
    # Largest gRPC message accepted; must exceed chunk_bytes plus header.
    max_message_bytes: int = 64 << 20
    # Senders' shared-memory segments a receiver keeps mapped (two per prefill worker: its ring and its KV
    # cache); past it the least recently used is let go, so no caller can make it map without limit.
    max_shm_segments: int = 64

    def __post_init__(self) -> None:
        _positive(
            self,
            "chunk_bytes",
            "shm_chunk_bytes",
            "lease_ttl_s",
            "rpc_timeout_s",
            "receive_timeout_s",
            "reap_interval_s",
            "num_streams",
            "max_inflight_chunks",
            "shm_ring_bytes",
            "max_message_bytes",
            "max_shm_segments",
        )
        if self.max_retries < 0:
            raise ValueError(f"TransferConfig.max_retries must be >= 0, got {self.max_retries}")
        if self.max_message_bytes < self.chunk_bytes + 4096:
            raise ValueError(
                f"TransferConfig.max_message_bytes ({self.max_message_bytes}) must exceed chunk_bytes "
                f"({self.chunk_bytes}) plus a header"
            )
        if self.shm_ring_bytes < self.shm_chunk_bytes:
            raise ValueError(
                f"TransferConfig.shm_ring_bytes ({self.shm_ring_bytes}) must hold one chunk "
                f"(shm_chunk_bytes {self.shm_chunk_bytes})"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "TransferConfig.tls_cert_file and TransferConfig.tls_key_file must be set together"
            )
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TransferConfig.{name}: no such file {path!r}")
        if self.tls_server_name is not None:
            name = self.tls_server_name
            if not isinstance(name, str) or not name or any(c.isspace() for c in name):
                raise ValueError(f"TransferConfig.tls_server_name must be a host name, got {name!r}")
            if not self.tls_enabled:
                raise ValueError("TransferConfig.tls_server_name needs TLS (TransferConfig.tls_cert_file)")
        self._check_token()
        self._check_host()

    def _check_token(self) -> None:
        token = self.auth_token
        if token is None:
            return
        # It goes into gRPC metadata as it is: printable ASCII only, and no space (the header is "Bearer <token>").
        if not isinstance(token, str) or not token:
            raise ValueError("TransferConfig.auth_token must be a non-empty string when set")
        if len(token) > MAX_TOKEN_CHARS:
            raise ValueError(
                f"TransferConfig.auth_token must be at most {MAX_TOKEN_CHARS} characters, got {len(token)}"
            )
        if not all("!" <= c <= "~" for c in token):
            raise ValueError("TransferConfig.auth_token must be printable ASCII without spaces")

    def _check_host(self) -> None:
        host = self.host
        if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
            raise ValueError(f"TransferConfig.host must be an address or host name, got {host!r}")
        if not is_loopback(host) and not (self.tls_cert_file and self.tls_key_file):
            raise ValueError(
                f"TransferConfig.host {host} is not a loopback address: serving KV there needs TLS "
                "(TransferConfig.tls_cert_file and TransferConfig.tls_key_file)"
            )

    @classmethod
    def from_dict(cls, values: dict) -> TransferConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"TransferConfig: unknown field(s) {unknown}")
        return cls(**values)

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None or self.tls_ca_file is not None

    def route_name(self, path: str) -> str:
        """How KV goes for a transfer over ``path`` ("shm", "grpc", ...), as stats and metrics name it: gRPC with
        TLS is "grpc+tls"."""
        return f"{path}+tls" if path == "grpc" and self.tls_enabled else path
