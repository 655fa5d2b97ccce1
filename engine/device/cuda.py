"""CUDA backend: CUDA graphs per decode bucket, NCCL for transfers."""

from __future__ import annotations

import logging

import torch

from engine.device.base import Device, GraphFn
from engine.graph_shapes import graph_ladder
from engine.kernels.paged_attention_gather import paged_attention_gather

logger = logging.getLogger(__name__)


def _triton_operator():
    """The Triton-backed operator, or None where Triton is not installed."""
    try:
        from engine.kernels.paged_attention_cuda import paged_attention_cuda
    except ImportError as e:
        logger.warning("Triton unavailable (%s): decode attention gathers each sequence's blocks", e)
        return None
    return paged_attention_cuda


# Whether start-up times the Triton skinny GEMM against cuBLAS per weight shape and takes it where faster.
SKINNY_GEMM = True
# Whether start-up fuses each layer's Q/K/V and gate/up linears into one GEMM each (engine/fused_projections.py).
FUSE_PROJECTIONS = True
# Whether a layer's new K and V are written by one Triton kernel (engine/kernels/kv_write_triton.py) instead of
# two index_copy_ kernels.
KV_WRITE_KERNEL = True
# Whether each fused Q/K/V attention layer rotates its queries and keys and writes its keys and values into the
# cache with one Triton kernel (engine/kernels/rope_write_triton.py) instead of the compiled rotary, the copies to
# token-major rows and the K/V writer: four kernels a layer into one. Off until a decode step measures shorter
# with it (bench gpu --ab rope-write-kernel).
ROPE_WRITE_KERNEL = False
# Whether each gated MLP whose down projection took the skinny kernel computes silu(gate) * up inside that kernel
# (engine.kernels.skinny_gemm_triton.fuse_gated_downs) instead of in a kernel of its own before it: one kernel a
# layer fewer at decode batch sizes. Off until a decode step measures shorter with it (bench gpu --ab gated-down).
GATED_DOWN_KERNEL = False
# Whether the compiled forward launches independent elementwise kernels together (inductor's combo kernels). A
# layer's rotary of Q, of K and the copy of V are three launches, 55 us of a batch-1 step of llama3-8b-l8 on an
# H200. Combined, the step ran 103 kernels instead of 119 and its small kernels took 0.09 ms instead of 0.13, but
# the batch-1 step did not get shorter (1.44 against 1.43 ms; batch 8 2-3% shorter), measured in one process
# (bench gpu --ab combo-kernels): off until a step gains from it.
COMBO_KERNELS = False
# Whether the greedy argmax over the vocabulary runs as a split reduction, inside the decode graphs
# (engine.sampler.greedy_tokens), instead of torch's one-block argmax after the graph.
SPLIT_GREEDY = True


class CudaDevice(Device):
    name = "cuda"
    dist_backend = "nccl"
    supports_graphs = True
    flat_decode_graphs = True

    def __init__(self, index: int = 0) -> None:
        self._device = torch.device("cuda", index)
        self._pool = None  # one memory pool shared by every captured graph
        self._operator = _triton_operator()

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

    def to_host_async(self, t: torch.Tensor):
        # Pinned, so the copy is a DMA queued behind the kernels that produce t; the event says when it landed.
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._device))
        return host, done.synchronize

    def fuse_projections(self, model: torch.nn.Module) -> dict[str, int]:
        if not FUSE_PROJECTIONS:
            return {}
        from engine.fused_projections import fuse_projections

        counts = fuse_projections(model)
        torch.cuda.empty_cache()  # the separate weights, now views into the fused ones
        return counts

    def fuse_rope_writes(self, model: torch.nn.Module) -> int:
        if not ROPE_WRITE_KERNEL:
            return 0
        try:
            from engine.kernels.rope_write_triton import rope_write_kv_triton
        except ImportError as e:
            logger.warning("Triton unavailable (%s): rotary and K/V writes stay apart", e)
            return 0
        from engine.fused_rope_write import fuse_rope_writes

        return fuse_rope_writes(model, rope_write_kv_triton)

    def tune_linears(self, model: torch.nn.Module) -> dict[str, dict]:
        if not SKINNY_GEMM:
            return {}
        try:
            from engine.kernels.skinny_gemm_triton import CONFIGS, fuse_gated_downs, tune_linears
        except ImportError as e:
            logger.warning("Triton unavailable (%s): every linear runs on cuBLAS", e)
            return {}
        picked = tune_linears(model)
        if GATED_DOWN_KERNEL:
            fuse_gated_downs(model)
        torch.cuda.empty_cache()  # the timing's scratch weights, before the KV cache is sized from free memory
        return {
            f"{n}x{k}": {
                "choice": "cublas" if config is None else str(CONFIGS[config]),
                "ms_at_rows": {str(name): t for name, t in timings.items()},
            }
            for (n, k), (config, timings) in picked.items()
        }

    def compile_options(self) -> dict:
        return {"combo_kernels": True} if COMBO_KERNELS else {}

    def kv_writer(self):
        from engine.attention import write_slots

        if not KV_WRITE_KERNEL:
            return write_slots
        try:
            from engine.kernels.kv_write_triton import write_slots_triton
        except ImportError as e:
            logger.warning("Triton unavailable (%s): K/V written by index_copy_", e)
            return write_slots
        return write_slots_triton

    def greedy_splits(self, vocab: int) -> int:
        if not SPLIT_GREEDY:
            return 1
        from engine.sampler import split_count

        return split_count(vocab)

    def paged_attention(self, dtype: torch.dtype | None = None):
        # Decode steps never read back to the host, so they can be captured as graphs.
        return self._operator or paged_attention_gather

    def decode_graph_widths(self, max_blocks: int) -> list[int]:
        if self._operator is not None:
            # The kernel reads only each sequence's own blocks, whatever the table's width.
            return [max_blocks]
        # The gather copies every block the table names: widths in powers of two waste at most half.
        return graph_ladder(max_blocks, smallest=min(4, max_blocks))

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
