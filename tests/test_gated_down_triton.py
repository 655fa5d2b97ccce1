"""The skinny GEMM with a gated MLP's activation inside (``engine/kernels/skinny_gemm_triton.py``, ``gated``): the
kernel computes ``(silu(gate) * up) @ w^T`` from a ``[M, 2K]`` gate|up row, and the MLPs that take it
(``fuse_gated_downs``) compute what their own forward does; an MLP with another activation keeps its forward.

They run where ``triton_helpers`` says (a GPU, or Triton's interpreter on the CPU); the CI host has neither, so there
they are skipped with that reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import TRITON_DEVICE, needs_triton

DEVICE = TRITON_DEVICE
pytestmark = needs_triton


# Triton's interpreter multiplies bf16 blocks wrongly (it keeps bf16 as 16-bit integers): there, fp16 only.
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 77), (256, 520)])
def test_gated_kernel_matches_the_activation_then_a_float64_product(dtype, shape) -> None:
    from engine.kernels.skinny_gemm_triton import CONFIGS, MAX_ROWS, skinny_gated_op, skinny_gemm

    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    for m in (1, 3, MAX_ROWS):
        gate_up = torch.randn(m, 2 * k, generator=g).to(DEVICE, dtype)
        gate, up = gate_up.float().chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(dtype)  # rounded once, as the kernel rounds it
        ref = act.double() @ w.double().T  # [m, n]
        tol = 2e-2 * ref.abs().max().item()
        for c in range(len(CONFIGS)):
            y = skinny_gemm(gate_up, w, c, gated=True)
            assert y.shape == (m, n) and y.dtype == dtype
            assert (y.double() - ref).abs().max().item() <= tol, (CONFIGS[c], m)
    # Above MAX_ROWS the operator is the activation and F.linear, as the MLP's own forward computes them.
    gate_up = torch.randn(MAX_ROWS + 5, 2 * k, generator=g).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(skinny_gated_op(gate_up, w, 0), F.linear(F.silu(gate) * up, w))
    with pytest.raises(ValueError, match="rows of 77 for a weight of 77 columns"):
        skinny_gemm(torch.zeros(2, 77, device=DEVICE, dtype=dtype), torch.zeros(4, 77, device=DEVICE, dtype=dtype),
                    0, gated=True)  # fmt: skip


@pytest.fixture(params=DTYPES)
def dtype(request) -> torch.dtype:
    return request.param


def _model(dtype: torch.dtype, hidden_act: str = "silu") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_hidden_layers=2, hidden_act=hidden_act,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(DEVICE, dtype).eval()


def _skinny_downs(model: torch.nn.Module) -> None:
    """What tune_linears does where it timed the kernel faster: every MLP's down projection on config 0."""
    from types import MethodType

    from engine.kernels.skinny_gemm_triton import _forward

    for layer in model.model.layers:
        down = layer.mlp.down_proj
        down.skinny_config = 0
        down.forward = MethodType(_forward, down)


def test_mlps_that_take_the_gated_kernel_compute_what_they_did(dtype) -> None:
    from engine.fused_projections import fuse_projections
    from engine.kernels.skinny_gemm_triton import fuse_gated_downs, is_gated_down

    model = _model(dtype)
    fuse_projections(model)
    _skinny_downs(model)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.inference_mode():
        want = model(ids).logits.float()
        decode_want = model(ids[:, :1]).logits.float()
    assert fuse_gated_downs(model) == 2
    assert all(is_gated_down(layer.mlp) for layer in model.model.layers)
    with torch.inference_mode():
        got = model(ids).logits.float()  # 9 rows: the kernel
        decode_got = model(ids[:, :1]).logits.float()  # 1 row
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2**-4 * scale
    assert (decode_got - decode_want).abs().max().item() <= 2**-4 * scale


def test_an_mlp_with_another_activation_keeps_its_forward(caplog, dtype) -> None:
    from engine.fused_projections import fuse_projections
    from engine.kernels.skinny_gemm_triton import fuse_gated_downs, is_gated_down

    model = _model(dtype, hidden_act="gelu")
    fuse_projections(model)
    _skinny_downs(model)
    with caplog.at_level("INFO", logger="engine.kernels.skinny_gemm_triton"):
        assert fuse_gated_downs(model) == 0
    assert not any(is_gated_down(layer.mlp) for layer in model.model.layers)
    assert "keeps its activation apart from the down projection: its activation is not SiLU" in caplog.text


def test_mlps_whose_down_projection_kept_cublas_are_left_alone(dtype) -> None:
    from engine.fused_projections import fuse_projections
    from engine.kernels.skinny_gemm_triton import fuse_gated_downs

    model = _model(dtype)
    fuse_projections(model)  # no skinny_config on the down projections: tuning kept cuBLAS for them
    assert fuse_gated_downs(model) == 0
