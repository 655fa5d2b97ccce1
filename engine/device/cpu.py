"""CPU backend: eager execution; the KV cache lives in host RAM."""

from __future__ import annotations

import logging
import os

import torch

from engine.device.base import Device

logger = logging.getLogger(__name__)


class CpuDevice(Device):
    name = "cpu"
    dist_backend = "gloo"
    supports_graphs = False

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def prepare_process(self) -> None:
        from engine.heap import keep_heap

        keep_heap()

    def mem_get_info(self) -> tuple[int, int]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            free = info.get("MemAvailable", total)
        except OSError:
            free = total
        return free, total

    def paged_attention(self, dtype: torch.dtype | None = None):
        # Our C++ kernel (built once per source and torch version, cached); the pure-torch one if it cannot build.
        from engine.kernels import cpu_paged_attention

        kernel = cpu_paged_attention()
        if dtype in (torch.bfloat16, torch.float16) and torch.cpu._is_amx_tile_supported():
            # 16-bit prompts on the matrix unit: see engine/kernels/fresh_prefill.py for the measured crossover.
            from engine.kernels.build import load_fresh_attention
            from engine.kernels.fresh_prefill import (
                FRESH_AMX_MIN_TOKENS,
                FRESH_MIN_TOKENS,
                FreshPrefillAttention,
            )

            amx = None
            if dtype == torch.bfloat16 and load_fresh_attention() is not None:
                ops = torch.ops.bucketserve_cpu
                amx = ops.fresh_attention_amx if ops.fresh_attention_amx_usable() else None
            if amx is not None:
                logger.info(
                    "AMX with a %s cache: fresh prompts of >= %d tokens attend through our AMX kernel (where the "
                    "head dim is a multiple of 32; else those of >= %d through SDPA)",
                    dtype,
                    FRESH_AMX_MIN_TOKENS,
                    FRESH_MIN_TOKENS,
                )
            else:
                logger.info(
                    "AMX with a %s cache: fresh prompts of >= %d tokens attend through SDPA",
                    dtype,
                    FRESH_MIN_TOKENS,
                )
            return FreshPrefillAttention(kernel, amx=amx)
        return kernel
