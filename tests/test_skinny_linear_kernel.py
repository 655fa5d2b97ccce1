"""The skinny linear kernel (C++, few rows: decode steps) against float64 matmuls, and its place in the prepacked linears."""

from __future__ import annotations

import gc

import pytest
import torch
from engine_helpers import (
    ONEDNN_BF16,
    can_run_amx_bf16,
    can_run_bf16_dot,
    cpuinfo_field,
    needs_bf16_prepack,
    pinned_bf16_dot,
    pinned_kernel_path,
)

from engine import linear_prepack
from engine.kernels import build
from engine.linear_prepack import (
    PROBE_ROWS,
    panel_layout,
    prepack_linears,
    probe_rows,
    skinny_max_rows,
    skinny_rows_lowered,
)
from engine.skinny_rows import ALL_ROWS


@pytest.fixture(autouse=True)
def _panels_on_any_host(monkeypatch):
    # The product gives linears panels on AVX-512 and AVX2 hosts only, where the kernel was measured to beat
    # oneDNN; its portable C++ (slow, exact) runs these tests on any other host too.
    monkeypatch.setattr(
        linear_prepack, "_wants_panels", lambda dtype: dtype in (torch.float32, torch.bfloat16)
    )


@pytest.fixture(scope="module")
def skinny():
    op = build.load_skinny_linear()
    # Every host we run on has a compiler: the kernel must build here, not skip.
    assert op is not None, "the skinny linear kernel did not build"
    return op


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y + bias.double() if bias is not None else y).float()


WIDEN, DOT, AMX = 0, 1, 2  # the kernel's ways of multiplying bf16 rows by bf16 weights (linear_bf16_path)


def _path() -> int:
    return int(torch.ops.bucketserve_cpu.linear_bf16_path())


def _uses_bf16_dot() -> bool:
    return _path() == DOT


def _pairwise_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 [M, N]: what VDPBF16PS accumulates for bf16 x [M, K] and w [N, K]: from the bias, per pair of k steps
    the product of k + 1, then of k, each exact in fp32 and added with one rounding (an odd K's last step last)."""
    xf, wf = x.float(), w.float()
    m, k = x.shape
    acc = (bias.float() if bias is not None else torch.zeros(w.shape[0])).expand(m, -1).clone()
    steps = [j for k0 in range(0, k - 1, 2) for j in (k0 + 1, k0)] + ([k - 1] if k % 2 else [])
    for j in steps:
        acc = acc + xf[:, j : j + 1] * wf[:, j]
    return acc


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 11, 12, 13, 16, 17, 24, 33, 64, 600])  # 600: chunks of rows
@pytest.mark.parametrize(("n", "k"), [(96, 64), (100, 37), (48, 8), (16, 1), (1408, 512), (5, 300)])
def test_matches_a_float64_matmul(skinny, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    panels = panel_layout(w)
    assert panels.shape == (-(-n // 16), k, 16)
    torch.testing.assert_close(skinny(x, panels, None, n), _reference(x, w, None), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(skinny(x, panels, bias, n), _reference(x, w, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [4, 8, 13, 40, 600])  # 600: over two chunks of rows and a tail
@pytest.mark.parametrize(("n", "k"), [(100, 300), (1408, 512)])
@pytest.mark.parametrize(
    ("dtype", "path"),
    [(torch.float32, WIDEN), (torch.bfloat16, WIDEN), (torch.bfloat16, DOT), (torch.bfloat16, AMX)],
)
def test_a_row_gets_the_same_bits_in_any_batch(
    skinny, m: int, n: int, k: int, dtype: torch.dtype, path: int
) -> None:
    # On each path every accumulator sums its products in the same order from the bias, however many rows share a
    # pass: a decode's result does not depend on the batch it runs in. (By default on AMX hosts a single bf16 row
    # takes the widened path, 2 and more AMX tiles: test_amx_takes_bf16_rows_from_two_by_default.)
    with _pin_path(path):
        _check_batch_invariance(skinny, m, n, k, dtype)


def _check_batch_invariance(skinny, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    panels = panel_layout(w)
    alone = torch.cat([skinny(x[i : i + 1], panels, bias, n) for i in range(m)])
    assert torch.equal(skinny(x, panels, bias, n), alone)


@pytest.mark.parametrize("m", [1, 8, 13, 40])
@pytest.mark.parametrize(("n", "k"), [(100, 37), (1408, 512)])
def test_bf16_weights_and_rows_are_widened_exactly(skinny, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    got = skinny(x, panel_layout(w), bias, n)
    assert got.dtype == torch.bfloat16
    # fp32 sums of the exact bf16 values (widened, multiplied in pairs by the CPU's bf16 dot product, or on AMX
    # tiles: whichever path this CPU takes by default), rounded once to bf16: within one bf16 rounding of float64
    want = _reference(x.float(), w.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())
    # fp32 rows over bf16 weights (mixed) give fp32
    assert skinny(x.float(), panel_layout(w), None, n).dtype == torch.float32


@pytest.mark.parametrize("k", [1, 2, 37, 64])
def test_bf16_panels_hold_pairs_of_k_steps_per_column(k: int) -> None:
    # fp32 panels: [p, k, c] = W[16p + c, k]. bf16: each two k steps' 32 values as (k, k + 1) pairs per column
    # (the order the CPU's pair instructions and AMX tiles read), an odd K's last step alone in its 16 values.
    w = (torch.arange(20 * k) % 251).float().view(20, k)  # every value exact in bf16, neighbours distinct
    fp32 = panel_layout(w)
    assert torch.equal(fp32.transpose(1, 2).reshape(-1, k)[:20], w)
    bf16 = panel_layout(w.bfloat16()).float()
    assert bf16.shape == (2, k, 16)
    for p in range(2):
        for c in range(16):
            col = w[16 * p + c] if 16 * p + c < 20 else torch.zeros(k)
            for j in range(k):
                row, word = (j // 2 * 2, 2 * c + j % 2) if j + (j % 2 == 0) < k else (j, c)
                assert bf16[p].flatten()[row * 16 + word] == col[j], (p, c, j)


@pytest.mark.parametrize("m", [1, 5, 13, 40])
@pytest.mark.parametrize(("n", "k"), [(100, 37), (1408, 512), (40, 1)])
def test_bf16_weights_widen_to_the_fp32_weights_bits(skinny, m: int, n: int, k: int) -> None:
    # fp32 rows over bf16 weights are widened exactly and summed in the fp32 pass's order, whatever the bf16
    # panel's pair layout: the same bits as the fp32 weights holding the same values (plain and gated).
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    assert torch.equal(skinny(x, panel_layout(w), bias, n), skinny(x, panel_layout(w.float()), bias, n))
    half = n // 2
    silu_mul = torch.ops.bucketserve_cpu.skinny_silu_mul

    def gated(v: torch.Tensor) -> torch.Tensor:
        pairs = torch.stack([panel_layout(v[:half]), panel_layout(v[half : 2 * half])], 1).flatten(0, 1)
        return silu_mul(x, pairs, half)

    assert torch.equal(gated(w), gated(w.float()))


def _pin_dot(dot: bool):
    return pinned_bf16_dot(torch.ops.bucketserve_cpu.set_linear_bf16_path, dot)


def _pin_amx():
    missing = "this CPU has no AMX bf16 tiles (or this build no AVX-512)"
    return pinned_kernel_path(
        torch.ops.bucketserve_cpu.set_linear_bf16_path, AMX, can_run_amx_bf16(), missing
    )


def _pin_path(path: int):
    return _pin_amx() if path == AMX else _pin_dot(path == DOT)


def test_amx_takes_bf16_rows_from_two_by_default(skinny) -> None:
    # A single row is no slower widened than on AMX tiles (skinny_linear_cpu.cpp, kAmxMinRows): by default an AMX
    # host's single bf16 rows get the widened pass's bits, from 2 rows the AMX pass's.
    if _path() != AMX:
        pytest.skip("bf16 rows do not take AMX tiles by default here (no AMX, or this build no AVX-512)")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(1408, 1408, generator=gen).bfloat16()
    panels = panel_layout(w)
    for m, path in ((1, WIDEN), (2, AMX), (4, AMX), (5, AMX), (33, AMX)):
        x = torch.randn(m, 1408, generator=gen).bfloat16()
        default = skinny(x, panels, None, 1408)
        with _pin_path(path):
            assert torch.equal(default, skinny(x, panels, None, 1408)), (m, path)
    # the two paths' bits differ (so the equalities above tell them apart): 40 x 1408 results differ in some
    x = torch.randn(40, 1408, generator=gen).bfloat16()
    with _pin_path(WIDEN):
        widened = skinny(x, panels, None, 1408)
    assert not torch.equal(widened, skinny(x, panels, None, 1408))


@pytest.mark.parametrize("m", [1, 4, 5, 16, 17, 32, 33, 64, 70])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (100, 37), (1408, 512), (33, 1408)])
def test_amx_pass_matches_a_float64_matmul(skinny, m: int, n: int, k: int) -> None:
    # The AMX pass (pinned: every row count takes it): 16-row blocks, two a pass, more than one pass from 33 rows; K
    # not a multiple of the tile's 32 steps (37: x padded); partial last panels (100, 33). The matrix unit's own sums
    # (in fp32, in an order of its own), rounded once to bf16: within one bf16 rounding of the float64 result.
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    half = n // 2
    pairs = torch.stack([panel_layout(w[:half]), panel_layout(w[half : 2 * half])], 1).flatten(0, 1)
    with _pin_amx():
        got = skinny(x, panel_layout(w), bias, n)
        gated = torch.ops.bucketserve_cpu.skinny_silu_mul(x, pairs, half)
    want = _reference(x.float(), w.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())
    g, u = (
        _reference(x.float(), w[:half].float(), None),
        _reference(x.float(), w[half : 2 * half].float(), None),
    )
    want_gated = torch.nn.functional.silu(g) * u
    tol = 8e-3 * want_gated.abs().max().item()
    torch.testing.assert_close(gated.float(), want_gated, rtol=1.6e-2, atol=tol)


def test_amx_pass_keeps_nans_and_infinities(skinny) -> None:
    # A row with infinities of both signs gives NaN where the widened pass does (inf - inf), else infinities; the
    # other rows stay finite.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=gen).bfloat16()
    x[0, :2] = torch.tensor([float("inf"), -float("inf")])
    w = torch.randn(40, 64, generator=gen).bfloat16()
    with pinned_kernel_path(torch.ops.bucketserve_cpu.set_linear_bf16_path, WIDEN, True, ""):
        widened = skinny(x, panel_layout(w), None, 40)
    with _pin_amx():
        got = skinny(x, panel_layout(w), None, 40)
    assert torch.equal(got.isnan(), widened.isnan())
    assert got[0].isnan().any() and not got[0].isfinite().any() and got[1:].isfinite().all()


@pytest.mark.parametrize("m", [1, 8, 13])
@pytest.mark.parametrize(
    ("weights", "dot"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_bf16_rows_give_the_fp32_rows_result_rounded_by_torch(
    skinny, m: int, weights: torch.dtype, dot: bool
) -> None:
    # bf16 rows are widened and the result rounded inside the kernel: bit for bit (NaNs staying NaN) what widening
    # with torch, the fp32-rows path and Tensor.to(bfloat16) give, for the plain and the gated operator. Over bf16
    # weights with the dot-product pass pinned (VDPBF16PS, on a CPU that has it) the rows are multiplied in pairs
    # instead: then bit for bit what that instruction's order of additions gives, rounded by torch.
    with _pin_dot(dot):
        _check_bf16_rows(skinny, m, weights)


def _check_bf16_rows(skinny, m: int, weights: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(2 * m, 300, generator=gen).bfloat16()[::2]  # [m, 300], rows 2 apart
    w = torch.randn(100, 300, generator=gen).to(weights)
    bias = torch.randn(100, generator=gen).to(weights)
    # infinities and a denormal go through the widening too
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), 1e-40])
    got = skinny(x, panel_layout(w), bias, 100)
    assert got.dtype == torch.bfloat16
    assert got.isnan().any()  # row 0's infinities made NaNs: they must stay NaN
    silu_mul = torch.ops.bucketserve_cpu.skinny_silu_mul
    gate, up = panel_layout(w[:50]), panel_layout(w[50:])
    pairs = torch.stack([gate, up], 1).flatten(0, 1)  # gate 0, up 0, gate 1, up 1, ...
    if weights == torch.bfloat16 and _uses_bf16_dot():
        _same_bf16(got, _pairwise_reference(x, w, bias).to(torch.bfloat16))
        g, u = _pairwise_reference(x, w[:50], None), _pairwise_reference(x, w[50:], None)
        _same_bf16(silu_mul(x, pairs, 50), (torch.nn.functional.silu(g) * u).to(torch.bfloat16))
    else:
        _same_bf16(got, skinny(x.float(), panel_layout(w), bias, 100).to(torch.bfloat16))
        _same_bf16(silu_mul(x, pairs, 50), silu_mul(x.float(), pairs, 50).to(torch.bfloat16))


@pytest.mark.parametrize(("m", "n", "k"), [(40, 1408, 1408), (40, 100, 300), (3, 40, 37)])
def test_bf16_dot_products_add_each_pair_in_the_instructions_order(skinny, m: int, n: int, k: int) -> None:
    # The dot-product pass's bits, pinned: per pair of k steps, k + 1's product then k's (an odd K's last step
    # alone), plain and gated. 40 x 1408 outputs over K = 1408 tell orders apart: the k steps in turn differ in 8.
    with _pin_dot(True):
        _check_pairwise_order(skinny, m, n, k)


def _check_pairwise_order(skinny, m: int, n: int, k: int) -> None:
    assert _uses_bf16_dot()
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    _same_bf16(skinny(x, panel_layout(w), bias, n), _pairwise_reference(x, w, bias).to(torch.bfloat16))
    half = n // 2
    pairs = torch.stack([panel_layout(w[:half]), panel_layout(w[half:])], 1).flatten(0, 1)
    g, u = _pairwise_reference(x, w[:half], None), _pairwise_reference(x, w[half:], None)
    want = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
    _same_bf16(torch.ops.bucketserve_cpu.skinny_silu_mul(x, pairs, half), want)


def _same_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits everywhere but in NaNs, which must be NaN in both (a NaN's payload may differ)."""
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16))


def test_reads_a_strided_input_and_an_empty_batch(skinny) -> None:
    w = torch.randn(40, 24)
    x = torch.randn(24, 6).T  # [6, 24], not contiguous
    torch.testing.assert_close(
        skinny(x, panel_layout(w), None, 40), _reference(x, w, None), rtol=1e-4, atol=1e-4
    )
    assert skinny(torch.randn(0, 24), panel_layout(w), None, 40).shape == (0, 40)


def test_bad_shapes_and_dtypes_are_refused_with_a_reason(skinny) -> None:
    w = torch.randn(40, 24)
    panels = panel_layout(w)
    with pytest.raises(RuntimeError, match="K = 25"):
        skinny(torch.randn(2, 25), panels, None, 40)
    with pytest.raises(RuntimeError, match="cannot hold n = 49"):
        skinny(torch.randn(2, 24), panels, None, 49)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        skinny(torch.randn(2, 24, dtype=torch.float16), panels, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        skinny(torch.randn(2, 24), panels, torch.randn(39), 40)


@pytest.mark.parametrize(
    "rows_at",
    [lambda n: 1, lambda n: n, lambda n: n + 1, lambda n: 3 * n],
    ids=["1", "limit", "limit+1", "3x"],
)
def test_a_packed_linear_takes_the_skinny_kernel_up_to_its_row_limit(skinny, rows_at) -> None:
    limit = skinny_max_rows(torch.float32)
    rows = rows_at(limit)
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = lin(x)
        prepack_linears(lin)
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
        # Which kernel ran: with its panels zeroed, the skinny kernel gives the bias alone, oneDNN (on its own
        # packed copy) the right answer.
        lin.panel_weight.zero_()
        skinny_ran = torch.equal(lin(x), lin.bias.expand(rows, -1))
    assert lin.skinny_max_rows == limit
    assert skinny_ran == (rows <= limit)


def test_a_freed_layer_takes_its_packed_weight_along(skinny) -> None:
    lin = torch.nn.Linear(64, 96)
    prepack_linears(lin)
    limit = lin.skinny_max_rows
    index, x = lin.packed_index, torch.randn(limit + 1, 64)
    ops = torch.ops.bucketserve_cpu
    assert ops.packed_linear(x, None, None, 96, index, limit).shape == (limit + 1, 96)
    del lin
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no prepacked weight under index {index}"):
        ops.packed_linear(x, None, None, 96, index, limit)


def test_without_the_kernel_extension_every_row_count_runs_on_onednn(monkeypatch) -> None:
    from engine import linear_prepack

    monkeypatch.setattr(linear_prepack, "_kernels", lambda: None)
    lin = torch.nn.Linear(64, 96)
    with torch.inference_mode():
        x = torch.randn(5, 64)
        want = lin(x)
        prepack_linears(lin)
        assert lin.panel_weight is None
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(lin, dynamic=True)
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)


@needs_bf16_prepack
def test_bf16_linears_take_the_skinny_kernel_too(skinny) -> None:
    lin = torch.nn.Linear(64, 96).to(torch.bfloat16)
    with torch.inference_mode():
        prepack_linears(lin)
        assert lin.panel_weight.dtype == torch.bfloat16
        # skinny, then oneDNN's side where it has bf16, else the kernel again over many rows (every row count)
        wide = skinny_max_rows(torch.bfloat16) + 1 if ONEDNN_BF16 else 600
        for rows in (3, wide):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            torch.testing.assert_close(lin(x), want, rtol=2e-2, atol=2e-2)


def test_bf16_linears_are_prepacked_for_onednn_or_else_for_the_kernel_alone(skinny) -> None:
    from engine.linear_prepack import can_prepack, onednn_has

    cpu = torch.device("cpu")
    assert can_prepack(cpu, torch.float32) and onednn_has(torch.float32)
    assert onednn_has(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    # the product's panels go to AVX-512 and AVX2 hosts; this module's fixture gives them to any host
    panels = linear_prepack._wants_panels(torch.bfloat16)
    assert can_prepack(cpu, torch.bfloat16) == (onednn_has(torch.bfloat16) or panels)
    assert not can_prepack(torch.device("meta"), torch.float32)
    if onednn_has(torch.bfloat16) or not panels:
        return
    # No oneDNN bf16 here: panels alone, the kernel at every row count, nothing registered for oneDNN.
    lin = torch.nn.Linear(64, 96).to(torch.bfloat16)
    prepack_linears(lin)
    assert lin.packed_weight is None and lin.panel_weight is not None
    assert lin.skinny_max_rows == skinny_max_rows(torch.bfloat16) == ALL_ROWS
    with pytest.raises(RuntimeError, match="no prepacked weight"):
        torch.ops.bucketserve_cpu.packed_linear(torch.randn(2, 64), None, None, 96, lin.packed_index, 0)
    with skinny_rows_lowered([lin], 1):  # no other side to probe: the limit stays
        assert lin.skinny_max_rows == ALL_ROWS


def test_a_linear_that_no_gemm_here_can_take_is_refused_with_a_reason(monkeypatch) -> None:
    monkeypatch.setattr(linear_prepack, "onednn_has", lambda dtype: False)
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="neither oneDNN nor the skinny kernel can take torch.bfloat16"):
        linear_prepack.prepack_linear(lin, panels=False)


def test_fp32_weights_are_prefetched_in_software_except_on_amd_avx512_cpus(skinny) -> None:
    # Measured per vendor (engine/kernels/skinny_linear_cpu.cpp, panel_rows): the AVX-512 pass prefetches fp32 weights
    # on Intel CPUs and leaves them to AMD's hardware prefetchers; AVX2 passes always prefetch, the portable one never.
    vendor = cpuinfo_field("vendor_id")
    cap = torch.backends.cpu.get_cpu_capability()
    want = {"AVX512": vendor != "AuthenticAMD", "AVX2": True}.get(cap, False)
    assert torch.ops.bucketserve_cpu.prefetches_fp32_weights() is want, (vendor, cap)


def test_bf16_rows_take_amx_tiles_else_the_dot_product_on_amd_else_widened_by_default(skinny) -> None:
    # The kernel reads CPUID itself; the operating system's facts must agree with its choice: AMX tiles where the CPU
    # has them, else the dot product where it measured faster (AMD), else widened FMAs (on Intel's AVX512_BF16 the
    # dot product runs at half the FMAs' flops: engine/kernels/cpu_features.h).
    amd = cpuinfo_field("vendor_id") == "AuthenticAMD"
    want = AMX if can_run_amx_bf16() else DOT if can_run_bf16_dot() and amd else WIDEN
    assert _path() == want, (cpuinfo_field("vendor_id"), torch.backends.cpu.get_cpu_capability())
    assert int(torch.ops.bucketserve_cpu.linear_bf16_path(True)) == want


def test_the_bf16_path_can_be_pinned_where_the_cpu_runs_it_and_is_refused_elsewhere(skinny) -> None:
    ops = torch.ops.bucketserve_cpu
    default = _path()
    try:
        for mode, runnable in ((WIDEN, True), (DOT, can_run_bf16_dot()), (AMX, can_run_amx_bf16())):
            if runnable:
                ops.set_linear_bf16_path(mode)
                assert _path() == mode
                assert int(ops.linear_bf16_path(True)) == default  # the default stays what it is
            else:
                ops.set_linear_bf16_path(WIDEN)
                with pytest.raises(RuntimeError, match="no AVX|no AMX"):
                    ops.set_linear_bf16_path(mode)
                assert _path() == WIDEN
        with pytest.raises(RuntimeError, match="mode -1"):
            ops.set_linear_bf16_path(3)
    finally:
        ops.set_linear_bf16_path(-1)
    assert _path() == default


def test_a_lowered_limit_sends_rows_past_it_to_onednn_meanwhile(skinny) -> None:
    # How start-up probes check the oneDNN side without limit + 1 rows (4097 where the limit is 4096).
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(9, 64)
    with torch.inference_mode():
        prepack_linears(lin)
        limit = lin.skinny_max_rows
        lin.panel_weight.zero_()  # the skinny kernel now gives the bias alone, oneDNN the right answer
        with skinny_rows_lowered([lin], 8):
            assert lin.skinny_max_rows == min(limit, 8)
            assert not torch.equal(lin(x), lin.bias.expand(9, -1))  # oneDNN
            assert torch.equal(lin(x[:8]), lin.bias.expand(8, -1))  # still the kernel
        assert lin.skinny_max_rows == limit
        assert torch.equal(lin(x), lin.bias.expand(9, -1))  # the kernel again
    assert probe_rows(torch.float32) == min(skinny_max_rows(torch.float32), PROBE_ROWS)
