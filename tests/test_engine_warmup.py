"""Warm-up covers every bucket, logs each one, and serving inside the range compiles nothing."""

from __future__ import annotations

import logging

from engine_helpers import random_prompts, small_config

from engine.flat_runner import CPU_EAGER_WARMUP_TOKENS
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams


def test_warmup_then_no_runtime_compilation_inside_range(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        engine = LLMEngine(small_config(skip_warmup=False, shape_policy="buckets"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[Warmup]")]
    n_prompt, n_decode = len(engine.buckets.prompt), len(engine.buckets.decode)
    assert len(lines) == n_prompt + n_decode
    assert lines[0].startswith(f"[Warmup][Prompt][1/{n_prompt}]") and "free_mem:" in lines[0]
    assert any(line.startswith(f"[Warmup][Decode][{n_decode}/{n_decode}]") for line in lines)
    assert engine.runner.warmed_up and engine.runner.runtime_compilations == 0

    prompts = random_prompts([5, 30, 77, 120, 200, 16], seed=4)
    engine.generate([Request(f"w{i}", p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)])
    assert engine.runner.runtime_compilations == 0

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        largest = max(q for _, q, _ in engine.buckets.prompt)
        engine.generate(
            [Request("big", random_prompts([largest + 10], seed=5)[0], SamplingParams(max_tokens=2))]
        )
    assert engine.runner.runtime_compilations == 1
    assert any("runtime compilation #1" in r.getMessage() for r in caplog.records)


def test_cpu_compile_path_is_exact_and_writes_the_cache_in_place(hf_reference) -> None:
    # --compile: torch.compile(dynamic=False), one graph per shape; kept to one prompt and one
    # decode shape because each CPU compilation takes tens of seconds.
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from engine.config import CacheConfig, SchedulerConfig

    engine = LLMEngine(
        small_config(
            compile=True,
            shape_policy="buckets",
            cache=CacheConfig(block_size=16, num_blocks=1024),
            scheduler=SchedulerConfig(
                max_model_len=128, max_num_seqs=2, max_num_prefill_seqs=1, max_num_batched_tokens=64
            ),
        )
    )
    prompt = random_prompts([20], seed=1)[0]
    req = Request("compiled", prompt, SamplingParams(max_tokens=4))
    # The code inductor generates for the prompt and decode shapes (the on-disk graph cache off, so that a
    # graph compiled by an earlier run is generated again rather than loaded).
    with inductor_config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(engine.generate, [req])
    assert req.output_token_ids == hf_reference(engine.loaded.path).greedy(prompt, 4)
    # The new K/V go into the cache in place. Were the write functionalised, each graph would allocate a
    # buffer the shape of the whole cache and loop over every element of a layer's K and V to copy it back.
    kv = engine.runner.kv.data
    code = "\n".join(codes)
    assert code, "nothing was compiled"
    cache_shape = "(" + ", ".join(map(str, kv.shape)) + ")"
    per_layer = f"{kv[0, 0].numel()}L"
    copies = [
        line.strip()
        for line in code.splitlines()
        if ("empty_strided" in line and cache_shape in line) or ("for(" in line and per_layer in line)
    ]
    assert not copies, copies[:3]


def test_decode_buckets_stop_at_what_a_full_batch_can_reference() -> None:
    # A large cache (an accelerator's tens of GiB) must not make warm-up capture decode shapes that no batch of
    # max_num_seqs sequences of max_model_len tokens can reach.
    from engine.config import CacheConfig

    engine = LLMEngine(small_config(cache=CacheConfig(block_size=16, num_blocks=20000)))
    s = engine.config.scheduler
    reachable = s.max_num_seqs * -(-s.max_model_len // 16)  # 8 x 32 = 256 blocks
    largest = max(nb for _, _, nb in engine.buckets.decode)
    assert reachable <= largest < 2 * reachable
    assert engine.buckets.find_decode(s.max_num_seqs, reachable) is not None
    assert engine.allocator.num_blocks == 20000  # the cache itself keeps every block


def test_flat_warmup_is_one_short_step_on_the_eager_cpu(caplog) -> None:
    # Flat tokens: nothing is padded, so there is no shape to warm one by one. Eagerly on the CPU one short step
    # sets the kernels up (a compiled forward warms with the whole budget: see the compile test below), and
    # serving any mix of lengths compiles nothing.
    with caplog.at_level(logging.INFO, logger="engine.flat_runner"):
        engine = LLMEngine(small_config(skip_warmup=False, shape_policy="flat"))
    budget = engine.config.scheduler.max_num_batched_tokens
    assert budget > CPU_EAGER_WARMUP_TOKENS
    assert any(f"one step of {CPU_EAGER_WARMUP_TOKENS} tokens" in r.getMessage() for r in caplog.records)
    assert engine.runner.warmed_up and engine.warmup_report["buckets"] == 0
    prompts = random_prompts([5, 300, 77, 1, 200], seed=4)
    engine.generate([Request(f"f{i}", p, SamplingParams(max_tokens=9)) for i, p in enumerate(prompts)])
    assert engine.runner.runtime_compilations == 0
    engine.check_integrity()


def test_flat_compile_is_one_dynamic_graph_exact_and_in_place(hf_reference) -> None:
    # --compile under the flat policy: one graph, dynamic in the token count, compiled at warm-up; every later
    # mix of decodes and prefill chunks (including a lone decode, T = 1) runs it without compiling again.
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from engine.config import CacheConfig, SchedulerConfig

    with inductor_config.patch(fx_graph_cache=False):
        engine, codes = run_and_get_code(
            LLMEngine,
            small_config(
                compile=True,
                skip_warmup=False,
                shape_policy="flat",
                cache=CacheConfig(block_size=16, num_blocks=1024),
                scheduler=SchedulerConfig(
                    max_model_len=256, max_num_seqs=4, max_num_prefill_seqs=4, max_num_batched_tokens=64
                ),
            ),
        )
    prompts = random_prompts([20, 3, 90, 1], seed=6)
    reqs = [Request(f"c{i}", p, SamplingParams(max_tokens=5)) for i, p in enumerate(prompts)]
    engine.generate(reqs)
    engine.generate([Request("alone", prompts[0], SamplingParams(max_tokens=3))])  # decodes of T = 1
    assert engine.runner.runtime_compilations == 0
    for r in reqs:
        assert r.output_token_ids == hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, 5)
    # The K/V write stays in place: no buffer the shape of the cache, no loop over a whole layer of it.
    kv = engine.kv_cache.data
    code = "\n".join(codes)
    assert code, "nothing was compiled at warm-up"
    cache_shape = "(" + ", ".join(map(str, kv.shape)) + ")"
    assert not [line for line in code.splitlines() if "empty_strided" in line and cache_shape in line]
    engine.check_integrity()


def test_flat_compile_with_overlapped_decode_compiles_nothing_at_run_time(hf_reference) -> None:
    # A step launched ahead takes the previous step's tokens from the device: its input ids must be the same kind
    # of tensor as a plain step's (a normal tensor, not one made under inference mode), or the compiled forward's
    # guards miss on the first overlapped step and it compiles again while serving.
    from engine.config import CacheConfig, SchedulerConfig

    engine = LLMEngine(
        small_config(
            compile=True,
            skip_warmup=False,
            shape_policy="flat",
            overlap_decode="on",
            cache=CacheConfig(block_size=16, num_blocks=512),
            scheduler=SchedulerConfig(
                max_model_len=128, max_num_seqs=2, max_num_prefill_seqs=2, max_num_batched_tokens=64
            ),
        )
    )
    prompts = random_prompts([12, 30], seed=8)
    reqs = [Request(f"o{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts)]
    engine.generate(reqs)
    assert engine.stats["overlapped_steps"] > 0
    assert engine.runner.runtime_compilations == 0
    for r in reqs:
        assert r.output_token_ids == hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, 6)
    engine.check_integrity()
