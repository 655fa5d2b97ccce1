"""Paged KV cache: one tensor holding every layer's K and V blocks.

Layout (the contract that ``kv_transfer`` relies on)::

    data: [num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]
              layer   K/V   block id      slot in block

Block ids ``0 .. num_blocks-1`` belong to the :class:`BlockAllocator`. The extra block at index
``num_blocks`` is the *null block*: padded rows of a bucketed batch write their K/V there and read
from it, so a padded batch needs no masking on the write path and keeps a fixed shape. It is never
allocated and never holds anything that is read back for a real token.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory

import torch

from engine import huge_pages
from engine.shm_segment import create_segment

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of the KV cache; also the model fingerprint checked by KV transfer handshakes."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be > 0, got {getattr(self, name)}")
        torch_dtype(self.dtype)

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=torch_dtype(self.dtype)).element_size()

    @property
    def bytes_per_token(self) -> int:
        """2 · L · H · D · B of DESIGN.md: K and V, every layer, one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def fingerprint(self) -> dict:
        """What both sides of a transfer must agree on (block size may differ: it is re-blocked)."""
        d = asdict(self)
        d.pop("block_size")
        return d

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _unlink(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


class KVCache:
    """The paged K/V storage of one worker. Bookkeeping of which block is free lives in BlockAllocator."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device | str = "cpu",
        shared_memory: bool = False,
    ) -> None:
        """``shared_memory`` (CPU only): allocate ``data`` in a named ``multiprocessing.shared_memory``
        segment (``shm_name``), so a KV receiver on the same node can read the blocks in place
        instead of through a staging copy. Layout and API are the same either way."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        self.device = torch.device(device)
        self.shm_name: str | None = None
        shape = (spec.num_layers, 2, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        dtype = torch_dtype(spec.dtype)
        if shared_memory:
            if self.device.type != "cpu":
                raise ValueError(f"KVCache: shared_memory needs a CPU cache, got device {self.device}")
            self.data = self._shared_zeros(shape, dtype)  # [L, 2, num_blocks + 1, block_size, KVH, D]
            return
        if self.device.type == "cpu":
            self.data = self._mapped_zeros(shape, dtype)  # [L, 2, num_blocks + 1, block_size, KVH, D]
            return
        # [L, 2, num_blocks + 1, block_size, KVH, D]
        self.data = torch.zeros(*shape, dtype=dtype, device=self.device)

    @staticmethod
    def _mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeros in a private anonymous mapping (``engine.huge_pages``): the kernel guarantees they read as zero and
        backs each page only when it is first written, on 2 MiB pages where it can. ``torch.zeros`` writes every
        byte up front: about 1 GiB for ``small``'s default cache, which cost each worker 3.5-4.3 s of a start-up on
        two cores (page faults, with the other processes starting beside it), for blocks most of which a short run
        never touches."""
        return huge_pages.zeros(shape, dtype)  # the tensor holds the mapping: it lives as long as the tensor

    def _shared_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shm = create_segment(huge_pages.nbytes(shape, dtype))  # a new segment reads as zeros
        self.shm_name = shm.name
        # The tensor borrows shm.buf, so the segment cannot be closed while it lives; unlinking the
        # name when the cache is collected (or at exit, by the resource tracker) leaves peers'
        # mappings valid and frees the memory once every mapping is gone.
        weakref.finalize(self, _unlink, shm)
        return huge_pages.tensor_over(shm.buf, shape, dtype)

    def prefault(self, max_bytes: int) -> int:
        """Back the first blocks with memory now, up to ``max_bytes`` of them; returns how many blocks.

        A CPU cache is mapped lazily (``_mapped_zeros``): each page is backed when first written, and that first
        write pays the page fault and the kernel's zeroing (with THP's compaction where it must assemble a 2 MiB
        page). The allocator hands out the lowest block ids first and reuses freed blocks first, so the first
        blocks are the working set of the first requests and of a steady load: backing them at start-up keeps
        those faults out of the first steps. In the 128-prompt offline benchmark of ``small`` (about 1,700
        blocks), the first run's K/V writes took 526 ms against 78-84 ms in the runs after it; backing 2,048
        blocks (512 MiB) took 0.2-0.75 s at start-up on two cores. The rest of the cache is still backed lazily, so
        a worker's memory grows with the load it sees, as before. Accelerator caches are written whole at
        allocation: nothing to do."""
        if self.device.type != "cpu" or max_bytes <= 0:
            return 0
        n = min(self.num_blocks, max_bytes // max(1, self.spec.bytes_per_block))
        self.data[:, :, :n].zero_()  # [L, 2, n, block_size, KVH, D]: zeros already, now backed
        return n

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # [num_blocks + 1, block_size, KVH, D]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]  # [num_blocks + 1, block_size, KVH, D]

    def flat_slots(self, layer: int, kv: int) -> torch.Tensor:
        """A view of one layer's K (kv=0) or V (kv=1) as token slots: [(num_blocks + 1) * block_size, KVH, D]."""
        return self.data[layer, kv].view(-1, self.spec.num_kv_heads, self.spec.head_dim)

    def read_blocks(self, block_ids: list[int] | torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Copy out blocks: [L, 2, n, block_size, KVH, D] (or [2, n, block_size, KVH, D] for one layer)."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        if layer is None:
            return self.data.index_select(2, idx)
        return self.data[layer].index_select(1, idx)

    def write_blocks(
        self, block_ids: list[int] | torch.Tensor, blocks: torch.Tensor, layer: int | None = None
    ) -> None:
        """Inverse of read_blocks: blocks is [L, 2, n, block_size, KVH, D] (or one layer's [2, n, ...])."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        if layer is None:
            self.data.index_copy_(2, idx, blocks.to(self.data.dtype))
        else:
            self.data[layer].index_copy_(1, idx, blocks.to(self.data.dtype))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
