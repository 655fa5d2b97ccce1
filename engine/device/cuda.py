"""CUDA backend: CUDA graphs per decode bucket, NCCL for transfers."""

from __future__ import annotations

import torch

from engine.device.base import Device, GraphFn


class CudaDevice(Device):
    name = "cuda"
    dist_backend = "nccl"
    supports_graphs = True

    def __init__(self, index: int = 0) -> None:
        self._device = torch.device("cuda", index)
        self._pool = None  # one memory pool shared by every captured graph

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @property
    def torch_device(self) -> torch.device:
        return self._device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self._device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def peak_memory(self) -> int:
        return torch.cuda.max_memory_allocated(self._device)

    def capture_graph(self, fn: GraphFn, static_inputs: dict[str, torch.Tensor]) -> GraphFn | None:
        # Warm the kernels once on a side stream, as capture requires, then capture.
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            fn(**static_inputs)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn(**static_inputs)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
