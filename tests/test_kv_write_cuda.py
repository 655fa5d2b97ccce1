"""The Triton K/V writer (CUDA): one kernel a layer writes what ``write_slots``' two ``index_copy_`` write, for
prompt and decode token counts, both cache dtypes and inputs that are views; and the CUDA device hands it to the
flat runner. These need an NVIDIA GPU and Triton; elsewhere (the CI host has no GPU) they are skipped with that
reason."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (the Triton K/V writer)"
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_triton_writer_writes_what_index_copy_writes(dtype, tokens: int) -> None:
    from engine.attention import write_slots
    from engine.kernels.kv_write_triton import write_slots_triton

    layers, blocks, bs, kvh, d = 3, 40, 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(tokens)
    base = torch.randn(layers, 2, blocks + 1, bs, kvh, d, device="cuda", generator=g).to(dtype)
    slots = torch.randperm(blocks * bs, device="cuda", generator=g)[:tokens]  # distinct slots, any order
    # Views, as a model hands them over: [T, KVH, D] out of a [KVH, T, D] tensor.
    key = torch.randn(kvh, tokens, d, device="cuda", generator=g).to(dtype).transpose(0, 1)
    value = torch.randn(kvh, tokens, d, device="cuda", generator=g).to(dtype).transpose(0, 1)
    want, got = base.clone(), base.clone()
    write_slots(want, 1, slots, key.contiguous(), value.contiguous())
    write_slots_triton(got, 1, slots, key, value)
    assert torch.equal(got, want)  # every layer: layers 0 and 2 untouched by both


def test_cuda_runner_writes_with_the_kernel_and_splits_the_greedy_argmax() -> None:
    from engine.device import get_device
    from engine.kernels.kv_write_triton import write_slots_triton

    device = get_device("cuda")
    assert device.kv_writer() is write_slots_triton
    assert device.greedy_splits(128256) == 64
