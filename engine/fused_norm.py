"""RMSNorm layers as one fused operator instead of transformers' six eager ops (cast, square, mean, add, rsqrt,
two multiplies).

A decode step runs two norms per layer on a few rows, where each eager op costs more in dispatch than in
arithmetic, and a prefill step runs them on thousands of rows, where each op's temporaries cost memory traffic.
On CPU the operator is our one-pass kernel (``engine/kernels/rms_norm_cpu.cpp``); measured on a 2-core Xeon
(AVX-512), per call, against ``torch.nn.functional.rms_norm`` and transformers' ``LlamaRMSNorm``: fp32
``[8, 512]`` 2.8 us against 12.5 and 19.1, ``[2048, 512]`` 174 against 566 and 609; bf16 ``[2048, 512]`` 195
against 824 and 839. Elsewhere (or where the kernel cannot be built) it is ``F.rms_norm``.

A norm is swapped only when the operator reproduces the module's own forward on a probe input: ``F.rms_norm``
bit for bit; our kernel to the dtype's rounding (its sum of squares adds in another order than ATen's, so fp32
results may differ in the last bit; bf16 results matched bit for bit on every probe measured). A norm that
computes anything else, like Gemma's ``1 + weight``, fails the probe and keeps its own forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_PROBE_ROWS = 5


def _fused_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # [..., hidden] -> [..., hidden]
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _kernel_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # [..., hidden] -> [..., hidden]
    return torch.ops.bucketserve_cpu.rms_norm(hidden_states, self.weight, self.variance_epsilon)


# Dtypes the CPU kernel computes, and how far its probe output may lie from the module's (about one unit in the
# last place of the dtype, relative; an absolute floor for outputs near zero).
_KERNEL_TOLERANCE = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (2**-7, 1e-3)}


def _kernel_for(weight: torch.Tensor) -> bool:
    """Whether our CPU kernel can serve a norm with this weight (built once per process, cached)."""
    if weight.device.type != "cpu" or weight.dtype not in _KERNEL_TOLERANCE:
        return False
    from engine.kernels.build import load_rms_norm

    return load_rms_norm() is not None


def _candidate(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
    )


def _matches(module: torch.nn.Module, forward: Callable, probe: torch.Tensor, exact: bool) -> bool:
    want, got = module(probe), forward(module, probe)
    if exact:
        return torch.equal(want, got)
    rtol, atol = _KERNEL_TOLERANCE[probe.dtype]
    return torch.allclose(want.float(), got.float(), rtol=rtol, atol=atol)


@torch.inference_mode()
def fuse_rms_norms(model: torch.nn.Module, use_kernel: bool = True) -> int:
    """Swap the forward of every RMSNorm that a fused operator reproduces (see the module's docstring): our CPU
    kernel where ``use_kernel`` and it serves the norm's weight, else ``F.rms_norm``. Returns how many."""
    gen = torch.Generator().manual_seed(0)
    swapped = kept = on_kernel = 0
    for module in model.modules():
        if not _candidate(module):
            continue
        w = module.weight
        probe = torch.randn(_PROBE_ROWS, w.numel(), generator=gen).to(device=w.device, dtype=w.dtype)
        if use_kernel and _kernel_for(w) and _matches(module, _kernel_forward, probe, exact=False):
            module.forward = MethodType(_kernel_forward, module)
            on_kernel += 1
        elif _matches(module, _fused_forward, probe, exact=True):
            module.forward = MethodType(_fused_forward, module)
        else:
            kept += 1
            continue
        swapped += 1
    if swapped or kept:
        logger.info(
            "fused %d RMSNorm layers (%d on the CPU kernel); %d keep their own forward",
            swapped,
            on_kernel,
            kept,
        )
    return swapped
