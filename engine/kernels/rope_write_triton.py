"""A Triton kernel for a fused Q/K/V projection's output: rotary embedding of queries and keys, and the keys and
values written into the paged cache, in one launch a layer.

The accelerator's counterpart of the CPU's ``bucketserve_cpu::rope_write_kv`` (``rotary_cpu.cpp``), same contract:

    rope_write_kv_triton(qkv[T, (H + 2 KVH) D], cos[T, D], sin[T, D], k_cache[NB, BS, KVH, D],
                         v_cache[NB, BS, KVH, D], slot_mapping[T] int64, num_heads, num_kv_heads) -> q[T, H, D]

Each token's row holds its H query heads, then KVH key heads, then KVH value heads (the fused projection's column
order). Queries and keys are rotated as transformers' Llama-family models rotate them,
``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``, each product rounded
to the dtype before the sum as the eager ops round them. The rotated keys and the values go to the token's cache
slot (padding tokens carry the null block's slots and land there); the rotated queries are returned head-major
per token, as the paged attention reads them.

Why: in a compiled batch-1 decode step of a Llama-3-8B shape, a layer's rotary of Q, rotary of K, the copy of V
to token-major rows and the K/V cache write are four small kernels (the first three took 55 us of an 8-layer step on
an H200, mostly launch and tail: a token's Q/K/V row is 12 KiB); this is one.

Imported only where Triton is installed (the CUDA device); the tests also run it under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(a, cos, b, sin, DTYPE: tl.constexpr):
    # a * cos + b * sin, each product rounded to DTYPE first (identity for fp32), the sum in fp32
    p = (a * cos).to(DTYPE).to(tl.float32)
    r = (b * sin).to(DTYPE).to(tl.float32)
    return p + r


@triton.jit
def _rope_write_kv(
    qkv_ptr,  # [T, (H + 2 KVH) * D], rows stride_t apart, columns dense
    cos_ptr,  # [T, D], rows stride_c apart
    sin_ptr,  # [T, D], rows stride_s apart
    q_ptr,  # [T, H, D] contiguous: the rotated queries
    k_cache_ptr,  # [slots, KVH * D] contiguous
    v_cache_ptr,  # [slots, KVH * D] contiguous
    slots_ptr,  # [T] int64
    stride_t,
    stride_c,
    stride_s,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,  # H rounded up to a power of two
    KVHP: tl.constexpr,  # KVH rounded up to a power of two
    HALFP: tl.constexpr,  # D / 2 rounded up to a power of two
    DP: tl.constexpr,  # D rounded up to a power of two
):
    HALF: tl.constexpr = D // 2
    t = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_t
    j = tl.arange(0, HALFP)
    j_ok = j < HALF
    c1 = tl.load(cos_ptr + t * stride_c + j, mask=j_ok, other=0.0).to(tl.float32)  # [HALFP]
    c2 = tl.load(cos_ptr + t * stride_c + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_s + j, mask=j_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_s + HALF + j, mask=j_ok, other=0.0).to(tl.float32)

    # Queries: [HP, HALFP] per half
    h = tl.arange(0, HP)
    mq = (h < H)[:, None] & j_ok[None, :]
    at = h[:, None] * D + j[None, :]
    x1 = tl.load(row + at, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(row + at + HALF, mask=mq, other=0.0).to(tl.float32)
    out = q_ptr + t * (H * D) + at
    tl.store(out, _rotate(x1, c1[None, :], -x2, s1[None, :], dtype).to(dtype), mask=mq)
    tl.store(out + HALF, _rotate(x2, c2[None, :], x1, s2[None, :], dtype).to(dtype), mask=mq)

    # Keys, rotated, and values, as they are, to the token's slot: [KVHP, HALFP] per half, [KVHP, DP]
    slot = tl.load(slots_ptr + t).to(tl.int64)
    g = tl.arange(0, KVHP)
    mk = (g < KVH)[:, None] & j_ok[None, :]
    at = g[:, None] * D + j[None, :]
    k1 = tl.load(row + H * D + at, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(row + H * D + at + HALF, mask=mk, other=0.0).to(tl.float32)
    dst = k_cache_ptr + slot * (KVH * D) + at
    tl.store(dst, _rotate(k1, c1[None, :], -k2, s1[None, :], dtype).to(dtype), mask=mk)
    tl.store(dst + HALF, _rotate(k2, c2[None, :], k1, s2[None, :], dtype).to(dtype), mask=mk)
    d = tl.arange(0, DP)
    mv = (g < KVH)[:, None] & (d < D)[None, :]
    at = g[:, None] * D + d[None, :]
    v = tl.load(row + (H + KVH) * D + at, mask=mv)
    tl.store(v_cache_ptr + slot * (KVH * D) + at, v, mask=mv)


def rope_write_kv_triton(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotate and write (see the module docstring); returns the rotated queries [T, H, D]."""
    t, width = qkv.shape
    heads = num_heads + 2 * num_kv_heads
    if width % heads or (width // heads) % 2:
        raise ValueError(f"qkv rows of {width} do not split into {heads} heads of an even size")
    d = width // heads
    if qkv.stride(1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qkv, cos and sin need dense rows")
    if cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"cos and sin must be [{t}, {d}], not {tuple(cos.shape)} and {tuple(sin.shape)}")
    if k_cache.shape[-2:] != (num_kv_heads, d) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"the caches must be contiguous [NB, BS, {num_kv_heads}, {d}]")
    q = qkv.new_empty(t, num_heads, d)  # [T, H, D]
    if t == 0:
        return q
    _rope_write_kv[(t,)](
        qkv, cos, sin, q,
        k_cache.view(-1, num_kv_heads * d), v_cache.view(-1, num_kv_heads * d),
        slot_mapping, qkv.stride(0), cos.stride(0), sin.stride(0),
        H=num_heads, KVH=num_kv_heads, D=d,
        HP=triton.next_power_of_2(num_heads), KVHP=triton.next_power_of_2(num_kv_heads),
        HALFP=triton.next_power_of_2(d // 2), DP=triton.next_power_of_2(d),
    )  # fmt: skip
    return q
