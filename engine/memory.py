"""KV cache sizing from the device's memory, as in DESIGN.md: what is left after the weights and a
profiling pass of the largest prompt bucket, times the utilisation fraction, minus the graph reserve."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.config import CacheConfig
from engine.device import Device
from engine.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    num_blocks: int
    kv_bytes: int
    graph_reserve_bytes: int
    source: str  # "config" | "profiled" | "cpu-cap"


def plan_kv_memory(
    cache: CacheConfig,
    device: Device,
    spec: KVCacheSpec,
    activation_peak_bytes: int,
    min_blocks: int,
) -> MemoryPlan:
    """Decide the number of KV blocks. ``min_blocks``: the fewest that can hold one max-length sequence."""
    if cache.num_blocks is not None:
        return MemoryPlan(cache.num_blocks, cache.num_blocks * spec.bytes_per_block, 0, "config")
    free, total = device.mem_get_info()
    if device.name == "cpu":
        # Host RAM is shared with everything else on the machine: a fixed cap, bounded by what is free.
        budget = min(
            cache.cpu_kv_cache_bytes, int(free * cache.gpu_memory_utilization) - activation_peak_bytes
        )
        reserve, source = 0, "cpu-cap"
    else:
        used = total - free  # weights and everything else already resident
        usable = int(total * cache.gpu_memory_utilization) - used - activation_peak_bytes
        reserve = int(max(usable, 0) * cache.graph_reserve_fraction)
        budget, source = usable - reserve, "profiled"
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < min_blocks:
        raise RuntimeError(
            f"not enough memory for the KV cache: {max(budget, 0) / 2**20:.0f} MiB gives {num_blocks} blocks, "
            f"fewer than the {min_blocks} one max_model_len sequence needs; lower max_model_len, raise "
            f"gpu_memory_utilization, or set num_blocks"
        )
    plan = MemoryPlan(int(num_blocks), int(num_blocks * spec.bytes_per_block), reserve, source)
    logger.info(
        "KV cache: %d blocks of %d tokens (%.0f MiB, %s); graph reserve %.0f MiB; activation peak %.0f MiB",
        plan.num_blocks,
        spec.block_size,
        plan.kv_bytes / 2**20,
        source,
        reserve / 2**20,
        activation_peak_bytes / 2**20,
    )
    return plan
