"""Decode graphs of the flat runner: padded (batch, block-table width) shapes captured at warm-up and replayed.

On the CPU a graph is a stand-in that re-runs the captured function on its static input buffers, which is what
a CUDA graph replays: the padding of the batch and of the block table, the buffers' reuse from step to step and
the choice of shape are all exercised, with the accelerators' attention operator. With
``BUCKETSERVE_TEST_DEVICE=cuda`` the same tests capture real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEST_DEVICE, random_prompts, small_config

from engine.device.cpu import CpuDevice
from engine.flat_runner import FlatRunner
from engine.graph_shapes import graph_ladder
from engine.kernels.paged_attention_blocks import make_paged_attention_blocks
from engine.kernels.paged_attention_gather import paged_attention_gather
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams


class ReplayingCpu(CpuDevice):
    """The CPU with graphs that replay by calling the captured function on the buffers it was given."""

    supports_graphs = True
    flat_decode_graphs = True

    def __init__(self) -> None:
        super().__init__()
        self.captured = 0
        self.replays = 0

    def capture_graph(self, fn, static_inputs):
        self.captured += 1

        def replay() -> torch.Tensor:
            self.replays += 1
            return fn(**static_inputs)

        return replay


def test_graph_ladder() -> None:
    assert graph_ladder(1) == [1]
    assert graph_ladder(8) == [1, 2, 4, 8]
    assert graph_ladder(12) == [1, 2, 4, 8, 12]
    assert graph_ladder(32, smallest=4) == [4, 8, 16, 32]
    assert graph_ladder(3, smallest=4) == [3]


# The graph-safe operators: the accelerators' gather, and the HPU's flat block layout (whose block-to-sequence
# matmuls must keep a padding row's garbage out of the real rows).
GRAPH_OPERATORS = {"gather": paged_attention_gather, "blocks": make_paged_attention_blocks()}


def _engine_with_graphs(
    batches, widths, compiled: bool = False, operator: str = "gather"
) -> tuple[LLMEngine, object]:
    engine = LLMEngine(small_config(shape_policy="flat"))
    if TEST_DEVICE == "cpu":
        device, attend = ReplayingCpu(), GRAPH_OPERATORS[operator]
    else:  # the engine's own device and operator: real graphs
        device, attend = engine.device, engine.device.paged_attention()
    engine.runner = FlatRunner(
        engine.loaded.model,
        engine.kv_cache,
        device,
        attend,
        engine.config.scheduler.max_num_batched_tokens,
        compile_forward=compiled,
        graph_batches=batches,
        graph_widths=widths,
    )
    engine.runner.warmup()
    return engine, device


@pytest.mark.parametrize("operator", list(GRAPH_OPERATORS))
def test_decode_steps_replay_padded_graphs_and_match_hf(hf_reference, operator: str) -> None:
    engine, device = _engine_with_graphs([1, 2, 4], [2, 4, 8], operator=operator)
    assert sorted(engine.runner._graphs) == sorted((b, w) for b in (1, 2, 4) for w in (2, 4, 8))
    if isinstance(device, ReplayingCpu):
        assert device.captured == 9
    # Three sequences (batch padded to 4) whose contexts cross block boundaries (widths padded to 2, 4, 8).
    lengths = [5, 29, 47]
    prompts = random_prompts(lengths, seed=3)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = engine.generate(Request(f"g{i}", p, sp) for i, p in enumerate(prompts))
    if isinstance(device, ReplayingCpu):
        # Every step after the prompts' is a decode of at most 3 sequences within 8 blocks (128 tokens): all
        # replayed; 40 tokens each, the first sampled by the prefill step.
        assert device.replays == 39
    ref = hf_reference(engine.loaded.path)
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == ref.greedy(p, 40, ignore_eos=True), r.request_id
    engine.check_integrity()


def test_compiled_forward_pads_single_decodes_to_two_rows(hf_reference) -> None:
    # A compiled forward takes at least 2 rows: the batch-1 graph becomes a batch-2 graph, one row padding.
    engine, device = _engine_with_graphs([1, 2], [4], compiled=True)
    assert sorted(engine.runner._graphs) == [(2, 4)]
    (r,) = engine.generate([Request("c", random_prompts([12], seed=6)[0], SamplingParams(max_tokens=20))])
    assert r.output_token_ids == hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, 20)
    if isinstance(device, ReplayingCpu):
        assert device.replays == 19
    assert engine.runner.runtime_compilations == 0
    engine.check_integrity()


def test_steps_outside_every_graph_run_eagerly(hf_reference) -> None:
    # Graphs for one sequence of up to 2 blocks: two sequences, or a context past 32 tokens, run eagerly.
    engine, device = _engine_with_graphs([1], [2])
    prompts = random_prompts([20, 9], seed=4)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    reqs = engine.generate(Request(f"e{i}", p, sp) for i, p in enumerate(prompts))
    ref = hf_reference(engine.loaded.path)
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == ref.greedy(p, 16, ignore_eos=True), r.request_id
    if isinstance(device, ReplayingCpu):
        assert device.replays == 0  # both sequences decode together until they finish
    # Alone, a short sequence replays the graph until its context outgrows the 2 blocks.
    (solo,) = engine.generate([Request("solo", random_prompts([10], seed=5)[0], sp)])
    assert solo.output_token_ids == ref.greedy(solo.prompt_token_ids, 16, ignore_eos=True)
    if isinstance(device, ReplayingCpu):
        # Decode steps compute positions 10..24 (15 steps): those up to position 31 fit 2 blocks.
        assert device.replays == 15
    engine.check_integrity()
