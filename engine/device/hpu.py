"""Intel Gaudi (HPU) backend, written against ``habana_frameworks.torch``.

This module is imported only when the Gaudi software stack is installed (see ``engine.device``);
all HPU-specific calls of the project live here.
"""

from __future__ import annotations

from collections.abc import Callable

import habana_frameworks.torch as htorch  # noqa: F401 - registers the 'hpu' device with torch
import habana_frameworks.torch.core as htcore
import torch

from engine.device.base import Device, GraphFn


class HpuDevice(Device):
    name = "hpu"
    dist_backend = "hccl"
    supports_graphs = True

    @classmethod
    def is_available(cls) -> bool:
        return htorch.hpu.is_available()

    @property
    def torch_device(self) -> torch.device:
        return torch.device("hpu")

    def mem_get_info(self) -> tuple[int, int]:
        return torch.hpu.mem_get_info()

    def synchronize(self) -> None:
        htorch.hpu.synchronize()

    def mark_step(self) -> None:
        # Lazy mode accumulates ops into a graph until mark_step() launches it.
        htcore.mark_step()

    def reset_peak_memory(self) -> None:
        htorch.hpu.reset_peak_memory_stats()

    def peak_memory(self) -> int:
        return htorch.hpu.max_memory_allocated()

    def paged_attention(self, dtype: torch.dtype | None = None) -> Callable[..., None]:
        """The flat-token operator (``--shape-policy flat``) in the flat block layout: decode steps in fixed
        ``(batch, table width)`` shapes whose batch/block mapping runs as matmuls, prompt steps through Gaudi's
        fused SDPA. The default ``buckets`` policy runs its own padded 3-D shapes (:mod:`engine.attention`)."""
        from habana_frameworks.torch.hpex.kernels import FusedSDPA

        from engine.kernels.paged_attention_blocks import fused_sdpa_adapter, make_paged_attention_blocks

        return make_paged_attention_blocks(fused_sdpa_adapter(FusedSDPA.apply))

    def capture_graph(self, fn: GraphFn, static_inputs: dict[str, torch.Tensor]) -> GraphFn | None:
        graph = htorch.hpu.HPUGraph()
        stream = htorch.hpu.Stream()
        with htorch.hpu.stream(stream):
            graph.capture_begin()
            out = fn(**static_inputs)
            graph.capture_end()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
