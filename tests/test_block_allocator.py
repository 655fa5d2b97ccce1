"""Block allocator under random operations: all-or-nothing, no leaks, integrity always holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_allocator import BlockAllocator, NoFreeBlocksError


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 64), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=80))
def test_random_allocate_free_keeps_integrity(total: int, ops: list[tuple[bool, int]]) -> None:
    alloc = BlockAllocator(total)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            before = alloc.num_free
            if n > before:
                with pytest.raises(NoFreeBlocksError):
                    alloc.allocate(n)
                assert alloc.num_free == before  # nothing taken on failure
            else:
                got = alloc.allocate(n)
                assert len(got) == len(set(got)) == n
                held.append(got)
        elif held:
            alloc.free(held.pop(n % len(held)))
        alloc.check_integrity()
        assert alloc.num_used == sum(map(len, held))
        assert alloc.num_free + alloc.num_used == total
    for h in held:
        alloc.free(h)
    alloc.check_integrity()
    assert alloc.num_free == total


def test_double_free_and_foreign_ids_are_refused() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    alloc.free(ids)
    with pytest.raises(ValueError, match="not in use"):
        alloc.free(ids)
    with pytest.raises(ValueError):
        alloc.free([99])
    alloc.check_integrity()


def test_integrity_check_catches_corruption() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(1)
    alloc._free.append(alloc._free[0])  # simulate a bug: one id twice in the free list
    with pytest.raises(AssertionError):
        alloc.check_integrity()


def test_freed_run_comes_back_ascending() -> None:
    # KV transfer copies each run of consecutive ids at once: a request's blocks must not come back reversed.
    a = BlockAllocator(64)
    first = a.allocate(40)
    assert first == list(range(40))
    a.free(first)
    again = a.allocate(40)
    assert again == list(range(40))
    a.free(again[:10])
    assert a.allocate(10) == list(range(10))
