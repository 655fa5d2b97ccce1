"""worker/heap.py: the heap trim a prefill worker runs when its queue empties gives freed memory back to the
kernel, and workers start with oneDNN's primitive cache bounded (an operator's own value kept)."""

from __future__ import annotations

import os

import pytest

from gateway.cluster_launch import ClusterConfig, worker_runtime_env
from worker.heap import ONEDNN_CACHE_DEFAULT, ONEDNN_CACHE_ENV, trim_heap, worker_env


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_trim_hands_freed_heap_pages_back():
    # 2,000 buffers of 64 KiB (below glibc's mmap threshold, so on the heap), each written through; the last one
    # stays alive so that freeing the others leaves a hole that free() alone does not give back.
    chunk = 64 * 1024
    bufs = [bytearray(b"\x01") * chunk for _ in range(2000)]
    keep = bufs.pop()
    del bufs
    before = _rss_kib()
    assert trim_heap() is True
    after = _rss_kib()
    freed_mib = (before - after) / 1024
    # ~125 MiB were freed; most of it must leave the process.
    assert freed_mib > 60, f"RSS {before / 1024:.0f} -> {after / 1024:.0f} MiB after the trim"
    assert keep[0] == 1


def test_workers_start_with_onednn_cache_bounded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ONEDNN_CACHE_ENV, raising=False)
    assert worker_env() == {ONEDNN_CACHE_ENV: ONEDNN_CACHE_DEFAULT}
    env = worker_runtime_env(ClusterConfig(quiet=True))["env_vars"]
    assert env[ONEDNN_CACHE_ENV] == ONEDNN_CACHE_DEFAULT and env["TQDM_DISABLE"] == "1"
    assert "TQDM_DISABLE" not in worker_runtime_env(ClusterConfig(quiet=False))["env_vars"]
    # An operator's own setting wins.
    monkeypatch.setenv(ONEDNN_CACHE_ENV, "256")
    assert worker_runtime_env(ClusterConfig())["env_vars"][ONEDNN_CACHE_ENV] == "256"
    assert os.environ[ONEDNN_CACHE_ENV] == "256"
