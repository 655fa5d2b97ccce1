"""Our AMX causal attention for fresh bf16 prompts (engine/kernels/fresh_attention_amx.cpp) against a float64
reference, its refusals, and its place in the fresh-prompt split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import can_run_amx_bf16, cpuinfo_field
from test_fresh_prefill import MIXED
from test_paged_attention_kernel import dense_reference, make_case

from engine.device.cpu import CpuDevice
from engine.kernels import build
from engine.kernels.fresh_prefill import FRESH_AMX_MIN_TOKENS, FRESH_MIN_TOKENS, FreshPrefillAttention


@pytest.fixture(scope="module")
def fresh():
    # Every host we run on has a compiler: the kernel must build here, not skip.
    assert build.load_fresh_attention() is not None, "the fresh attention kernel did not build"
    assert build.load() is not None, "the paged attention kernel did not build"
    # Whether it can run is read from the operating system's view of the CPU, not from the kernel's own check, so
    # a kernel that wrongly refuses an AMX host fails here instead of skipping.
    if not (can_run_amx_bf16() and "avx512_bf16" in cpuinfo_field("flags").split()):
        pytest.skip(
            "no AMX bf16 tiles with AVX512_BF16 here (or this build no AVX-512): the kernel cannot run"
        )
    assert torch.ops.bucketserve_cpu.fresh_attention_amx_usable()
    return torch.ops.bucketserve_cpu.fresh_attention_amx


def _prompt(n: int, h: int, kvh: int, d: int, bs: int, start: int, seed: int):
    """A flat batch of start + n + 2 tokens whose rows start .. start + n - 1 are one fresh prompt, its K/V in
    shuffled blocks (with unreferenced NaN blocks beside them), q and out strided views of a QKV-like tensor."""
    g = torch.Generator().manual_seed(seed)
    t = start + n + 2
    nb = -(-n // bs)
    k_cache = torch.full((nb + 3, bs, kvh, d), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("nan"))
    blocks = torch.randperm(nb + 3, generator=g)[:nb].int()
    pos = torch.arange(n)
    k = torch.randn(n, kvh, d, generator=g).bfloat16()
    v = torch.randn(n, kvh, d, generator=g).bfloat16()
    k_cache[blocks.long()[pos // bs], pos % bs] = k
    v_cache[blocks.long()[pos // bs], pos % bs] = v
    qkv = torch.randn(t, h + 2 * kvh, d, generator=g).bfloat16()
    return qkv[:, :h], k, v, k_cache, v_cache, blocks  # q [T, H, D]: a view, rows h + 2 kvh heads apart


@pytest.mark.parametrize("n", [1, 5, 16, 17, 33, 100, 257, 300])
@pytest.mark.parametrize(("h", "kvh", "d", "bs"), [(8, 4, 64, 16), (4, 4, 128, 64), (6, 2, 32, 8)])
def test_matches_a_float64_causal_attention(fresh, n: int, h: int, kvh: int, d: int, bs: int) -> None:
    start = 3
    q, k, v, k_cache, v_cache, blocks = _prompt(n, h, kvh, d, bs, start, seed=n + d)
    out = torch.zeros(q.shape[0], h, 2 * d, dtype=torch.bfloat16)[:, :, :d]  # a strided view too
    scale = d**-0.5
    fresh(out, q, k_cache, v_cache, blocks, start, n, scale)
    qs = q[start : start + n].transpose(0, 1)[None].double()  # [1, H, n, D]
    ks, vs = k.transpose(0, 1)[None].double(), v.transpose(0, 1)[None].double()
    want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    want = want[0].transpose(0, 1)  # [n, H, D]
    # bf16 inputs, fp32 sums, P rounded to bf16 for its product (as torch's flash kernel), the output rounded once
    assert torch.allclose(out[start : start + n].double(), want, rtol=2e-2, atol=2e-2), (
        (out[start : start + n].double() - want).abs().max()
    )
    # SDPA's bf16 result on the same inputs is as close to float64: ours may not be much further
    sdpa = F.scaled_dot_product_attention(qs.bfloat16(), ks.bfloat16(), vs.bfloat16(), is_causal=True, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1).double()  # fmt: skip
    ours_err = (out[start : start + n].double() - want).abs().max().item()
    assert ours_err <= 2 * (sdpa - want).abs().max().item() + 1e-3
    # rows of other sequences are not written
    assert not out[:start].any() and not out[start + n :].any()


def test_bad_input_is_refused_with_a_reason(fresh) -> None:
    q, _, _, k_cache, v_cache, blocks = _prompt(40, 8, 4, 64, 16, 0, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="bfloat16"):
        fresh(out.float(), q.float(), k_cache.float(), v_cache.float(), blocks, 0, 40, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        fresh(out[..., :24], q[..., :24], k_cache[..., :24], v_cache[..., :24], blocks, 0, 40, 0.125)
    with pytest.raises(RuntimeError, match="need 3 blocks"):
        fresh(out, q, k_cache, v_cache, blocks[:2], 0, 40, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        fresh(out, q, k_cache, v_cache, torch.tensor([0, 1, 99], dtype=torch.int32), 0, 40, 0.125)
    with pytest.raises(RuntimeError, match="are not rows of q"):
        fresh(out, q, k_cache, v_cache, blocks, 5, 40, 0.125)
    with pytest.raises(RuntimeError, match="cannot share"):
        fresh(out[:, :6], q[:, :6], k_cache, v_cache, blocks, 0, 40, 0.125)


@pytest.mark.parametrize("bs", [16, 32])
def test_a_mixed_step_sends_long_fresh_bf16_prompts_to_it(fresh, bs: int) -> None:
    case = make_case(MIXED, kvh=4, bs=bs, dtype=torch.bfloat16, seed=bs)
    sent = []

    def counting(*args) -> None:
        sent.append(args[6])  # the prompt's length
        fresh(*args)

    attend = FreshPrefillAttention(build.load(), amx=counting)
    out = torch.full_like(case.q, float("nan"))
    attend(*case.args(out))
    # every fresh prompt of FRESH_AMX_MIN_TOKENS or more, some of them shorter than SDPA's threshold
    long_fresh = [s for q, s in MIXED if q == s and s >= FRESH_AMX_MIN_TOKENS]
    assert any(s < FRESH_MIN_TOKENS for s in long_fresh)
    assert attend.calls == len(long_fresh) and sent == long_fresh
    want = dense_reference(case)
    assert not out.isnan().any()  # every token was written, by one path or the other
    assert torch.allclose(out.double(), want, rtol=3e-2, atol=3e-2), (out.double() - want).abs().max()


def test_the_cpu_device_takes_it_for_bf16_caches_where_it_runs(fresh) -> None:
    assert CpuDevice().paged_attention(torch.bfloat16).amx is not None
    assert CpuDevice().paged_attention(torch.float16).amx is None  # fp16 prompts stay on SDPA


def test_head_dims_it_cannot_take_keep_sdpa_and_its_threshold(fresh) -> None:
    # A bf16 cache of head dim 24 (not a multiple of 32): fresh prompts go to SDPA from FRESH_MIN_TOKENS only.
    seqs = [(FRESH_MIN_TOKENS - 1, FRESH_MIN_TOKENS - 1), (FRESH_MIN_TOKENS, FRESH_MIN_TOKENS)]
    case = make_case(seqs, kvh=4, bs=16, dtype=torch.bfloat16, head_dim=24)

    def never(*args) -> None:
        raise AssertionError("the AMX kernel was called for head dim 24")

    attend = FreshPrefillAttention(build.load(), amx=never)
    out = torch.empty_like(case.q)
    attend(*case.args(out))
    assert attend.calls == 1
    assert torch.allclose(out.double(), dense_reference(case), rtol=3e-2, atol=3e-2)
