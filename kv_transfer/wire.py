"""Chunking of a request's KV blocks and the raw-bytes wire form of ``KVChunk``.

A chunk is a group of blocks of one layer and one of K/V. In the cache each ``data[layer, kv]`` is a
contiguous ``[num_blocks + 1, block_size, KVH, D]`` tensor, so a run of consecutive block ids is one
contiguous byte range: the sender hands those ranges (memoryviews, no gather) straight to the
message builder, which is the only copy on the sending side.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache, KVCacheSpec, torch_dtype
from proto import kv_transfer_pb2 as pb

from .types import ChunkInfo

try:
    # ISA-L's CRC-32 is the same function as zlib's (same polynomial, same values, so both sides
    # interoperate whichever they use) but ~5x faster here (carry-less multiply): the checksum
    # pass was the largest cost of a transfer on each side.
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - optional speed-up
    from zlib import crc32


@dataclass(frozen=True)
class ChunkPlan:
    seq: int
    layer: int
    kv: int
    first_block: int  # index into the request's block list, not a block id
    num_blocks: int


def block_layer_bytes(spec: KVCacheSpec) -> int:
    """Bytes of one block of one layer's K (or V): block_size · KVH · D · element size."""
    return spec.block_size * spec.num_kv_heads * spec.head_dim * spec.element_size


def plan_chunks(spec: KVCacheSpec, num_blocks: int, chunk_bytes: int) -> list[ChunkPlan]:
    """Layer-major list of chunks, so every chunk of layer i can go as soon as layer i is written."""
    per_chunk = max(1, chunk_bytes // block_layer_bytes(spec))
    plans: list[ChunkPlan] = []
    for layer in range(spec.num_layers):
        for kv in (0, 1):
            for first in range(0, num_blocks, per_chunk):
                plans.append(ChunkPlan(len(plans), layer, kv, first, min(per_chunk, num_blocks - first)))
    return plans


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive id runs as (start id, length)."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    # uint8 view works for every dtype (numpy has no bfloat16); t must be contiguous and on CPU.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def chunk_views(cache: KVCache, block_ids: Sequence[int], plan: ChunkPlan) -> list[memoryview]:
    """The chunk's payload as contiguous byte ranges of the cache (a gathered copy off-CPU)."""
    ids = block_ids[plan.first_block : plan.first_block + plan.num_blocks]
    layer_kv = cache.data[plan.layer, plan.kv]  # [num_blocks + 1, block_size, KVH, D]
    if layer_kv.device.type != "cpu":
        idx = torch.as_tensor(list(ids), dtype=torch.long, device=layer_kv.device)
        return [_as_bytes_view(layer_kv.index_select(0, idx).cpu())]
    return [_as_bytes_view(layer_kv[start : start + n]) for start, n in _runs(ids)]


def chunk_tensor(cache: KVCache, block_ids: Sequence[int], plan: ChunkPlan) -> torch.Tensor:
    """The chunk as one tensor on the cache's device: [num_blocks, block_size, KVH, D] (a view when
    the blocks are consecutive, else a gathered copy)."""
    ids = list(block_ids[plan.first_block : plan.first_block + plan.num_blocks])
    layer_kv = cache.data[plan.layer, plan.kv]  # [num_blocks + 1, block_size, KVH, D]
    runs = _runs(ids)
    if len(runs) == 1:
        return layer_kv[runs[0][0] : runs[0][0] + runs[0][1]]
    return layer_kv.index_select(0, torch.as_tensor(ids, dtype=torch.long, device=layer_kv.device))


def crc32_of(views: Iterable[memoryview | bytes]) -> int:
    crc = 0
    for v in views:
        crc = crc32(v, crc)
    return crc


def chunk_info(request_id: str, plan: ChunkPlan, views: Sequence[memoryview]) -> ChunkInfo:
    return ChunkInfo(
        request_id=request_id,
        seq=plan.seq,
        layer=plan.layer,
        kv=plan.kv,
        first_block=plan.first_block,
        num_blocks=plan.num_blocks,
        crc32=crc32_of(views),
        nbytes=sum(v.nbytes for v in views),
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("KVChunk: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def fingerprint_pb(fp: dict) -> pb.ModelFingerprint:
    """A model fingerprint (``KVCacheSpec.fingerprint()``) as the handshake carries it."""
    return pb.ModelFingerprint(
        architecture=fp["architecture"],
        dtype=fp["dtype"],
        num_layers=fp["num_layers"],
        num_kv_heads=fp["num_kv_heads"],
        head_dim=fp["head_dim"],
    )


def header_pb(
    info: ChunkInfo, shm_name: str = "", shm_offset: int = 0, release_slot: bool = False
) -> pb.ChunkHeader:
    return pb.ChunkHeader(
        request_id=info.request_id,
        seq=info.seq,
        layer=info.layer,
        kv=info.kv,
        first_block=info.first_block,
        num_blocks=info.num_blocks,
        crc32=info.crc32,
        nbytes=info.nbytes,
        shm_name=shm_name,
        shm_offset=shm_offset,
        release_slot=release_slot,
    )


def commit_message(request_id: str, commit: bytes) -> bytes:
    """A transfer's last message: a header that carries the commit (and no chunk)."""
    return encode_chunk(pb.ChunkHeader(request_id=request_id, commit=commit))


def info_from_pb(h: pb.ChunkHeader) -> ChunkInfo:
    return ChunkInfo(h.request_id, h.seq, h.layer, h.kv, h.first_block, h.num_blocks, h.crc32, h.nbytes)


def encode_chunk(header: pb.ChunkHeader, views: Sequence[memoryview | bytes] = ()) -> bytes:
    """``KVChunk{header, payload}`` in protobuf wire format, the payload joined in one copy."""
    hdr = header.SerializeToString()
    nbytes = sum(len(memoryview(v).cast("B")) for v in views)
    prefix = b"\x0a" + _varint(len(hdr)) + hdr
    if not views:
        return prefix
    return b"".join([prefix, b"\x12", _varint(nbytes), *views])


def decode_chunk(data: bytes) -> tuple[pb.ChunkHeader, memoryview]:
    """Parse a ``KVChunk`` without copying the payload (fields may come in any order)."""
    buf = memoryview(data)
    pos = 0
    header = pb.ChunkHeader()
    payload = buf[0:0]
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field_no, wire_type = key >> 3, key & 7
        if wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("KVChunk: truncated field")
            if field_no == 1:
                header.MergeFromString(buf[pos : pos + length])
            elif field_no == 2:
                payload = buf[pos : pos + length]
            pos += length
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"KVChunk: unsupported wire type {wire_type}")
    return header, payload


def payload_tensor(
    spec: KVCacheSpec, payload: memoryview | bytes, num_blocks: int, block_size: int
) -> torch.Tensor:
    """A read-only view of a payload as [num_blocks, block_size, KVH, D] (no copy)."""
    expected = num_blocks * block_size * spec.num_kv_heads * spec.head_dim * spec.element_size
    if len(payload) != expected:
        raise ValueError(f"payload has {len(payload)} bytes, expected {expected}")
    with warnings.catch_warnings():
        # The bytes are only read (copied into the cache); torch warns because bytes are immutable.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(payload, dtype=torch.uint8)
    return t.view(torch_dtype(spec.dtype)).view(num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
