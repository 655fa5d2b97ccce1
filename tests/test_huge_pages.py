"""The engine's large streamed CPU tensors (KV cache, weight panels) live in mappings advised for transparent huge
pages, hold the right values, and small tensors stay ordinary allocations. Whether the kernel then backs a
mapping with 2 MiB pages is its choice; that it was asked is the ``hg`` flag of the mapping in
``/proc/self/smaps``."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from engine import huge_pages
from engine.kv_cache import KVCache, KVCacheSpec
from engine.linear_prepack import panel_layout

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not _THP.exists(),
    reason="this kernel has no transparent huge pages: madvise(MADV_HUGEPAGE) has nothing to ask",
)


def _vm_flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping that holds ``t``'s first byte."""
    addr = t.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds address {addr:#x}")


def _backed_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages that are backed by memory, from ``/proc/self/pagemap`` (bit 63 of each base page's
    entry: present). Not the mapping's Rss in smaps: the kernel merges neighbouring anonymous mappings with the same
    flags into one, whose Rss then counts other tensors too."""
    page = mmap.PAGESIZE
    first = t.data_ptr() // page
    last = (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    present = sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))
    return present * page


def _spec() -> KVCacheSpec:
    """Two layers of 4 KV heads of 64, blocks of 16 fp32 tokens: 64 KiB a block over all layers, K and V."""
    return KVCacheSpec(
        architecture="LlamaForCausalLM",
        num_layers=2,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        dtype="float32",
    )


@needs_thp
def test_zeros_reads_zero_is_writable_and_is_advised() -> None:
    t = huge_pages.zeros((3, 1024, 1024), torch.float32)  # 12 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    t[1, 5, 7] = 2.5
    assert t.sum().item() == 2.5
    assert "hg" in _vm_flags(t)


def test_small_zeros_are_not_advised() -> None:
    t = huge_pages.zeros((16, 16), torch.bfloat16)
    assert not t.any() and t.dtype == torch.bfloat16
    assert "hg" not in _vm_flags(t)


@needs_thp
def test_contiguous_copies_large_tensors_onto_advised_memory() -> None:
    src = torch.randn(1024, 1024).t()  # 4 MiB, not contiguous
    out = huge_pages.contiguous(src)
    assert out.is_contiguous() and torch.equal(out, src)
    assert "hg" in _vm_flags(out)
    same = torch.randn(1024, 1024)
    copied = huge_pages.contiguous(same)
    assert copied.data_ptr() != same.data_ptr() and torch.equal(copied, same)


def test_contiguous_leaves_small_tensors_to_torch() -> None:
    small = torch.randn(64, 64)
    assert huge_pages.contiguous(small) is small
    view = small.t()
    out = huge_pages.contiguous(view)
    assert out.is_contiguous() and torch.equal(out, view)


@needs_thp
def test_kv_cache_and_weight_panels_are_advised() -> None:
    spec = _spec()
    cache = KVCache(spec, num_blocks=256)  # 2 * 2 * 257 * 16 KiB: about 16 MiB
    assert "hg" in _vm_flags(cache.data)
    assert not cache.data.any()
    w = torch.randn(1408, 512)
    panels = panel_layout(w)  # [88, 512, 16]: 2.75 MiB
    assert "hg" in _vm_flags(panels)
    assert torch.equal(panels.transpose(1, 2).reshape(-1, 512)[:1408], w)


def test_large_zeros_start_on_a_huge_page() -> None:
    for shape in [(1024 * 1024 + 3,), (5, 700, 701)]:
        t = huge_pages.zeros(shape, torch.float32)
        assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
        assert t.shape == shape and not t.any()
        t.fill_(1.0)  # every byte of it is inside the mapping
        assert t.sum().item() == t.numel()


def test_prefault_backs_the_first_blocks_and_no_more() -> None:
    spec = _spec()
    cache = KVCache(spec, num_blocks=1024)  # 4 regions (layer, K/V) of 1025 * 16 KiB: about 64 MiB
    total = cache.nbytes
    assert _backed_bytes(cache.data) == 0  # mapped lazily: nothing written yet
    assert cache.prefault(0) == 0
    assert cache.prefault(4 * 2**20) == 64  # 64 blocks of 64 KiB (all layers, K and V)
    backed = _backed_bytes(cache.data)
    # Each region's first 1 MiB is backed; on 2 MiB pages, at most two pages per region.
    assert 4 * 2**20 <= backed <= 16 * 2**20, backed
    assert backed < total // 2
    assert not cache.data.any()  # still zeros, and the blocks past them read as zeros too
    assert cache.prefault(2**40) == 1024
