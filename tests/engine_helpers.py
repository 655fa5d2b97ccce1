"""Shared helpers for engine tests: the test device, a small engine config, random prompts, greedy outputs, the
skip marker of the bf16 fusion tests and the CPU's facts as the operating system lists them (the Hugging Face
reference is the ``hf_reference`` fixture in conftest.py)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.config import BucketingConfig, CacheConfig, EngineConfig, SchedulerConfig
from engine.linear_prepack import can_prepack, onednn_has

# The engine tests run on the CPU; BUCKETSERVE_TEST_DEVICE=cuda runs the same tests on a GPU, with the
# Hugging Face reference on that GPU too (fp32 on both sides, so greedy outputs stay comparable).
TEST_DEVICE = os.environ.get("BUCKETSERVE_TEST_DEVICE", "cpu")

# The engine's own choice (can_prepack): bf16 linears are prepacked (and so bf16 MLPs and attention layers fused,
# and the decoder stack walked) for oneDNN where it has a bf16 path, else for the skinny kernel alone where that is
# built for AVX2 or AVX-512; elsewhere (a portable build of the kernels) bf16 models keep their own forwards
# (test_bf16_linears_are_prepacked_for_onednn_or_else_for_the_kernel_alone covers the choice).
needs_bf16_prepack = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.bfloat16),
    reason="neither oneDNN (no bf16 path on this CPU) nor the skinny kernel (not built for AVX2 or AVX-512 here) "
    "takes bf16 linears: they stay F.linear, so nothing is fused in bf16",
)
# Whether bf16 linears have a oneDNN side (above their row limit) on this CPU.
ONEDNN_BF16 = onednn_has(torch.bfloat16)


def small_config(**kw) -> EngineConfig:
    """The tiny model with a small bucket grid: fast warm-up, prompts above 256 tokens exceed it."""
    defaults = dict(
        model="tiny",
        device=TEST_DEVICE,
        skip_warmup=True,
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(
            max_model_len=512, max_num_seqs=8, max_num_prefill_seqs=4, max_num_batched_tokens=256
        ),
        bucketing=BucketingConfig(strategy="exponential"),
    )
    defaults.update(kw)
    return EngineConfig(**defaults)


def random_prompts(lengths: list[int], seed: int = 0, vocab: tuple[int, int] = (10, 4000)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab[0], vocab[1], (n,), generator=g).tolist() for n in lengths]


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output tokens, all run together on ``engine``."""
    from engine.request import Request, SamplingParams

    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...] | None:
    cpuinfo = Path("/proc/cpuinfo")
    return tuple(cpuinfo.read_text().splitlines()) if cpuinfo.exists() else None


def cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in /proc/cpuinfo ("flags", "vendor_id"); the test skips, saying why, where
    there is no such file (the kernels read CPUID themselves: tests check them against the operating system)."""
    lines = _cpuinfo_lines()
    if lines is None:
        pytest.skip(f"no /proc/cpuinfo to read the CPU's {name} from")
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == name), "")


def can_run_bf16_dot() -> bool:
    """Whether this build's kernels can multiply bf16 through VDPBF16PS here: an AVX-512 build on a CPU with
    AVX512_BF16 (whether they do by default is the CPU vendor's matter: cpu_features.h)."""
    return (
        torch.backends.cpu.get_cpu_capability() == "AVX512"
        and "avx512_bf16" in cpuinfo_field("flags").split()
    )


def can_run_amx_bf16() -> bool:
    """Whether this build's skinny linear kernel can multiply bf16 on AMX tiles here: an AVX-512 build on a CPU with
    AMX-TILE and AMX-BF16 (the kernel also asks Linux for the tile state, which kernels since 5.16 grant)."""
    flags = set(cpuinfo_field("flags").split())
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and {"amx_tile", "amx_bf16"} <= flags


@contextlib.contextmanager
def pinned_kernel_path(
    setter: Callable[[int], None], mode: int, runnable: bool, missing: str
) -> Iterator[None]:
    """Runs the body with a kernel's way of multiplying bf16 pinned to ``mode`` (``setter``: the kernel's
    ``set_..._bf16_...`` operator), skipping the test where that way cannot run here (``missing`` says why); the
    CPU's default again after."""
    if not runnable:
        pytest.skip(f"{missing}: no such bf16 path to pin here")
    setter(mode)
    try:
        yield
    finally:
        setter(-1)


def pinned_bf16_dot(setter: Callable[[int], None], dot: bool) -> contextlib.AbstractContextManager[None]:
    """The bf16 dot product (VDPBF16PS) pinned on or off (``set_attention_bf16_dot``, or the linear's path 1 / 0)."""
    missing = "this CPU has no AVX512_BF16 (or this build no AVX-512)"
    return pinned_kernel_path(setter, 1 if dot else 0, not dot or can_run_bf16_dot(), missing)
