"""Fresh prompts through SDPA, the rest of the step through the paged kernel: the split against a dense float64
reference, and the device choosing it only for 16-bit caches on an AMX CPU."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention_kernel import dense_reference, make_case

from engine.device.cpu import CpuDevice
from engine.kernels import build
from engine.kernels.fresh_prefill import FRESH_MIN_TOKENS, FreshPrefillAttention

# (q_len, seq_len): decodes, a later chunk, long fresh prompts (first, in the middle, last), a short fresh one
MIXED = [
    (FRESH_MIN_TOKENS + 37, FRESH_MIN_TOKENS + 37),
    (1, 90),
    (1, 17),
    (40, 300),
    (FRESH_MIN_TOKENS, FRESH_MIN_TOKENS),
    (FRESH_MIN_TOKENS - 1, FRESH_MIN_TOKENS - 1),
    (1, 5),
    (2 * FRESH_MIN_TOKENS + 3, 2 * FRESH_MIN_TOKENS + 3),
]
LONG_FRESH = 3


def _kernel():
    op = build.load()
    assert op is not None, "every host we run on has a compiler: the kernel must build"
    return op


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bs", [16, 32])
def test_mixed_step_matches_the_dense_reference(dtype: torch.dtype, tol: float, bs: int) -> None:
    case = make_case(MIXED, kvh=4, bs=bs, dtype=dtype, seed=bs)
    attend = FreshPrefillAttention(_kernel())
    out = torch.full_like(case.q, float("nan"))
    attend(*case.args(out))
    assert attend.calls == LONG_FRESH
    want = dense_reference(case)
    assert not out.isnan().any()  # every token was written, by one path or the other
    assert torch.allclose(out.double(), want, rtol=tol, atol=tol), (out.double() - want).abs().max()


def test_without_a_long_fresh_prompt_it_is_one_kernel_call() -> None:
    calls = []
    kernel = _kernel()

    def counting(*args) -> None:
        calls.append(args[5].numel())  # seq_lens: how many sequences the call covers
        kernel(*args)

    case = make_case(
        [(1, 90), (40, 300), (FRESH_MIN_TOKENS - 1, FRESH_MIN_TOKENS - 1)], kvh=4, bs=16, dtype=torch.float32
    )
    attend = FreshPrefillAttention(counting)
    out = torch.empty_like(case.q)
    attend(*case.args(out))
    assert calls == [3] and attend.calls == 0
    assert torch.allclose(out.double(), dense_reference(case), rtol=2e-5, atol=2e-5)


def test_the_kernel_gets_one_call_per_run_of_other_sequences() -> None:
    calls = []
    kernel = _kernel()

    def counting(*args) -> None:
        calls.append(args[5].tolist())
        kernel(*args)

    case = make_case(MIXED, kvh=4, bs=16, dtype=torch.float32)
    FreshPrefillAttention(counting)(*case.args(torch.empty_like(case.q)))
    # MIXED's runs between the long fresh prompts: (90, 17, 300), then (127, 5)
    assert calls == [[90, 17, 300], [FRESH_MIN_TOKENS - 1, 5]]


def test_min_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        FreshPrefillAttention(_kernel(), min_tokens=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, None])
def test_the_cpu_device_picks_it_for_16_bit_caches_on_amx_only(dtype: torch.dtype | None) -> None:
    attend = CpuDevice().paged_attention(dtype)
    amx = torch.cpu._is_amx_tile_supported()
    if dtype in (torch.bfloat16, torch.float16) and amx:
        assert isinstance(attend, FreshPrefillAttention)
    else:
        assert attend is _kernel()
