"""The paged attention kernel (C++) and its pure-torch fallback against a dense float64 reference."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_helpers import can_run_bf16_dot, cpuinfo_field, pinned_bf16_dot

from engine import kernels
from engine.kernels import build
from engine.kernels.paged_attention_blocks import fused_sdpa_adapter, make_paged_attention_blocks
from engine.kernels.paged_attention_gather import paged_attention_gather
from engine.kernels.paged_attention_ref import paged_attention_ref

H, D = 8, 64


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [NB, BS, KVH, D]
    v_cache: torch.Tensor  # [NB, BS, KVH, D]
    block_table: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    scale: float

    def args(self, out: torch.Tensor) -> tuple:
        return (
            out,
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_case(
    seqs: list[tuple[int, int]],
    kvh: int,
    bs: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare: int = 5,
    head_dim: int = D,
) -> Case:
    """seqs: (q_len, seq_len) per sequence. Blocks get shuffled ids, with ``spare`` unreferenced ones."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // bs) for _, s in seqs]
    nb = sum(need) + spare
    ids = list(range(nb))
    random.Random(seed).shuffle(ids)
    width = max(need) + 1
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[at : at + n], dtype=torch.int32)
        at += n
    t = sum(q for q, _ in seqs)
    starts = [0]
    for q, _ in seqs:
        starts.append(starts[-1] + q)
    return Case(
        q=torch.randn(t, H, head_dim, generator=g).to(dtype),
        k_cache=torch.randn(nb, bs, kvh, head_dim, generator=g).to(dtype),
        v_cache=torch.randn(nb, bs, kvh, head_dim, generator=g).to(dtype),
        block_table=table,
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=1.0 / math.sqrt(head_dim),
    )


def dense_reference(c: Case) -> torch.Tensor:
    """Each sequence's K/V materialised slot by slot, explicit causal-with-offset mask, float64."""
    bs, kvh = c.k_cache.shape[1], c.k_cache.shape[2]
    out = torch.zeros(c.q.shape, dtype=torch.float64)
    for i, seq_len in enumerate(c.seq_lens.tolist()):
        q0, q1 = c.query_start_loc[i].item(), c.query_start_loc[i + 1].item()
        pos = torch.arange(seq_len)
        blocks = c.block_table[i].long()[pos // bs]
        k = c.k_cache[blocks, pos % bs].double()  # [S, KVH, D]
        v = c.v_cache[blocks, pos % bs].double()
        k = k.repeat_interleave(H // kvh, dim=1)  # [S, H, D]: head h uses KV head h // G
        v = v.repeat_interleave(H // kvh, dim=1)
        q = c.q[q0:q1].double()  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * c.scale
        qpos = torch.arange(seq_len - (q1 - q0), seq_len)
        scores = scores.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)
    return out


@pytest.fixture(scope="module")
def kernel():
    op = build.load()
    if op is None:
        pytest.skip("the C++ kernel cannot be built here (the fallback tests still run)")
    return op


def fused_sdpa_stand_in(
    q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute, valid_len, side
):
    """Gaudi's ``FusedSDPA.apply`` argument for argument, computed by torch: what the HPU operator's adapter must
    call it with (no dropout, no causal flag, exact softmax, as many K/V heads as query heads)."""
    assert (dropout_p, is_causal, softmax_mode, recompute, valid_len) == (0.0, False, "None", False, None)
    assert k.shape[1] == v.shape[1] == q.shape[1], "FusedSDPA is given repeated K/V heads"
    assert attn_mask.dim() == 4 and attn_mask.dtype == q.dtype
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


# fallback: the pure-torch CPU operator; gather: the accelerators' operator (graph-safe on decode steps); blocks:
# the HPU's operator (flat block layout), with torch's SDPA and with the adapter it gives Gaudi's fused SDPA. All
# run here on the CPU, where their arithmetic is the same.
IMPLS = ["kernel", "fallback", "gather", "blocks", "blocks_fused"]


def _impl(name: str, request: pytest.FixtureRequest):
    if name == "kernel":
        return request.getfixturevalue("kernel")
    if name == "blocks":
        return make_paged_attention_blocks()
    if name == "blocks_fused":
        return make_paged_attention_blocks(fused_sdpa_adapter(fused_sdpa_stand_in))
    return paged_attention_gather if name == "gather" else paged_attention_ref


def _run(fn, c: Case) -> torch.Tensor:
    out = torch.full_like(c.q, float("nan"))
    fn(*c.args(out))
    return out


def _check(fn, c: Case) -> None:
    out = _run(fn, c)
    ref = dense_reference(c)
    if c.q.dtype == torch.float32 and c.k_cache.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def _decode(batch: int, seed: int) -> list[tuple[int, int]]:
    rnd = random.Random(seed)
    lens = [1, 16, 17, 128, 129, 600] + [rnd.randint(1, 600) for _ in range(batch)]
    return [(1, s) for s in lens[:batch]]


KINDS = {
    "decode1": [(1, 37)],
    "decode8": _decode(8, 1),
    "decode32": _decode(32, 2),
    "prefill": [(1, 1), (17, 17), (128, 128), (300, 300)],
    "chunked": [(50, 250), (128, 129), (200, 600), (16, 32)],
    "mixed": [(1, 600), (1, 5), (300, 300), (0, 40), (64, 400), (1, 129), (33, 33)],
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("kvh", [8, 4, 2])  # GQA ratios 1, 2, 4
@pytest.mark.parametrize("kind", list(KINDS))
def test_fp32_matches_dense(kind: str, kvh: int, bs: int, impl: str, request: pytest.FixtureRequest) -> None:
    _check(_impl(impl, request), make_case(KINDS[kind], kvh, bs, torch.float32, seed=bs + kvh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 80, 128])
@pytest.mark.parametrize("kvh", [8, 4, 2])
def test_kernel_decodes_other_head_dims(kernel, head_dim: int, kvh: int, dtype: torch.dtype) -> None:
    # Decodes take a fixed-shape path for head dims of whole vectors (32 and 128 on AVX-512, with 1, 2 and 4
    # query heads per KV head), and the general one otherwise (80): both against the dense reference.
    for kind in ("decode8", "mixed"):
        _check(kernel, make_case(KINDS[kind], kvh, 16, dtype, seed=head_dim, head_dim=head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 72, 288])
def test_kernel_prefill_tiles_other_head_dims(kernel, head_dim: int, dtype: torch.dtype) -> None:
    # Prefill tiles pack K rows at a stride of 64, 128 or 256 compiled into their GEMM (head dims 24 and 72: a
    # partial last vector), and at the head dim itself above that (288): all against the dense reference.
    for kind in ("prefill", "chunked"):
        _check(kernel, make_case(KINDS[kind], 4, 16, dtype, seed=head_dim, head_dim=head_dim))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["decode8", "chunked", "mixed"])
def test_bf16_matches_dense(kind: str, impl: str, request: pytest.FixtureRequest) -> None:
    _check(_impl(impl, request), make_case(KINDS[kind], 4, 16, torch.bfloat16, seed=3))


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("head_dim", [24, 64, 72])
def test_kernel_bf16_prefill_tiles_with_each_product(kernel, head_dim: int, dot: bool) -> None:
    # bf16 prefill tiles form S^T = K Q^T through VDPBF16PS (pairs of products per lane) or on widened values,
    # chosen per CPU (engine/kernels/cpu_features.h): each path, pinned, against the dense reference.
    ops = torch.ops.bucketserve_cpu
    with pinned_bf16_dot(ops.set_attention_bf16_dot, dot):
        assert ops.attention_uses_bf16_dot() is dot
        for kind in ("prefill", "chunked", "mixed"):
            _check(kernel, make_case(KINDS[kind], 4, 16, torch.bfloat16, seed=head_dim, head_dim=head_dim))


def test_kernel_bf16_tiles_take_the_dot_product_by_default_on_amd_cpus_with_avx512_bf16(kernel) -> None:
    # The kernel reads CPUID itself; the operating system's facts must agree with its choice.
    want = can_run_bf16_dot() and cpuinfo_field("vendor_id") == "AuthenticAMD"
    assert torch.ops.bucketserve_cpu.attention_uses_bf16_dot() is want
    with pytest.raises(RuntimeError, match="mode -1"):
        torch.ops.bucketserve_cpu.set_attention_bf16_dot(3)


def test_kernel_bf16_cache_fp32_query(kernel) -> None:
    c = make_case(KINDS["mixed"], 2, 128, torch.bfloat16, seed=4)
    c.q = c.q.float()
    _check(kernel, c)


@pytest.mark.parametrize("impl", IMPLS)
def test_reads_blocks_in_place(impl: str, request: pytest.FixtureRequest) -> None:
    """Unreferenced blocks and slots past each sequence's end are NaN: outputs stay finite and equal."""
    fn = _impl(impl, request)
    c = make_case(KINDS["mixed"], 4, 16, torch.float32, seed=5, spare=9)
    before = _run(fn, c)
    bs = c.k_cache.shape[1]
    used = torch.zeros(c.k_cache.shape[:2], dtype=torch.bool)  # [NB, BS]
    for i, seq_len in enumerate(c.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        used[c.block_table[i].long()[pos // bs], pos % bs] = True
    for cache in (c.k_cache, c.v_cache):
        cache[~used] = float("nan")
    after = _run(fn, c)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_strided_views_of_the_engine_cache(kernel) -> None:
    """The engine passes KVCache.data[layer, 0/1] and a query reshaped from [B, H, Q, D]: views, not copies."""
    c = make_case(KINDS["mixed"], 4, 16, torch.float32, seed=6)
    data = torch.stack([torch.stack([c.k_cache, c.v_cache])] * 2)  # [L=2, 2, NB, BS, KVH, D]
    q_strided = c.q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] with head-major storage
    out = torch.empty(c.q.shape[1], c.q.shape[0], D).transpose(0, 1)  # [T, H, D] non-contiguous
    kernel(out, q_strided, data[1, 0], data[1, 1], c.block_table, c.seq_lens, c.query_start_loc, c.scale)
    torch.testing.assert_close(out.double(), dense_reference(c), atol=2e-5, rtol=1e-5)


def test_kernel_same_result_on_one_thread(kernel) -> None:
    """Work items are split between threads, never the arithmetic of one: any thread count, same bits."""
    c = make_case(KINDS["mixed"], 2, 16, torch.float32, seed=8)
    many = _run(kernel, c)
    torch.testing.assert_close(_run_on_one_thread(kernel, c), many, atol=0, rtol=0)


def _run_on_one_thread(kernel, c: Case) -> torch.Tensor:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(kernel, c)
    finally:
        torch.set_num_threads(threads)


# Decodes of 1024 slots or more have their keys split in parts of at least 512 (whole 128-slot chunks), each part
# an item of its own, merged afterwards: lengths at, just past and between the part boundaries, and one short
# decode and a prefill beside them.
LONG_DECODES = [(1, 2000), (1, 1024), (1, 1025), (1, 1537), (1, 3000), (1, 600), (37, 300)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kvh", [8, 4, 1])  # 1, 2 and 8 query heads per KV head (8: the tiled path)
@pytest.mark.parametrize("bs", [16, 64])
def test_kernel_long_decodes_in_parts_match_dense(kernel, bs: int, kvh: int, dtype: torch.dtype) -> None:
    _check(kernel, make_case(LONG_DECODES, kvh, bs, dtype, seed=bs + kvh))


def test_kernel_decode_gets_the_same_bits_alone_in_a_batch_and_on_one_thread(kernel) -> None:
    """A sequence's parts depend on its own length only: the same bits whatever else the call holds (here, alone
    or among seven others) and whatever the thread count."""
    c = make_case([(1, 2000)] + [(1, 700 + 300 * i) for i in range(7)], 4, 64, torch.float32, seed=12)
    batch = _run(kernel, c)
    alone = torch.full_like(c.q[:1], float("nan"))
    kernel(
        alone,
        c.q[:1],
        c.k_cache,
        c.v_cache,
        c.block_table[:1],
        c.seq_lens[:1],
        c.query_start_loc[:2],
        c.scale,
    )
    torch.testing.assert_close(alone, batch[:1], atol=0, rtol=0)
    torch.testing.assert_close(_run_on_one_thread(kernel, c), batch, atol=0, rtol=0)


def test_kernel_rejects_bad_metadata(kernel) -> None:
    c = make_case([(1, 40)], 4, 16, torch.float32)
    c.block_table[0, 1] = c.k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(*c.args(torch.empty_like(c.q)))
    c = make_case([(5, 3)], 4, 16, torch.float32)
    with pytest.raises(RuntimeError, match="q_len"):
        kernel(*c.args(torch.empty_like(c.q)))


def test_kernel_is_a_registered_opaque_op(kernel) -> None:
    c = make_case(KINDS["chunked"], 4, 16, torch.float32, seed=7)
    torch.library.opcheck(torch.ops.bucketserve_cpu.paged_attention.default, c.args(torch.empty_like(c.q)))


def test_broken_source_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this source does not compile\n")
    with pytest.warns(RuntimeWarning, match="build failed"):
        assert build.load(broken) is None


def test_built_kernel_loads_without_compiler(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_compiler", lambda: None)
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load() is not None


def test_no_compiler_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_compiler", lambda: None)
    monkeypatch.setattr(build, "_loaded", {})
    source = tmp_path / "kernel.cpp"
    source.write_text(build.SOURCE.read_text() + "// not built yet\n")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert build.load(source) is None
    monkeypatch.setattr(build, "load", lambda: None)
    assert kernels.cpu_paged_attention() is paged_attention_ref


def test_bench_writes_json_and_markdown(tmp_path: Path) -> None:
    from bench import paged_attention as bench

    argv = [
        "--out",
        str(tmp_path / "pa"),
        "--cases",
        "decode-b8-ctx512",
        "prefill-8x256",
        "--block-sizes",
        "16",
    ]
    argv += ["--threads", "1", "--min-seconds", "0", "--max-reps", "1", "--copy-mib", "16"]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "pa.json").read_text())
    impls = {(r["case"], r["impl"]) for r in result["rows"]}
    expected = {"fallback", "engine"} | ({"kernel"} if result["kernel_built"] else set())
    assert impls == {(c, i) for c in ("decode-b8-ctx512", "prefill-8x256") for i in expected}
    assert all(r["ms"] > 0 and r["x_floor"] > 0 and r["gflops"] > 0 for r in result["rows"])
    assert "| decode-b8-ctx512 | 16 | 1 |" in (tmp_path / "pa.md").read_text()


def test_blocks_keep_an_empty_padding_row_out_of_the_others() -> None:
    """The block layout sums blocks back into sequences by matmul: a padding row with no cached token (every slot
    masked) must not put a NaN (0 * NaN) into the real rows."""
    c = make_case(KINDS["decode8"], 4, 16, torch.float32, seed=6)
    ref = dense_reference(c)
    c.q = torch.cat([c.q, torch.randn(1, H, D)])
    c.block_table = torch.cat([c.block_table, torch.zeros(1, c.block_table.shape[1], dtype=torch.int32)])
    c.seq_lens = torch.cat([c.seq_lens, torch.zeros(1, dtype=torch.int32)])
    c.query_start_loc = torch.cat([c.query_start_loc, c.query_start_loc[-1:] + 1])
    out = _run(make_paged_attention_blocks(), c)
    torch.testing.assert_close(out[:-1].double(), ref, atol=2e-5, rtol=1e-5)
