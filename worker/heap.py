"""Handing freed heap memory back to the kernel, and the oneDNN cache bound a worker starts with.

A prefill worker allocates activation buffers whose sizes follow each batch's token count. glibc keeps what such
buffers leave free on its heaps (its mmap threshold rises to the largest size freed), so the worker's resident
memory climbs for a long while under varied prompts, and oneDNN adds one cached primitive per GEMM shape seen (up
to 1024 of each kind). ``bucketserve bench prefill-memory`` measured both on the default model: 400 prefills of
random lengths grew RSS by ~580 MiB with the defaults and by ~230 MiB with a 16-primitive cache plus a heap trim
after each batch, at the same step time; sending large buffers to mmap instead (``MALLOC_MMAP_THRESHOLD_``)
bounded it as well but made every prefill ~1.6x slower, from page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# Read once by oneDNN when it first runs a primitive, so it goes into a worker's environment before its process
# starts (Ray's runtime_env); a value the operator set is kept.
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_DEFAULT = "16"


def worker_env() -> dict[str, str]:
    """The variables a worker's process starts with for a bounded memory footprint."""
    return {ONEDNN_CACHE_ENV: os.environ.get(ONEDNN_CACHE_ENV, ONEDNN_CACHE_DEFAULT)}


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library is another (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return the free pages of every glibc heap to the kernel (a few ms); False where there is no glibc."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
