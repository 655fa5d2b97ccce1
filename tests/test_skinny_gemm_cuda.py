"""The Triton skinny GEMM (CUDA): every config against a float64 product, at the row counts it serves and past
them (where the operator falls back to ``F.linear``), and the start-up choice that swaps it into a model's
linears only where it was timed faster. These need an NVIDIA GPU and Triton; elsewhere (the CI host has no GPU)
they are skipped with that reason."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (the Triton skinny GEMM)"
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1000, 4096), (4096, 1408), (77, 96)])
def test_every_config_matches_a_float64_product(dtype, shape) -> None:
    from engine.kernels.skinny_gemm_triton import CONFIGS, MAX_ROWS, skinny_gemm, skinny_linear_op

    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    for m in (1, 3, MAX_ROWS):
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        ref = x.double() @ w.double().T  # [m, n]
        tol = 2e-2 * ref.abs().max().item()
        for c in range(len(CONFIGS)):
            y = skinny_gemm(x, w, c)
            assert y.shape == (m, n) and y.dtype == dtype
            assert (y.double() - ref).abs().max().item() <= tol, (CONFIGS[c], m)
    # Above MAX_ROWS the operator is F.linear's product.
    x = torch.randn(MAX_ROWS + 5, k, device="cuda", generator=g).to(dtype)
    assert torch.equal(skinny_linear_op(x, w, 0), torch.nn.functional.linear(x, w))


def test_tuning_swaps_only_layers_it_timed_faster() -> None:
    from engine.kernels.skinny_gemm_triton import CONFIGS, tune_linears

    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 4096, bias=False),
        torch.nn.Linear(4096, 4096, bias=True),  # a bias: never swapped
        torch.nn.Linear(4096, 1024, bias=False),
    ).to("cuda", torch.bfloat16)
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    before = model[0](x)
    picked = tune_linears(model)
    assert set(picked) == {(4096, 4096), (1024, 4096)}
    assert not hasattr(model[1], "skinny_config")
    for layer in (model[0], model[2]):
        config, timings = picked[(layer.out_features, layer.in_features)]
        assert hasattr(layer, "skinny_config") == (config is not None)
        if config is not None:  # taken only where faster than cuBLAS at both row counts it was timed at
            assert all(t < timings["cublas"][m] for m, t in timings[CONFIGS[config]].items())
    after = model[0](x)
    assert (after.float() - before.float()).abs().max().item() <= 2e-2 * before.float().abs().max().item()
