"""RMSNorm swapped for a fused operator only where it reproduces the module: ``F.rms_norm`` bit for bit, our CPU
kernel to the dtype's rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.fused_norm import fuse_rms_norms
from engine.kernels import build
from engine.model_loader import load_model


def _plain_and_fused(dtype: str, use_kernel: bool) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    plain = load_model("tiny", torch.device("cpu"), dtype).model
    fused = load_model("tiny", torch.device("cpu"), dtype).model
    for m in (plain, fused):  # transformers' own attention: only the norms differ
        m.set_attn_implementation("sdpa")
    norms = sum(1 for m in fused.modules() if type(m).__name__.endswith("RMSNorm"))
    assert fuse_rms_norms(fused, use_kernel=use_kernel) == norms > 0
    return plain, fused, norms


def test_without_the_kernel_every_llama_norm_is_fused_and_the_logits_are_bit_identical() -> None:
    plain, fused, _ = _plain_and_fused("float32", use_kernel=False)
    assert all(
        m.forward.__func__.__name__ == "_fused_forward"
        for m in fused.modules()
        if hasattr(m, "variance_epsilon")
    )
    ids = torch.randint(10, 4000, (1, 23))
    with torch.inference_mode():
        assert torch.equal(plain(input_ids=ids).logits, fused(input_ids=ids).logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_kernel_the_logits_agree_and_greedy_tokens_are_the_same(dtype: str) -> None:
    # Every host we run on has a compiler: the kernel must build here, not skip.
    assert build.load_rms_norm() is not None
    plain, fused, norms = _plain_and_fused(dtype, use_kernel=True)
    on_kernel = [
        m for m in fused.modules() if getattr(m.forward, "__func__", None).__name__ == "_kernel_forward"
    ]
    assert len(on_kernel) == norms
    ids = torch.randint(10, 4000, (3, 41), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(input_ids=ids).logits.float(), fused(input_ids=ids).logits.float()
    tol = 1e-4 if dtype == "float32" else 0.1
    assert torch.allclose(want, got, rtol=tol, atol=tol), (want - got).abs().max()
    assert torch.equal(want.argmax(-1), got.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 512), (8, 512), (3, 5, 96), (300, 1000), (2, 7)])
def test_kernel_matches_the_eager_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    op = build.load_rms_norm()
    assert op is not None
    norm = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    gen = torch.Generator().manual_seed(sum(shape))
    norm.weight.data = torch.randn(shape[-1], generator=gen).to(dtype)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    with torch.inference_mode():
        want, got = norm(x), op(x, norm.weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.bfloat16:  # the rounding of every step is the eager formula's
        assert torch.equal(want, got)
    else:  # the sum of squares adds in another order: at most a few units in the last place
        assert torch.allclose(want, got, rtol=1e-6, atol=1e-6), (want - got).abs().max()
    # a strided input (a transposed view) is read as its values, not its memory
    xt = x.transpose(0, -1).contiguous().transpose(0, -1)
    with torch.inference_mode():
        assert torch.equal(op(xt, norm.weight, 1e-6), got)


def test_kernel_rejects_what_it_does_not_compute() -> None:
    op = build.load_rms_norm()
    assert op is not None
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        op(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)


def test_kernel_traces_as_one_opaque_call() -> None:
    assert build.load_rms_norm() is not None
    w = torch.randn(64)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.bucketserve_cpu.rms_norm(x * 2, w, 1e-6) + 1

    x = torch.randn(4, 64)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), f(x))
    assert torch.allclose(f(x), F.rms_norm(x * 2, (64,), w, 1e-6) + 1, rtol=1e-6, atol=1e-6)


class OnePlusWeightRMSNorm(torch.nn.Module):
    """Gemma's form, (1 + weight) * normed: the probe must catch that it is not the same computation."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return normed * (1.0 + self.weight)


def test_a_norm_that_computes_something_else_keeps_its_own_forward() -> None:
    model = torch.nn.Sequential(OnePlusWeightRMSNorm(64))
    before = model[0].forward
    assert fuse_rms_norms(model) == 0
    assert model[0].forward == before
