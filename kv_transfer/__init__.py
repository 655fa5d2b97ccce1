"""KV cache transfer between prefill and decode workers: one :class:`KVTransport` interface and
its backends (``grpc``, ``shm``, ``torch_dist``, ``local``), each imported when first created."""

from .base import (
    FaultInjector,
    KVTransport,
    SenderSession,
    create_transport,
    get_transport_class,
    register_transport,
    transport_names,
)
from .config import CLUSTER_TRANSPORTS, TransferConfig
from .receiver import KVReceiver
from .streaming import FIRST_TOKEN_PENDING, LayerStreamer
from .types import (
    Handshake,
    HandshakeResult,
    KVTransferError,
    ReceivedKV,
    TransferMetrics,
    TransferStatus,
)

__all__ = [
    "CLUSTER_TRANSPORTS",
    "FIRST_TOKEN_PENDING",
    "FaultInjector",
    "Handshake",
    "HandshakeResult",
    "KVReceiver",
    "KVTransferError",
    "KVTransport",
    "LayerStreamer",
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
