"""Helpers for the cluster tests: a small cluster config, the Hugging Face reference, stream collection."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.request import PriorityClass, Request, SamplingParams
from gateway.cluster_launch import ClusterConfig

# 48 blocks of 16 tokens: a burst of 16 mixed requests needs more than this, so it must queue.
NUM_BLOCKS = 48


def cluster_config(
    mode: str, name: str, shape_policy: str = "auto", num_blocks: int = NUM_BLOCKS, **kw
) -> ClusterConfig:
    engine = EngineConfig(
        model="tiny",
        device="cpu",
        skip_warmup=True,
        shape_policy=shape_policy,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_model_len=512, max_num_seqs=16, max_num_prefill_seqs=4, max_num_batched_tokens=1024
        ),
    )
    return ClusterConfig(
        engine=engine,
        mode=mode,
        name=name,
        namespace=kw.pop("namespace", "bucketserve-tests"),
        worker_num_cpus=0.5,
        # Layer by layer unless a test says otherwise: the suites were written against the streamed hand-off, and
        # auto would turn it off for these one-thread CPU workers (test_cluster_backend covers auto and off).
        stream_kv_layers=kw.pop("stream_kv_layers", True),
        **kw,
    )


def make_request(
    rid: str, prompt_len: int, max_tokens: int, seed: int = 0, priority: str = "online"
) -> Request:
    rng = random.Random(f"{rid}-{seed}")
    return Request(
        rid,
        [rng.randrange(10, 4000) for _ in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority_class=PriorityClass(priority),
    )


@dataclass
class Collected:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None


async def collect(backend, req: Request, started: asyncio.Event | None = None) -> Collected:
    got = Collected(req.request_id)
    async for out in backend.generate(req):
        if out.new_token_ids and got.first_token_at is None:
            got.first_token_at = time.monotonic()
            if started is not None:
                started.set()
        got.tokens += out.new_token_ids
        if out.finished:
            got.finished_at = time.monotonic()
            got.finish_reason = out.finish_reason
            got.error = out.error
    # The gateway tells the controller in a background task; each test runs its own event loop, which must
    # not close before that call is sent.
    settle = getattr(backend, "settle", None)
    if settle is not None:
        await settle()
    return got


async def gather_all(backend, tasks: list[asyncio.Task], timeout: float) -> list[Collected]:
    """Every task's result, or an assertion that names the requests still open and what the cluster holds."""
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    if not pending:
        return [t.result() for t in tasks]
    open_ids = sorted(backend._streams)
    state = None
    if getattr(backend.handles, "controller", None) is not None:
        try:
            state = await asyncio.wait_for(backend.handles.controller.state.remote(), 10)
        except Exception as e:
            state = repr(e)
    stats = {}
    for name, w in backend.handles.workers.items():
        if name in backend._down:
            continue
        try:
            s = await asyncio.wait_for(w.handle.stats.remote(), 10)
            stats[name] = {
                k: s.get(k) for k in ("kv_blocks_free", "kv_blocks_used", "running", "waiting", "transport")
            }
        except Exception as e:
            stats[name] = repr(e)
    for t in pending:
        t.cancel()
    raise AssertionError(
        f"{len(pending)} of {len(tasks)} requests did not end within {timeout:g} s; open streams {open_ids}, "
        f"down {sorted(backend._down)}; controller state {state}; worker stats {stats}; "
        f"core gate locks held {core_gate_holders()}"
    )


def core_gate_holders() -> dict[str, list[int]] | str:
    """Which processes hold each core gate lock of this node now (``worker/core_gate.py``), from /proc/locks: a
    hang in core borrowing shows up as a lock held by a process that waits for something else."""
    from worker.core_gate import gate_dir

    try:
        names = {os.stat(os.path.join(gate_dir(), n)).st_ino: n for n in os.listdir(gate_dir())}
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError as e:
        return f"unreadable ({e!r})"
    held: dict[str, list[int]] = {}
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 3846 fe:00:1466568 0 EOF"; a waiter's line has "->" after the number
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        inode = int(parts[5].rsplit(":", 1)[1])
        if inode in names:
            held.setdefault(names[inode], []).append(int(parts[4]))
    return held


async def wait_idle(backend, timeout: float = 10.0) -> dict[str, dict]:
    """Worker stats once every worker holds no KV block (or the last stats at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await backend.worker_stats()
        if all(s["kv_blocks_used"] == 0 for s in stats.values()) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


def assert_all_equal_hf(results: list[Collected], reqs: list[Request], reference) -> None:
    """Every collected request completed without error, token for token equal to Hugging Face greedy
    (``reference``: the ``hf_reference`` fixture's model) on the same prompt and length."""
    by_id = {r.request_id: r for r in reqs}
    for g in results:
        req = by_id[g.request_id]
        assert g.error is None, (g.request_id, g.error)
        assert g.tokens == reference.greedy(req.prompt_token_ids, req.sampling.max_tokens, ignore_eos=True), (
            g.request_id
        )
