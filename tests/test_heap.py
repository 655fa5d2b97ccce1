"""``engine.heap``: the settings it makes and leaves alone, and that a kept heap stops a step's page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, MMAP_THRESHOLD, USER_SETTINGS, heap_settings

# Prompt steps of varied token counts t: per layer, activations of t x 1024 / 512 / 2816 / 1408 floats written and
# freed in a prefill's order (every block under 32 MiB); the page faults of the last step.
STEP_FAULTS = """
import json, resource, sys, torch
sys.path.insert(0, {root!r})
from engine.heap import keep_heap
kept = keep_heap()
def step(t):
    h = torch.empty(t * 512).fill_(1.0)
    for _ in range(8):
        qkv = torch.empty(t * 1024).fill_(1.0)
        a = torch.empty(t * 512).fill_(1.0)
        del qkv
        h = h + a
        del a
        gate_up = torch.empty(t * 2816).fill_(1.0)
        m = torch.empty(t * 1408).fill_(1.0)
        del gate_up
        d = torch.empty(t * 512).fill_(1.0)
        del m
        h = h + d
        del d
for t in (2000, 1500, 2800):
    step(t)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step(2500)
print(json.dumps({{"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}}))
"""


def test_settings_fix_the_mmap_threshold_and_stop_trimming():
    assert heap_settings({"PATH": "/bin"}) == {M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: 2**31 - 1}
    assert MMAP_THRESHOLD == 32 * 2**20  # glibc's ceiling on 64-bit: a larger value is refused


@pytest.mark.parametrize("name", USER_SETTINGS)
def test_a_users_own_malloc_variable_leaves_the_heap_alone(name):
    assert heap_settings({name: "65536"}) == {}


def _child(code: str, env: dict[str, str]) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code.format(root=root)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# A fresh process's first 20 MiB block and what glibc says of its heap then and once it is freed (mallinfo2).
BLOCK = """
import ctypes, json, sys, torch
sys.path.insert(0, {root!r})
from engine.heap import keep_heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
kept = keep_heap()
x = torch.empty(5 * 2**20).fill_(1.0)
held = libc.mallinfo2()
del x
freed = libc.mallinfo2()
print(json.dumps({{"kept": kept, "mapped_held": held.hblkhd, "heap_after_free": freed.arena}}))
"""

linux_glibc = pytest.mark.skipif(
    sys.platform != "linux" or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"), reason="glibc only"
)


@linux_glibc
def test_a_kept_heap_takes_large_blocks_and_keeps_them_when_freed():
    base = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    mib = 2**20
    kept = _child(BLOCK, base)
    assert kept["kept"]
    assert kept["mapped_held"] < 20 * mib  # the block came from the heap, not a mapping of its own
    assert kept["heap_after_free"] >= 20 * mib  # and the heap kept its pages once it was freed
    default = _child(BLOCK, {**base, "GLIBC_TUNABLES": ""})  # a user variable: glibc's own behaviour
    assert not default["kept"]
    assert default["mapped_held"] >= 20 * mib  # glibc's default maps such a block, and unmaps it when freed


@linux_glibc
def test_a_kept_heap_reuses_last_steps_pages():
    base = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    # glibc's own behaviour faults ~9,000-14,000 pages in the last step in most processes (some reuse its pages:
    # it depends on where earlier blocks landed); a kept heap reuses them in every one.
    for _ in range(3):
        kept = _child(STEP_FAULTS, base)
        assert kept["kept"] and kept["faults"] < 200, kept
