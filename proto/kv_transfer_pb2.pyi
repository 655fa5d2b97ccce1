from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelFingerprint(_message.Message):
    __slots__ = ("architecture", "dtype", "num_layers", "num_kv_heads", "head_dim")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("request_id", "fingerprint", "sender_block_size", "num_tokens", "first_token", "num_chunks", "attempt", "num_streams", "reserve_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SENDER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    fingerprint: ModelFingerprint
    sender_block_size: int
    num_tokens: int
    first_token: int
    num_chunks: int
    attempt: int
    num_streams: int
    reserve_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., sender_block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., num_chunks: _Optional[int] = ..., attempt: _Optional[int] = ..., num_streams: _Optional[int] = ..., reserve_tokens: _Optional[int] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("status", "receiver_block_size", "num_blocks", "detail", "free_blocks")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACCEPTED: _ClassVar[HandshakeReply.Status]
        FULL: _ClassVar[HandshakeReply.Status]
        MISMATCH: _ClassVar[HandshakeReply.Status]
        INVALID: _ClassVar[HandshakeReply.Status]
        DUPLICATE: _ClassVar[HandshakeReply.Status]
        ABORTED: _ClassVar[HandshakeReply.Status]
    ACCEPTED: HandshakeReply.Status
    FULL: HandshakeReply.Status
    MISMATCH: HandshakeReply.Status
    INVALID: HandshakeReply.Status
    DUPLICATE: HandshakeReply.Status
    ABORTED: HandshakeReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    status: HandshakeReply.Status
    receiver_block_size: int
    num_blocks: int
    detail: str
    free_blocks: int
    def __init__(self, status: _Optional[_Union[HandshakeReply.Status, str]] = ..., receiver_block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., detail: _Optional[str] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("request_id", "seq", "layer", "kv", "first_block", "num_blocks", "crc32", "nbytes", "shm_offset", "shm_name", "release_slot", "commit")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SLOT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    layer: int
    kv: int
    first_block: int
    num_blocks: int
    crc32: int
    nbytes: int
    shm_offset: int
    shm_name: str
    release_slot: bool
    commit: bytes
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., layer: _Optional[int] = ..., kv: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., crc32: _Optional[int] = ..., nbytes: _Optional[int] = ..., shm_offset: _Optional[int] = ..., shm_name: _Optional[str] = ..., release_slot: _Optional[bool] = ..., commit: _Optional[bytes] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("status", "request_id", "bytes_received", "detail", "final")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[TransferAck.Status]
        CHECKSUM: _ClassVar[TransferAck.Status]
        TRUNCATED: _ClassVar[TransferAck.Status]
        ABORTED: _ClassVar[TransferAck.Status]
        UNKNOWN: _ClassVar[TransferAck.Status]
        INVALID: _ClassVar[TransferAck.Status]
    OK: TransferAck.Status
    CHECKSUM: TransferAck.Status
    TRUNCATED: TransferAck.Status
    ABORTED: TransferAck.Status
    UNKNOWN: TransferAck.Status
    INVALID: TransferAck.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    status: TransferAck.Status
    request_id: str
    bytes_received: int
    detail: str
    final: bool
    def __init__(self, status: _Optional[_Union[TransferAck.Status, str]] = ..., request_id: _Optional[str] = ..., bytes_received: _Optional[int] = ..., detail: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class SlotRelease(_message.Message):
    __slots__ = ("shm_offset", "ack", "shm_name")
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    shm_offset: int
    ack: TransferAck
    shm_name: str
    def __init__(self, shm_offset: _Optional[int] = ..., ack: _Optional[_Union[TransferAck, _Mapping]] = ..., shm_name: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("shm_probe",)
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    shm_probe: str
    def __init__(self, shm_probe: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "used_blocks", "in_flight", "node_id", "shm_ok")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_OK_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    used_blocks: int
    in_flight: int
    node_id: str
    shm_ok: bool
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., in_flight: _Optional[int] = ..., node_id: _Optional[str] = ..., shm_ok: _Optional[bool] = ...) -> None: ...
