"""The engine of one worker: model, paged KV cache, shape buckets, scheduler policy, sampler.

Used three ways, with the same code: in-process (``bucketserve generate``, ``bench offline``),
as a colocated worker (prefill + decode), and split across a prefill worker (:meth:`prefill_only`)
and a decode worker (:meth:`admit_prefilled` + :meth:`step`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch

from bucket_manager.shape_buckets import ShapeBucketConfig, ShapeBuckets
from engine.block_allocator import BlockAllocator
from engine.config import EngineConfig, resolve_engine_config
from engine.decoder_stack import decoder_stack
from engine.device import get_device
from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION
from engine.flat_runner import FlatRunner
from engine.fused_attention import fuse_attention_layers
from engine.fused_mlp import fuse_gated_mlps
from engine.fused_norm import fuse_rms_norms
from engine.graph_shapes import graph_ladder
from engine.kv_cache import KVCache
from engine.linear_prepack import can_prepack, prepack_linears
from engine.memory import plan_kv_memory
from engine.model_loader import load_model, read_model_facts
from engine.model_runner import ModelRunner
from engine.pending_step import PendingStep
from engine.request import FinishReason, Request, RequestOutput, RequestRejected, RequestStatus
from engine.sampler import Sampler
from engine.scheduler import (
    FlatLimits,
    RunningSeq,
    SeqState,
    StepLimits,
    StepPlan,
    WaitingSeq,
    plan_flat_step,
    plan_step,
)
from engine.tpot_guard import DecodeClock, StepClock, prompt_token_cap, step_allowance_s

logger = logging.getLogger(__name__)

# KV memory backed at start-up (KVCache.prefault): the working set of the first requests, 2,048 blocks of `small`.
KV_PREFAULT_BYTES = 512 * 2**20


@contextlib.contextmanager
def own_cores(items: Sequence[tuple[Request, int]]) -> Iterator[float]:
    """The default :attr:`LLMEngine.compute_cores`: a forward pass runs on the engine's own threads (speed-up 1)."""
    yield 1.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        self.device = get_device(config.device)
        self.device.prepare_process()
        facts = read_model_facts(config.model)
        self.config = cfg = resolve_engine_config(
            config, self.device.name, facts.max_position_embeddings, facts.dtype
        )
        self.loaded = load_model(cfg.model, self.device.torch_device, cfg.dtype)
        self.tokenizer = self.loaded.tokenizer
        model_dtype = next(self.loaded.model.parameters()).dtype
        if can_prepack(self.device.torch_device, model_dtype):
            prepack_linears(self.loaded.model)
            fuse_gated_mlps(self.loaded.model)
        # A compiled forward fuses F.rms_norm into its neighbours; our opaque kernel would stop that.
        fuse_rms_norms(self.loaded.model, use_kernel=not cfg.compile)
        # Before the linears are tuned, so the fused ones are timed at their own shapes.
        self.fused_projections = self.device.fuse_projections(self.loaded.model)
        self.linear_choices = self.device.tune_linears(self.loaded.model)
        self.block_size = bs = cfg.cache.block_size
        self.kv_spec = self.loaded.kv_spec(bs)
        sched = cfg.scheduler
        min_blocks = -(-sched.max_model_len // bs)
        # Profile the largest prompt bucket's activations on a scratch cache before sizing the real one.
        peak = self._profile_activation_peak(min_blocks)
        plan = plan_kv_memory(cfg.cache, self.device, self.kv_spec, peak, min_blocks)
        self.kv_cache = KVCache(self.kv_spec, plan.num_blocks, self.device.torch_device)
        self.allocator = BlockAllocator(plan.num_blocks)
        t0 = time.perf_counter()
        backed = self.kv_cache.prefault(KV_PREFAULT_BYTES)
        if backed:
            logger.info(
                "backed the first %d of %d KV blocks with memory in %.2f s",
                backed,
                plan.num_blocks,
                time.perf_counter() - t0,
            )
        # The controller's request buckets snap to these shapes whatever the policy; only "buckets" pads to them.
        self.buckets = self._make_buckets(plan.num_blocks)
        self.runner: FlatRunner | ModelRunner
        self.rope_writes = 0  # attention layers whose rotary and K/V writes run as one kernel (flat policy)
        if cfg.shape_policy == "flat":
            self.loaded.model.set_attn_implementation(FLAT_ATTN_IMPLEMENTATION)
            self.rope_writes = self.device.fuse_rope_writes(self.loaded.model)
            attend = self.device.paged_attention(getattr(torch, self.kv_spec.dtype))
            stack = None
            if self.device.name == "cpu" and not cfg.compile:
                # A compiled forward fuses this glue itself, and the fused layer reads the forward context.
                fuse_attention_layers(self.loaded.model, attend, getattr(torch, self.kv_spec.dtype))
                stack = decoder_stack(self.loaded.model, attend)
            self.runner = FlatRunner(
                self.loaded.model,
                self.kv_cache,
                self.device,
                attend,
                sched.max_num_batched_tokens,
                compile_forward=cfg.compile,
                # Decode graphs (where the device captures them) up to 256 sequences and the longest context.
                graph_batches=graph_ladder(min(sched.max_num_seqs, 256)),
                graph_widths=self.device.decode_graph_widths(min_blocks),
                stack=stack,
            )
            self._step = self._step_flat
        else:
            self.runner = ModelRunner(
                self.loaded.model,
                self.kv_cache,
                self.device,
                self.buckets,
                sched.max_model_len,
                compile_cpu=cfg.compile,
            )
            self._step = self._step_buckets
        self.limits = StepLimits(sched.max_num_seqs, sched.max_num_prefill_seqs, sched.max_num_batched_tokens)
        self.flat_limits = FlatLimits(sched.max_num_seqs, sched.max_num_batched_tokens, bs)
        self.sampler = Sampler(cfg.seed, self.device.greedy_splits(self.loaded.model.lm_head.weight.shape[0]))
        self.waiting: collections.deque[Request] = collections.deque()
        # Optional admission order of new requests (smaller key first; equal keys stay FCFS). None: FCFS.
        self.waiting_key: Callable[[Request], tuple] | None = None
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = set(self.loaded.eos_token_ids)
        self.stats = {
            "prefill_steps": 0,
            "decode_steps": 0,
            "preemptions": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,
            "overlapped_steps": 0,  # decode steps launched before the previous step's tokens were read
            "guarded_steps": 0,  # steps whose prompt tokens the TPOT guard cut down
        }
        # Overlapped decode (see engine.pending_step): the step in flight whose tokens the host has not read.
        self._overlap = cfg.overlap_decode == "on" and isinstance(self.runner, FlatRunner)
        self._pending: PendingStep | None = None
        # What a step costs (flat policy; engine/tpot_guard.py): the TPOT guard's estimates when it is on, and a
        # colocated worker's when it decides whether to borrow its neighbours' cores (worker/colocated.py).
        self.step_clock = StepClock()
        self._tpot_guard = sched.tpot_guard
        # Held around every forward pass with its (request, new tokens): the cores it runs on. A colocated worker
        # sets it (its own cores' gate, or its neighbours' cores too); it yields the pass's speed-up over the
        # engine's own threads, which the step clock divides out.
        self.compute_cores: Callable[[Sequence[tuple[Request, int]]], AbstractContextManager[float]] = (
            own_cores
        )
        self.warmup_report: dict[str, float] = {}
        if not cfg.skip_warmup:
            self.warmup_report = self.runner.warmup(graph_memory_budget=plan.graph_reserve_bytes or None)

    # ------------------------------------------------------------------ set-up
    def _max_decode_blocks(self, num_blocks: int) -> int:
        # No decode batch can reference more blocks than max_num_seqs full-length sequences hold; buckets
        # above that would only cost warm-up time and graph memory (a 64 GiB cache has ~250k blocks).
        s = self.config.scheduler
        return min(num_blocks, s.max_num_seqs * -(-s.max_model_len // self.block_size))

    def _make_buckets(self, num_blocks: int) -> ShapeBuckets:
        s = self.config.scheduler
        return ShapeBuckets(
            ShapeBucketConfig.from_serving(
                strategy=self.config.bucketing.strategy,
                block_size=self.block_size,
                max_model_len=s.max_model_len,
                max_num_seqs=s.max_num_seqs,
                max_num_prefill_seqs=s.max_num_prefill_seqs,
                max_num_batched_tokens=s.max_num_batched_tokens,
                num_blocks=self._max_decode_blocks(num_blocks),
                prefix_caching=self.config.bucketing.prefix_caching,
                env=os.environ,
            )
        )

    def _profile_activation_peak(self, min_blocks: int) -> int:
        if self.device.name == "cpu":
            return 0  # host RAM has no allocator peak counter worth trusting; the CPU cap covers it
        s = self.config.scheduler
        scratch = KVCache(self.kv_spec, min_blocks, self.device.torch_device)
        runner = ModelRunner(self.loaded.model, scratch, self.device, None, s.max_model_len, use_graphs=False)
        q = min(s.max_num_batched_tokens, s.max_model_len)
        b = max(1, min(s.max_num_prefill_seqs, s.max_num_batched_tokens // q))
        self.device.reset_peak_memory()
        runner.execute(runner._dummy_prompt((b, q, 0)))
        # The largest decode batch gathers the K and V blocks of every sequence, per layer: its transient
        # can exceed the prompt's (every dummy block is the null block, so the scratch cache stays small).
        largest_decode = max(self._make_buckets(2**62).decode, key=lambda shape: (shape[2], shape[0]))
        runner.execute(runner._dummy_decode(largest_decode))
        self.device.synchronize()
        peak = self.device.peak_memory()
        del scratch, runner
        return peak

    # ------------------------------------------------------------------ requests
    def validate(self, req: Request) -> None:
        limit = self.config.scheduler.max_model_len
        if req.num_prompt_tokens >= limit:
            raise RequestRejected(
                f"prompt has {req.num_prompt_tokens} tokens; max_model_len is {limit} (prompt + output must fit)"
            )

    def add_request(self, req: Request) -> None:
        self.validate(req)
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        key = self.waiting_key
        if key is None:
            self.waiting.append(req)
            return
        k = key(req)
        # Behind every waiting request of an equal or smaller key: stable, so FCFS within a key.
        pos = len(self.waiting)
        while pos > 0 and k < key(self.waiting[pos - 1]):
            pos -= 1
        self.waiting.insert(pos, req)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.finish(FinishReason.ABORT)
        self._release(req)
        return self._output(req, [], [])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def _release(self, req: Request) -> None:
        if self._pending is not None and self._pending.holds(req):
            self._pending.release_after.append(req)  # the step in flight still writes into its blocks
            return
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        self.sampler.release(req.request_id)
        self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ blocks
    def _blocks_to_cover(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def _grow(self, req: Request, num_tokens: int) -> None:
        n = self._blocks_to_cover(req, num_tokens)
        if n:
            req.block_ids += self.allocator.allocate(n)

    # ------------------------------------------------------------------ stepping
    def _plan(self) -> StepPlan:
        waiting = [
            WaitingSeq(
                r.request_id, r.num_tokens - r.num_computed_tokens, self._blocks_to_cover(r, r.num_tokens)
            )
            for r in self._prefill_candidates()
        ]
        running = [
            RunningSeq(r.request_id, self._blocks_to_cover(r, r.num_tokens), len(r.block_ids))
            for r in self.running
        ]
        return plan_step(waiting, running, self.allocator.num_free, self.limits)

    def _prefill_candidates(self) -> list[Request]:
        """FCFS head first, then the other waiting requests that pad to the head's query bucket (one
        shape, little padding), cut to a batch size that is itself a warmed bucket, so no row is padding
        (on CPU a padded row costs as much as a real one)."""
        if not self.waiting:
            return []
        head = self.waiting[0]
        q = self._query_bucket(head)
        cands = [head] + [r for r in itertools.islice(self.waiting, 1, None) if self._query_bucket(r) == q]
        n = min(len(cands), self.limits.max_num_prefill_seqs)
        while n > 1:
            shape = self.buckets.find_prompt(n, q, 0)
            if shape is not None and shape[0] == n:
                break
            n -= 1
        return cands[:n]

    def _query_bucket(self, req: Request) -> int:
        n = req.num_tokens - req.num_computed_tokens
        found = self.buckets.find_prompt(1, n, 0)
        return found[1] if found else n

    def step(self) -> list[RequestOutput]:
        """One forward pass over the running and waiting requests, by the engine's shape policy."""
        return self._step()

    def padded_prompt_tokens(self, lengths: Sequence[int]) -> int:
        """Token rows a prefill batch of these prompt lengths computes: padded to the warmed bucket under the
        ``buckets`` policy, exactly the prompts under ``flat``."""
        real = sum(lengths)
        if self.config.shape_policy == "flat":
            return real
        shape = self.buckets.find_prompt(len(lengths), max(lengths), 0)
        return max(real, shape[0] * shape[1]) if shape is not None else real

    def _step_flat(self) -> list[RequestOutput]:
        """With ``overlap_decode`` on and only greedy decodes to run: queue the next decode step behind the one in
        flight, then read that one's tokens back while the new one runs (outputs come one step late). Anything
        else (a prompt waiting, a request joining or leaving, one ending by length, sampling, logprobs) first
        drains the step in flight and runs a step the plain way."""
        pending = self._pending
        if pending is None:
            if not (self._overlap and self._can_launch(None)):
                return self._step_flat_sync()
            pending = self._pending = self._launch(list(self.running), None)
        if self._can_launch(pending):
            self._pending = self._launch(pending.reqs, pending.tokens)
            return self._resolve(pending)
        self._pending = None
        return self._resolve(pending) + self._step_flat_sync()

    def _can_launch(self, pending: PendingStep | None) -> bool:
        """Whether the next step can be launched without the host seeing the tokens of ``pending`` (the step in
        flight, if any): greedy decodes without logprobs, the same requests as that step in the same order,
        none of which ends by length there, no prompt waiting, and a free block for each request that needs
        one."""
        if self.waiting or not self.running or len(self.running) > self.flat_limits.max_num_batched_tokens:
            return False
        ahead = pending is not None
        if ahead and (
            len(self.running) != len(pending.reqs)
            or any(a is not b for a, b in zip(self.running, pending.reqs, strict=True))
        ):
            return False
        max_len = self.config.scheduler.max_model_len
        need = 0
        for r in self.running:
            sp = r.sampling
            if not sp.greedy or sp.logprobs:
                return False
            if ahead:  # its token in flight must not end it, or this step computes past its end
                if r.num_generated_tokens + 1 >= sp.max_tokens or r.num_tokens + 1 >= max_len:
                    return False
            elif r.num_computed_tokens + 1 != r.num_tokens:
                return False
            need += self._blocks_to_cover(r, r.num_tokens + int(ahead))
        return need <= self.allocator.num_free

    def _launch(self, reqs: list[Request], tokens: torch.Tensor | None) -> PendingStep:
        """Queue a decode step of ``reqs``: from their last known tokens, or with ``tokens`` [B] (the step in
        flight's, on the device) one position further. Afterwards every request counts the position as
        computed; its token is appended when the step is resolved."""
        ahead = tokens is not None
        for r in reqs:
            self._grow(r, r.num_tokens + ahead)
        with self.compute_cores([(r, 1) for r in reqs]):
            greedy = self.runner.decode_greedy(reqs, tokens)  # [B], the sampler's greedy choice
        for r in reqs:
            r.num_computed_tokens += 1
        self.stats["decode_steps"] += 1
        self.stats["overlapped_steps"] += ahead
        host, wait = self.device.to_host_async(greedy)
        return PendingStep(reqs, greedy, host, wait)

    def _resolve(self, step: PendingStep) -> list[RequestOutput]:
        """Wait for ``step``'s tokens and append them; a request that finishes is released once no step in
        flight writes into its blocks."""
        step.wait()
        outs = []
        for r, token in zip(step.reqs, step.host_tokens.tolist(), strict=True):
            if r.finished:  # aborted while the step ran
                continue
            outs.append(self._append(r, token, None))
            if r.finished:
                self.running.remove(r)
                self._release(r)
        for r in step.release_after:
            self._release(r)
        return outs

    def _step_flat_sync(self) -> list[RequestOutput]:
        """Decodes and prefill chunks in one step of flat tokens (chunked prefill), under the token budget."""

        def state(r: Request) -> SeqState:
            return SeqState(r.request_id, r.num_computed_tokens, r.num_tokens, len(r.block_ids))

        started = time.perf_counter()
        cap = self._prompt_cap()
        plan = plan_flat_step(
            [state(r) for r in self.running],
            [state(r) for r in self.waiting],
            self.allocator.num_free,
            self.flat_limits,
            cap,
        )
        for rid in plan.preempt_ids:
            self._preempt(self.requests[rid])
        if not plan.scheduled:
            return []
        items = []
        for rid, n in plan.scheduled:
            r = self.requests[rid]
            if r.status == RequestStatus.WAITING:
                self.waiting.remove(r)
                r.status = RequestStatus.RUNNING
                self.running.append(r)
            self._grow(r, r.num_computed_tokens + n)
            items.append((r, n))
        with self.compute_cores(items) as speedup:
            forward_start = time.perf_counter()
            logits, sampled = self.runner.run(items)
            forward_s = (time.perf_counter() - forward_start) * speedup
        decodes = sum(1 for r, n in items if n == 1 and r.num_generated_tokens > 0)
        prompt = sum(n for r, n in items) - decodes
        self.stats["decode_steps"] += 1 if decodes else 0
        self.stats["prefill_steps"] += 1 if decodes < len(items) else 0
        self.stats["prompt_tokens"] += prompt
        # The cap was reached (prompt work waited beyond it, or the cap was the floor).
        self.stats["guarded_steps"] += cap is not None and prompt >= cap
        for r, n in items:
            r.num_computed_tokens += n
        tokens, logprobs = self.sampler(logits, sampled)
        # Planned on one's own cores: the planning, and the forward as it would have taken there.
        self.step_clock.observe(forward_start - started + forward_s, decodes, prompt)
        outs = []
        for i, r in enumerate(sampled):
            outs.append(self._append(r, tokens[i], logprobs[i] if logprobs else None))
            if r.finished:
                self.running.remove(r)
                self._release(r)
        return outs

    def _prompt_cap(self) -> int | None:
        """The TPOT guard's cap on the next step's prompt tokens (None: none), from the requests decoding now."""
        if not self._tpot_guard or not self.running:
            return None
        clock = self.step_clock
        return prompt_token_cap(
            self.tpot_allowance_s(time.monotonic()), clock.decode_step_s, clock.prompt_s_per_token
        )

    def tpot_allowance_s(self, now: float) -> float | None:
        """How long the next step may take (from ``now``, ``time.monotonic()``) so that every request decoding
        with a TPOT target keeps its average within the guard's margin of it; None when none sets a target."""
        return step_allowance_s(
            DecodeClock(r.slo_tpot_ms / 1e3, r.num_generated_tokens - 1, now - r.first_token_time)
            for r in self.running
            if r.slo_tpot_ms is not None
            and r.first_token_time is not None
            and r.num_computed_tokens + 1 == r.num_tokens
        )

    def _step_buckets(self) -> list[RequestOutput]:
        """A prefill step or a decode step, each padded to a warmed shape bucket."""
        plan = self._plan()
        if plan.kind == "prefill":
            reqs = [self.requests[i] for i in plan.request_ids]
            for r in reqs:
                self.waiting.remove(r)
            return self._run_prefill(reqs)
        if plan.kind == "decode":
            for rid in plan.preempt_ids:
                self._preempt(self.requests[rid])
            reqs = [self.requests[i] for i in plan.request_ids]
            return self._run_decode(reqs)
        return []

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0  # recompute prompt + generated tokens later; greedy output is unchanged
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1
        logger.debug("preempted %s (KV cache full)", req.request_id)

    def prefill_only(
        self, reqs: Sequence[Request], on_layer_written: Callable[[int], None] | None = None
    ) -> list[RequestOutput]:
        """Prefill worker path: compute KV and the first token; blocks stay allocated for the transfer
        (hand them over with :meth:`detach`). Requests not yet known to the engine are registered.
        ``on_layer_written(layer)`` runs as each layer's K/V land in the cache, so the transfer of
        layer i can overlap the compute of the layers after it."""
        self.allocate_prompts(reqs)
        t0 = time.perf_counter()
        logits = self.runner.prefill(reqs, on_layer_written)
        self.stats["prefill_steps"] += 1
        self.stats["prompt_tokens"] += sum(r.num_tokens - r.num_computed_tokens for r in reqs)
        tokens, logprobs = self.sampler(logits, reqs)
        outs = []
        for i, r in enumerate(reqs):
            r.num_computed_tokens = r.num_tokens
            outs.append(self._append(r, tokens[i], logprobs[i] if logprobs else None))
        logger.debug("prefill of %d requests in %.1f ms", len(reqs), (time.perf_counter() - t0) * 1e3)
        return outs

    def allocate_prompts(self, reqs: Sequence[Request]) -> None:
        """Register the requests (when new) and give each the blocks its prompt needs, all before any compute:
        a prefill worker opens the KV transfers of a batch on these blocks, then runs :meth:`prefill_only`."""
        for r in reqs:
            self.requests.setdefault(r.request_id, r)
            self._grow(r, r.num_tokens)

    def _run_prefill(self, reqs: list[Request]) -> list[RequestOutput]:
        with self.compute_cores([(r, r.num_tokens - r.num_computed_tokens) for r in reqs]):
            outs = self.prefill_only(reqs)
        for r in reqs:
            if r.finished:
                self._release(r)
            else:
                r.status = RequestStatus.RUNNING
                self.running.append(r)
        return outs

    def detach(self, request_id: str) -> Request:
        """Prefill worker path: forget a prefilled request without freeing its blocks; the caller
        (the KV transport) now owns ``req.block_ids`` and frees them when the transfer ends."""
        req = self.requests.pop(request_id)
        self.sampler.release(request_id)
        return req

    def admit_prefilled(self, req: Request) -> None:
        """Decode worker path: KV of ``num_computed_tokens`` tokens is already in ``req.block_ids``."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self.running.append(req)

    def _run_decode(self, reqs: list[Request]) -> list[RequestOutput]:
        for r in reqs:
            self._grow(r, r.num_tokens)
        with self.compute_cores([(r, 1) for r in reqs]):
            logits = self.runner.decode(reqs)
        self.stats["decode_steps"] += 1
        tokens, logprobs = self.sampler(logits, reqs)
        outs = []
        for i, r in enumerate(reqs):
            r.num_computed_tokens = r.num_tokens
            outs.append(self._append(r, tokens[i], logprobs[i] if logprobs else None))
            if r.finished:
                self.running.remove(r)
                self._release(r)
        return outs

    def _append(self, req: Request, token: int, logprob: float | None) -> RequestOutput:
        req.output_token_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.stats["output_tokens"] += 1
        reason = self._stop_reason(req, token)
        if reason is not None:
            req.finish(reason)
        return self._output(req, [token], [logprob] if logprob is not None else [])

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        if not sp.ignore_eos and (token in self.eos_token_ids or token in sp.stop_token_ids):
            return FinishReason.STOP
        if sp.stop and self._stop_in_tail(req):
            req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            # Cut at the earliest stop string in the text, whichever of them it is.
            cuts = [c for c in (req.output_text.find(s) for s in sp.stop) if c >= 0]
            if cuts:
                req.output_text = req.output_text[: min(cuts)]
                return FinishReason.STOP
        if req.num_generated_tokens >= sp.max_tokens or req.num_tokens >= self.config.scheduler.max_model_len:
            return FinishReason.LENGTH
        return None

    def _stop_in_tail(self, req: Request) -> bool:
        """Whether a stop string ends in the text of the newest token. Earlier tokens were checked when they
        came, so a new match must end here: decoding a tail of tokens is enough, keeping the check O(1) per
        token instead of decoding the whole output each time. Every token is at least one byte and a character
        at most four, so 4 tokens per character of the longest stop string (plus slack) always cover it."""
        longest = max(len(s) for s in req.sampling.stop)
        tail = req.output_token_ids[-(4 * longest + 8) :]
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(s in text for s in req.sampling.stop)

    @staticmethod
    def _output(req: Request, tokens: list[int], logprobs: list[float]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generated_tokens=req.num_generated_tokens,
            error=req.error,
        )

    # ------------------------------------------------------------------ helpers
    def generate(self, requests: Iterable[Request]) -> list[Request]:
        """Run requests to completion (offline use); returns them in the given order."""
        reqs = list(requests)
        for r in reqs:
            self.add_request(r)
        while self.has_unfinished():
            self.step()
        return reqs

    def check_integrity(self) -> None:
        """free + used == total, and the used blocks are exactly those held by live requests."""
        self.allocator.check_integrity()
        held = [b for r in self.requests.values() for b in r.block_ids]
        if len(held) != len(set(held)):
            raise AssertionError("a KV block is held by two requests")
        if len(held) != self.allocator.num_used:
            raise AssertionError(
                f"{self.allocator.num_used} blocks used but {len(held)} held by live requests"
            )

    def worker_stats(self) -> dict[str, int | float]:
        free_mem, _ = self.device.mem_get_info()
        return {
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_used": self.allocator.num_used,
            "kv_blocks_free": self.allocator.num_free,
            "free_device_memory": free_mem,
            "queue_len": len(self.waiting),
            "running": len(self.running),
            "runtime_compilations": self.runner.runtime_compilations,
        }
