"""``bucketserve bench prefill-memory`` end to end on the tiny model: every setting runs in its own process with
its environment, and the report holds each one's step time, its ratio to the default settings and its RSS."""

from __future__ import annotations

import json

from engine.heap import trim_heap
from gateway.cli import main


def test_prefill_memory_report(tmp_path, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    out = tmp_path / "pm"
    argv = [
        "bench",
        "prefill-memory",
        "--model",
        "tiny",
        "--prefills",
        "6",
        "--warmup",
        "2",
        "--max-len",
        "200",
    ]
    assert main([*argv, "--repeats", "1", "--settings", "both,onednn16+trim,glibc", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())["result"]
    assert set(result) >= {"default", "both", "onednn16+trim", "glibc"}
    # The engine keeps the heap unless a glibc malloc variable says otherwise.
    assert result["default"]["heap_kept"] == [True] and result["onednn16+trim"]["heap_kept"] == [True]
    assert result["both"]["heap_kept"] == [False] and result["glibc"]["heap_kept"] == [False]
    assert result["default"]["env_seen"] == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": None,
        "MALLOC_MMAP_THRESHOLD_": None,
    }
    assert result["both"]["env_seen"] == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    assert result["onednn16+trim"]["trim_after_each_prefill"] is True
    for name in ("default", "both", "onednn16+trim"):
        r = result[name]
        assert len(r["ms_per_token"]) == 1 and r["ms_per_token"][0] > 0
        assert r["rss_end_mib"][0] > 0 and len(r["rss_trace_mib"][0]) == 10
    assert result["default"]["ratio_to_default"] == [1.0]
    assert "| onednn16+trim |" in out.with_suffix(".md").read_text()


def test_prefill_memory_rejects_unknown_settings(capsys):
    assert main(["bench", "prefill-memory", "--settings", "nope", "--out", "/nonexistent/x"]) == 2
    assert "--settings: unknown nope" in capsys.readouterr().err


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
