"""RMSNorm layers as one fused operator (``torch.nn.functional.rms_norm``) instead of transformers' six eager
ops (cast, square, mean, add, rsqrt, two multiplies).

A decode step runs two norms per layer on a few rows, where each eager op costs more in dispatch than in
arithmetic: measured on a 2-core host, fp32, ``[8, 512]``: 28.8 us for transformers' ``LlamaRMSNorm`` against
13.4 us fused (17 norms per step of the small model: about 0.25 ms of an 11 ms step).

A norm is swapped only when the fused operator gives bit-identical results on a probe input: the model's
outputs do not change, whatever the model family (a norm that computes anything else, like Gemma's
``1 + weight``, fails the probe and keeps its own forward).
"""

from __future__ import annotations

import logging
from types import MethodType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_PROBE_ROWS = 5


def _fused_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # [..., hidden] -> [..., hidden]
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _candidate(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
    )


@torch.inference_mode()
def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Swap the forward of every RMSNorm that the fused operator reproduces bit for bit; returns how many."""
    gen = torch.Generator().manual_seed(0)
    swapped = kept = 0
    for module in model.modules():
        if not _candidate(module):
            continue
        w = module.weight
        probe = torch.randn(_PROBE_ROWS, w.numel(), generator=gen).to(device=w.device, dtype=w.dtype)
        if torch.equal(module(probe), _fused_forward(module, probe)):
            module.forward = MethodType(_fused_forward, module)
            swapped += 1
        else:
            kept += 1
    if kept:
        logger.info(
            "fused %d RMSNorm layers; %d keep their own forward (the fused results differ)", swapped, kept
        )
    elif swapped:
        logger.info("fused %d RMSNorm layers", swapped)
    return swapped
