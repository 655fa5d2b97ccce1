"""Stubs stay in sync with the .proto; the hand-built chunk wire form is valid protobuf; configs
name the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_transfer import TransferConfig
from kv_transfer.wire import decode_chunk, encode_chunk
from proto import kv_transfer_pb2 as pb
from proto.generate import PROTO_DIR, generate


def test_checked_in_stubs_match_the_proto(tmp_path: Path) -> None:
    for fresh in generate(tmp_path):
        kept = PROTO_DIR / fresh.name
        assert kept.exists(), f"{kept.name} missing: run `make proto`"
        assert kept.read_text() == fresh.read_text(), f"{kept.name} is stale: run `make proto`"


def test_raw_chunk_is_valid_protobuf_both_ways() -> None:
    header = pb.ChunkHeader(
        request_id="r", seq=3, layer=1, kv=1, first_block=4, num_blocks=2, crc32=99, nbytes=6
    )
    payload = [memoryview(b"abc"), memoryview(b"def")]
    wire = encode_chunk(header, payload)
    parsed = pb.KVChunk.FromString(wire)  # the stock parser agrees with the hand-built form
    assert parsed.header == header and parsed.payload == b"abcdef"
    h, p = decode_chunk(pb.KVChunk(header=header, payload=b"abcdef").SerializeToString())
    assert h == header and bytes(p) == b"abcdef"
    with pytest.raises(ValueError):
        decode_chunk(wire[:-4] + b"\x12\x7f")  # length past the end: truncated


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"max_retries": -1}, "max_retries"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"num_streams": 0}, "num_streams"),
        ({"chunk_bytes": 1 << 20, "max_message_bytes": 1 << 20}, "max_message_bytes"),
        ({"tls_cert_file": "/nonexistent.pem", "tls_key_file": "/nonexistent.key"}, "tls_cert_file"),
        ({"auth_token": ""}, "auth_token"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TransferConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown"):
        TransferConfig.from_dict({"chunk_size": 1})
