"""Gated MLPs fused for few rows (gate and up in one skinny-kernel pass, SiLU and the product in its epilogue):
the same as the unfused prepacked model to fp32 rounding (the GEMM sums are the same; ATen's SiLU takes a
scalar exp on a tensor's last few elements, the epilogue a vector one), in bf16 to bf16 rounding, eager and
compiled, and only where the probe agrees."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import ONEDNN_BF16, needs_bf16_prepack

from engine import linear_prepack
from engine.fused_mlp import fuse_gated_mlps
from engine.kernels import build
from engine.linear_prepack import panel_layout, prepack_linears, skinny_max_rows
from engine.model_loader import load_model


@pytest.fixture(autouse=True)
def _panels_on_any_host(monkeypatch):
    # The product gives linears panels on AVX-512 and AVX2 hosts only, where the kernel was measured to beat
    # oneDNN; its portable C++ (slow, exact) runs these tests on any other host too.
    monkeypatch.setattr(
        linear_prepack, "_wants_panels", lambda dtype: dtype in (torch.float32, torch.bfloat16)
    )


@pytest.fixture(scope="module")
def silu_mul():
    assert build.load_skinny_linear() is not None, "the skinny linear kernel did not build"
    return torch.ops.bucketserve_cpu.skinny_silu_mul


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack((panel_layout(gate), panel_layout(up)), dim=1).flatten(0, 1).contiguous()


@pytest.mark.parametrize("m", [1, 5, 12, 13, 40, 600])  # 600: chunks of rows
@pytest.mark.parametrize(("n", "k"), [(96, 64), (100, 37), (1408, 512)])
def test_kernel_matches_silu_of_gate_times_up_in_float64(silu_mul, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x, gate, up = (
        torch.randn(m, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, k, generator=gen),
    )
    g, u = x.double() @ gate.double().T, x.double() @ up.double().T
    want = (torch.nn.functional.silu(g) * u).float()
    # fp32 sums of k products against float64: tolerance on the scale of the outputs (cancellation near 0)
    atol = 1e-5 * want.abs().max().item()
    torch.testing.assert_close(silu_mul(x, _interleaved(gate, up), n), want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("m", [4, 8, 40, 600])  # 600: over two chunks of rows and a tail
def test_kernel_gives_a_row_the_same_bits_in_any_batch(silu_mul, m: int) -> None:
    # Each row's gate and up sums run in k order whatever rows share the pass, and the same SiLU follows.
    gen = torch.Generator().manual_seed(m)
    x, gate, up = (
        torch.randn(m, 300, generator=gen),
        torch.randn(100, 300, generator=gen),
        torch.randn(100, 300, generator=gen),
    )
    panels = _interleaved(gate, up)
    alone = torch.cat([silu_mul(x[i : i + 1], panels, 100) for i in range(m)])
    assert torch.equal(silu_mul(x, panels, 100), alone)


def test_kernel_refuses_panels_that_cannot_hold_the_size(silu_mul) -> None:
    panels = _interleaved(torch.randn(40, 24), torch.randn(40, 24))
    with pytest.raises(RuntimeError, match="cannot hold gate and up of n = 49"):
        silu_mul(torch.randn(2, 24), panels, 49)


def _plain_and_fused(dtype: str) -> tuple[torch.nn.Module, torch.nn.Module, list[torch.nn.Module]]:
    """The tiny model twice, prepacked, on transformers' own attention; the second with its MLPs fused (all of
    them, asserted), and those MLPs."""
    plain = load_model("tiny", torch.device("cpu"), dtype).model
    fused = load_model("tiny", torch.device("cpu"), dtype).model
    for m in (plain, fused):
        m.set_attn_implementation("sdpa")
        prepack_linears(m)
    mlps = [m for m in fused.modules() if type(m).__name__.endswith("MLP")]
    assert fuse_gated_mlps(fused) == len(mlps) > 0
    return plain, fused, mlps


@pytest.mark.parametrize(
    "length_at", [lambda n: 1, lambda n: 9, lambda n: n, lambda n: n + 7], ids=["1", "9", "limit", "limit+7"]
)
def test_the_fused_model_equals_the_unfused_one_to_fp32_rounding(silu_mul, length_at) -> None:
    length = length_at(skinny_max_rows(torch.float32))
    plain, fused, mlps = _plain_and_fused("float32")
    assert all(m.gate_proj.panel_weight is None and m.up_proj.panel_weight is None for m in mlps)
    ids = torch.randint(10, 4000, (1, length))
    with torch.inference_mode():
        want, got = plain(input_ids=ids).logits, fused(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_bf16_prepack
@pytest.mark.parametrize(
    "length_at",
    # oneDNN's side where it has bf16; without it the kernel takes every row count: many rows then
    [lambda n: min(9, n), lambda n: n + 7 if ONEDNN_BF16 else 150],
    ids=["skinny", "onednn-or-many-rows"],
)
def test_in_bf16_the_fused_model_agrees_to_bf16_rounding(silu_mul, length_at) -> None:
    length = length_at(skinny_max_rows(torch.bfloat16))
    # transformers rounds gate and up to bf16 before the SiLU and the product; the fused pass rounds once
    plain, fused, _ = _plain_and_fused("bfloat16")
    ids = torch.randint(10, 4000, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.inference_mode():
        want, got = plain(input_ids=ids).logits.float(), fused(input_ids=ids).logits.float()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.05 * scale
    # the winning token agrees wherever HF's own margin is wider than that noise
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05 * scale
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


class GeluMLP(torch.nn.Module):
    """Same attribute names, another activation: the probe must refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(32, 48, bias=False)
        self.up_proj = torch.nn.Linear(32, 48, bias=False)
        self.down_proj = torch.nn.Linear(48, 32, bias=False)
        self.act_fn = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SiluMLP(GeluMLP):
    def __init__(self) -> None:
        super().__init__()
        self.act_fn = torch.nn.SiLU()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_prepack)])
def test_an_mlp_with_another_activation_keeps_its_own_forward(silu_mul, dtype: torch.dtype) -> None:
    mlp = GeluMLP().to(dtype)
    prepack_linears(mlp)
    assert fuse_gated_mlps(mlp) == 0
    assert mlp.gate_proj.panel_weight is not None  # nothing was taken from it


def test_the_fused_mlp_runs_inside_a_compiled_graph(silu_mul) -> None:
    mlp = SiluMLP()
    with torch.inference_mode():
        x = torch.randn(skinny_max_rows(torch.float32) + 3, 32)
        want = mlp(x)
        prepack_linears(mlp)
        assert fuse_gated_mlps(mlp) == 1
        compiled = torch.compile(mlp, dynamic=True)
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)  # oneDNN rows
        torch.testing.assert_close(compiled(x[:5]), want[:5], rtol=1e-5, atol=1e-5)  # skinny rows
