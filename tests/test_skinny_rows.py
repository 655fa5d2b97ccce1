"""The skinny kernel's row limit per dtype and host (a pure policy). What this host gets is checked where the packed
linears use it (tests/test_skinny_linear_kernel.py)."""

from __future__ import annotations

import pytest

from engine.skinny_rows import (
    ALL_ROWS,
    AMX_BF16_ROWS,
    DEFAULT_ROWS,
    PREFETCHED_FP32_ROWS,
    ZEN2_FP32_ROWS,
    skinny_row_limit,
)


@pytest.mark.parametrize(
    ("dtype", "isa", "prefetch", "amx", "want"),
    [
        ("bfloat16", "AVX2", True, True, AMX_BF16_ROWS),  # oneDNN on the matrix unit, the kernel on vectors
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


def test_bf16_on_amx_with_the_kernels_own_amx_pass_hands_over_at_the_default() -> None:
    # both on the matrix unit: they meet near 64 rows (engine/skinny_rows.py)
    assert skinny_row_limit("bfloat16", "AVX512", True, True, skinny_amx=True) == DEFAULT_ROWS
    assert skinny_row_limit("bfloat16", "AVX512", True, True, skinny_amx=False) == AMX_BF16_ROWS
    assert skinny_row_limit("float32", "AVX512", True, True, skinny_amx=True) == PREFETCHED_FP32_ROWS


@pytest.mark.parametrize(
    ("dtype", "isa", "zen2", "want"),
    [
        ("float32", "AVX2", True, ZEN2_FP32_ROWS),  # oneDNN's fp32 GEMM is slower than the kernel's there
        ("float32", "AVX2", False, DEFAULT_ROWS),  # Zen 3 and others: measured to meet near 64
        ("bfloat16", "AVX2", True, DEFAULT_ROWS),  # oneDNN has no bf16 GEMM without AVX-512 or AVX-NE-CONVERT
        ("float16", "AVX2", True, DEFAULT_ROWS),
        ("float32", "DEFAULT", True, DEFAULT_ROWS),  # the portable build (a torch without AVX2 kernels)
    ],
)
def test_fp32_on_an_amd_zen2_stays_on_the_kernel_for_prompt_chunks(dtype, isa, zen2, want) -> None:
    assert skinny_row_limit(dtype, isa, True, False, amd_zen2=zen2) == want


@pytest.mark.parametrize("isa", ["AVX2", "AVX512"])
def test_where_onednn_lacks_the_dtype_the_kernel_takes_every_row_count(isa) -> None:
    # bf16 on an AVX2-only CPU: oneDNN has no bf16 path there, and F.linear's runs at a twentieth of the kernel's
    assert skinny_row_limit("bfloat16", isa, True, False, onednn=False) == ALL_ROWS
    assert skinny_row_limit("bfloat16", isa, True, True, amd_zen2=True, onednn=False) == ALL_ROWS


def test_the_limits_keep_their_order() -> None:
    # bf16 on AMX hands over earliest, prefetched fp32 latest, fp32 on Zen 2 later still; a decode batch of one
    # always stays skinny
    assert 1 < AMX_BF16_ROWS < DEFAULT_ROWS < PREFETCHED_FP32_ROWS < ZEN2_FP32_ROWS < ALL_ROWS
