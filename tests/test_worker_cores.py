"""A worker's cores (``worker/cores.py``) and which workers share a node's cores (``core_sharing``): real
affinity and torch thread counts on this machine, no model."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from gateway.cluster_launch import core_sharing
from worker.cores import borrowed_cores
from worker.info import WorkerInfo

needs_two_cores = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"),
    reason="borrowing a core needs Linux and two cores",
)


def _in_thread(fn):
    """Run ``fn`` in a fresh thread (affinity and OpenMP's thread count are per thread) and return its result."""
    out: list = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # surfaced in the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


@needs_two_cores
def test_a_borrowed_core_widens_the_thread_for_the_block_then_narrows_it_back() -> None:
    def body():
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        seen = {}
        with borrowed_cores((0,), 1, (1,)) as threads:
            seen["inside"] = (threads, torch.get_num_threads(), os.sched_getaffinity(0))
            a = torch.randn(256, 256)
            seen["product"] = float((a @ a).sum())  # runs on the widened team
        seen["after"] = (torch.get_num_threads(), os.sched_getaffinity(0))
        return seen

    saved = torch.get_num_threads()
    try:
        seen = _in_thread(body)
    finally:
        torch.set_num_threads(saved)
    assert seen["inside"] == (2, 2, {0, 1})
    assert seen["after"] == (1, {0})


@needs_two_cores
def test_the_thread_narrows_back_when_the_block_raises() -> None:
    def body():
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        with pytest.raises(RuntimeError, match="boom"), borrowed_cores((0,), 1, (1,)):
            raise RuntimeError("boom")
        return torch.get_num_threads(), os.sched_getaffinity(0)

    saved = torch.get_num_threads()
    try:
        assert _in_thread(body) == (1, {0})
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize(
    ("own", "borrowed"),
    [((), (1,)), ((0,), ()), ((0,), (0,))],
    ids=["not-pinned", "nothing-borrowed", "own-core-only"],
)
def test_nothing_changes_without_a_core_to_borrow(own, borrowed) -> None:
    def body():
        before = (torch.get_num_threads(), os.sched_getaffinity(0))
        with borrowed_cores(own, before[0], borrowed) as threads:
            inside = (threads, torch.get_num_threads(), os.sched_getaffinity(0))
        return before, inside

    before, inside = _in_thread(body)
    assert inside == (before[0], *before)


def _info(name: str, role: str, node: str, cores: tuple[int, ...]) -> WorkerInfo:
    from bucket_manager.shape_buckets import ShapeBucketConfig

    shapes = ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=512, max_num_prefill_seqs=4, max_num_batched_tokens=512
    )
    return WorkerInfo(
        worker_id=name,
        role=role,
        warmed=True,
        startup_s=0.0,
        warmup={},
        kv_blocks_total=64,
        block_size=16,
        max_model_len=512,
        max_num_batched_tokens=512,
        shape_config=shapes,
        eos_token_ids=(),
        model_path="",
        device="cpu",
        dtype="float32",
        shape_policy="flat",
        node_id=node,
        cores=cores,
    )


def test_a_prefill_worker_neighbours_the_decode_workers_pinned_on_its_node_to_other_cores() -> None:
    infos = {
        "p0": _info("p0", "prefill", "n1", (0,)),
        "p1": _info("p1", "prefill", "n2", (0,)),
        "p2": _info("p2", "prefill", "n1", ()),  # not pinned: borrows nothing
        "d0": _info("d0", "decode", "n1", (3,)),
        "d1": _info("d1", "decode", "n1", (0,)),  # the same core as p0: nothing to gain
        "d2": _info("d2", "decode", "n2", (1, 2)),
        "d3": _info("d3", "decode", "n3", (1,)),  # alone on its node
    }
    neighbours, cores = core_sharing(infos)
    assert neighbours == (("p0", ("d0",)), ("p1", ("d2",)))
    assert dict(cores) == {"p0": (0,), "p1": (0,), "d0": (3,), "d1": (0,), "d2": (1, 2), "d3": (1,)}
    assert core_sharing({}) == ((), ())
