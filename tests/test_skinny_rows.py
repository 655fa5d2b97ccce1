"""The skinny kernel's row limit per dtype and host (a pure policy), and what this host gets from it."""

from __future__ import annotations

import pytest
import torch

from engine.skinny_rows import AMX_BF16_ROWS, DEFAULT_ROWS, PREFETCHED_FP32_ROWS, skinny_row_limit


@pytest.mark.parametrize(
    ("dtype", "isa", "prefetch", "amx", "want"),
    [
        ("bfloat16", "AVX512", True, True, AMX_BF16_ROWS),  # oneDNN on the matrix unit
        ("bfloat16", "AVX512", True, False, DEFAULT_ROWS),
        ("float32", "AVX512", True, True, PREFETCHED_FP32_ROWS),  # AMX has no fp32 tiles
        ("float32", "AVX512", True, False, PREFETCHED_FP32_ROWS),
        ("float32", "AVX512", False, False, DEFAULT_ROWS),  # AMD: no software prefetch
        ("float32", "AVX2", True, False, DEFAULT_ROWS),  # measured only with AVX-512's 12-row passes
        ("float16", "AVX512", True, True, DEFAULT_ROWS),
    ],
)
def test_each_host_gets_the_limit_measured_for_it(dtype, isa, prefetch, amx, want) -> None:
    assert skinny_row_limit(dtype, isa, prefetch, amx) == want


def test_the_limits_keep_their_order() -> None:
    # bf16 on AMX hands over earliest, prefetched fp32 latest; a decode batch of one always stays skinny
    assert 1 < AMX_BF16_ROWS < DEFAULT_ROWS < PREFETCHED_FP32_ROWS


def test_this_host_gets_the_limit_of_its_own_facts() -> None:
    from engine.kernels.build import load_skinny_linear
    from engine.linear_prepack import skinny_max_rows

    assert load_skinny_linear() is not None, "the skinny linear kernel did not build"
    prefetch = bool(torch.ops.bucketserve_cpu.prefetches_fp32_weights())
    amx = bool(torch.cpu._is_amx_tile_supported())
    isa = torch.backends.cpu.get_cpu_capability()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        assert skinny_max_rows(dtype) == skinny_row_limit(name, isa, prefetch, amx)
