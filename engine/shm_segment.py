"""Names of the shared-memory segments BucketServe creates (a KV cache in shared memory, a KV sender's ring).

Every segment gets a name of one fixed pattern, so a process that is told a segment name by a peer can check
that it names one of ours (a plain name: no ``/``, no ``..``, bounded length) before it opens anything.
"""

from __future__ import annotations

import re
import secrets
from multiprocessing import shared_memory

SEGMENT_PREFIX = "bsvkv_"
_TOKEN_HEX = 16
_PATTERN = re.compile(rf"{SEGMENT_PREFIX}[0-9a-f]{{{_TOKEN_HEX}}}")
SEGMENT_NAME_LEN = len(SEGMENT_PREFIX) + _TOKEN_HEX


def is_segment_name(name: object) -> bool:
    """Whether ``name`` is a segment name of our own pattern (and nothing else: no path, no parent)."""
    return isinstance(name, str) and _PATTERN.fullmatch(name) is not None


def create_segment(size: int) -> shared_memory.SharedMemory:
    """A new segment of ``size`` bytes under a fresh name of our pattern."""
    for _ in range(16):
        name = SEGMENT_PREFIX + secrets.token_hex(_TOKEN_HEX // 2)
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:  # 64 random bits taken already: draw again
            continue
    raise FileExistsError("no free shared-memory segment name after 16 draws")
