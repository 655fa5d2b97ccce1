"""The CUDA paged-attention operator (Triton decode kernel, flash varlen prompts) against the dense float64 reference.

These need an NVIDIA GPU and Triton; elsewhere (the CI host has no GPU) they are skipped with that reason. Run them
on a GPU host with ``BUCKETSERVE_TEST_DEVICE=cuda pytest tests/test_paged_attention_cuda.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_paged_attention_kernel import KINDS, Case, dense_reference, make_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (the CUDA operator and its Triton kernel)"
)


def _on_cuda(c: Case) -> Case:
    return dataclasses.replace(
        c, **{f.name: getattr(c, f.name).cuda() for f in dataclasses.fields(c) if f.name != "scale"}
    )


def _check(c: Case, fn) -> torch.Tensor:
    g = _on_cuda(c)
    out = torch.full_like(g.q, float("nan"))
    fn(*g.args(out))
    ref = dense_reference(c)
    if c.q.dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("kvh", [8, 4, 2])
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_operator_matches_dense(kind: str, kvh: int, bs: int, dtype: torch.dtype) -> None:
    from engine.kernels.paged_attention_cuda import paged_attention_cuda

    _check(make_case(KINDS[kind], kvh, bs, dtype, seed=bs + kvh), paged_attention_cuda)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_reads_only_the_blocks_under_seq_len(dtype: torch.dtype) -> None:
    # Table entries past each sequence's last block name blocks that do not exist: never read, so no fault and
    # the same result (the runner pads its tables with the null block; a graph's table is as wide as the longest).
    from engine.kernels.paged_decode_triton import paged_decode_triton

    c = make_case(KINDS["decode8"], 4, 16, dtype, seed=3)
    wide = torch.full((c.block_table.shape[0], c.block_table.shape[1] + 8), 10**8, dtype=torch.int32)
    for i, seq_len in enumerate(c.seq_lens.tolist()):
        n = -(-seq_len // 16)
        wide[i, :n] = c.block_table[i, :n]
    c = dataclasses.replace(c, block_table=wide)

    def decode(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale):
        paged_decode_triton(out, q, k_cache, v_cache, block_table, seq_lens, scale)

    _check(c, decode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_decode_kernel_split_contexts_match_dense(splits: int, dtype: torch.dtype) -> None:
    # Long and short contexts side by side: parts past a short context's end are empty and weigh nothing in the
    # merge; a long one spreads over every part.
    from engine.kernels.paged_decode_triton import paged_decode_triton

    c = make_case([(1, 1500), (1, 5), (1, 700), (1, 64)], 4, 16, dtype, seed=11)

    def decode(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale):
        paged_decode_triton(out, q, k_cache, v_cache, block_table, seq_lens, scale, splits=splits)

    _check(c, decode)


def test_small_decode_batches_split_their_contexts() -> None:
    from engine.kernels.paged_decode_triton import MAX_SPLITS, decode_splits

    assert decode_splits(1, 8) == MAX_SPLITS
    assert decode_splits(8, 8) == 2
    assert decode_splits(64, 8) == 1
    assert all(decode_splits(b, 8) >= decode_splits(b + 1, 8) for b in range(1, 64))
