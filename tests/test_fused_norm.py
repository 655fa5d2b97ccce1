"""RMSNorm swapped for the fused operator only where the results stay bit-identical."""

from __future__ import annotations

import torch

from engine.fused_norm import fuse_rms_norms
from engine.model_loader import load_model


def test_every_llama_norm_is_fused_and_the_logits_are_bit_identical() -> None:
    plain = load_model("tiny", torch.device("cpu"), "float32").model
    fused = load_model("tiny", torch.device("cpu"), "float32").model
    for m in (plain, fused):  # transformers' own attention: only the norms differ
        m.set_attn_implementation("sdpa")
    norms = sum(1 for m in fused.modules() if type(m).__name__.endswith("RMSNorm"))
    assert fuse_rms_norms(fused) == norms > 0
    ids = torch.randint(10, 4000, (1, 23))
    with torch.inference_mode():
        assert torch.equal(plain(input_ids=ids).logits, fused(input_ids=ids).logits)


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
