"""KV cache transfer between prefill and decode workers: one :class:`KVTransport` interface and
its backends (``grpc``, ``shm``, ``torch_dist``, ``local``), each imported when first created."""

import importlib

# Name -> submodule. Imported on first use (PEP 562), so a process that only handles configs, errors and worker
# handles (a controller, a gateway) does not load torch with the transports.
_EXPORTS = {
    "FaultInjector": "faults",
    "KVTransport": "base",
    "SenderSession": "base",
    "create_transport": "base",
    "get_transport_class": "base",
    "register_transport": "base",
    "transport_names": "base",
    "CLUSTER_TRANSPORTS": "config",
    "TransferConfig": "config",
    "KVReceiver": "receiver",
    "FIRST_TOKEN_PENDING": "streaming",
    "LayerStreamer": "streaming",
    "Handshake": "types",
    "HandshakeResult": "types",
    "KVTransferError": "types",
    "ReceivedKV": "types",
    "TransferMetrics": "types",
    "TransferStatus": "types",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


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
