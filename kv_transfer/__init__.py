"""KV cache transfer between prefill and decode workers: one :class:`KVTransport` interface and
its backends (``grpc``, ``shm``, ``torch_dist``, ``local``)."""

from . import grpc_transport, local, torch_dist  # noqa: F401  (register the backends)
from .base import (
    FaultInjector,
    KVTransport,
    SenderSession,
    create_transport,
    get_transport_class,
    register_transport,
    transport_names,
)
from .config import TransferConfig
from .receiver import KVReceiver
from .types import (
    Handshake,
    HandshakeResult,
    KVTransferError,
    ReceivedKV,
    TransferMetrics,
    TransferStatus,
)

__all__ = [
    "FaultInjector",
    "Handshake",
    "HandshakeResult",
    "KVReceiver",
    "KVTransferError",
    "KVTransport",
    "ReceivedKV",
    "SenderSession",
    "TransferConfig",
    "TransferMetrics",
    "TransferStatus",
    "create_transport",
    "get_transport_class",
    "register_transport",
    "transport_names",
]
