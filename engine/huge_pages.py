"""CPU tensors in memory that the kernel may back with 2 MiB pages (transparent huge pages, asked for with
``madvise(MADV_HUGEPAGE)``).

Why: a decode step streams the KV cache and the skinny kernel's weight panels once each, and with 4 KiB pages
every stream crosses a page boundary every 4 KiB: a TLB miss each time, and the hardware prefetchers, which do
not follow a stream across a page, start again. Measured on a 2-core AMD EPYC (AVX-512) host where THP is
``madvise``: one layer's paged attention over 128 decodes at context 512, blocks scattered at random, took
7.3-7.4 ms on huge pages against 9.3-9.4 on small ones (1 thread), 3.8-3.9 against 4.7-5.2 (2 threads). The
engine's own blocks mostly come in ascending runs, so its steps gain less: ``small`` decode steps at context 512
(``bench roofline``, with and without this module, alternating, two pairs) batch 1 2.49 / 2.58 ms against 2.58 /
2.73, batch 8 4.40 / 4.37 against 4.56 / 4.86, batch 32 12.71 / 12.95 against 13.07 / 13.53, batch 128 48.99 /
48.26 against 48.74 / 49.73.

Only the engine's largest streamed tensors come here (the KV cache, the weight panels), each in its own
anonymous private mapping: pages are backed when first written, so an untouched KV cache costs nothing. Where
the kernel has no THP (or it is ``never``), ``madvise`` fails or is ignored and the memory is ordinary pages:
the same tensors, the same results.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import warnings

import torch

# Below one huge page there is nothing to gain and a mapping of its own per tensor costs a VMA: such tensors
# stay ordinary torch allocations.
HUGE_PAGE_BYTES = 2 * 2**20


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.tensor([], dtype=dtype).element_size()


def tensor_over(buf, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A tensor of ``shape`` over a writable buffer, starting ``offset`` bytes in (the tensor keeps the buffer
    alive)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer warns about non-writable buffers only
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes(shape, dtype), offset=offset)
    return flat.view(dtype).view(shape)


def _advise(buf: mmap.mmap) -> None:
    """Ask for huge pages on ``buf`` (nothing happens where the kernel has no THP)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    with contextlib.suppress(OSError):  # EINVAL: a kernel built without transparent huge pages
        buf.madvise(advice)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous private mapping advised for huge pages, starting on a huge-page
    boundary (a mapping starts on any 4 KiB one: the 2 MiB around an unaligned start could never be a huge page).
    The kernel guarantees the pages read as zero and backs each one only when it is first written; the tensor holds
    the mapping."""
    size = nbytes(shape, dtype)
    large = size >= HUGE_PAGE_BYTES
    slack = HUGE_PAGE_BYTES if large else 0
    buf = mmap.mmap(-1, max(size + slack, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not large:
        return tensor_over(buf, shape, dtype)
    _advise(buf)
    base = tensor_over(buf, (1,), torch.uint8).data_ptr()
    return tensor_over(buf, shape, dtype, offset=-base % HUGE_PAGE_BYTES)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, but for a CPU tensor that spans at least one huge page always a copy on memory
    advised for them."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE_BYTES:
        return t.contiguous()
    out = zeros(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
