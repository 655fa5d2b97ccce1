"""Runs the model on flat tokens: one step is a list of ``(request, new tokens)`` (decodes, whole prompts and
prefill chunks, in any mix) laid back to back as one row of ``T`` tokens, with no padding anywhere.

Each request computes ``all_token_ids[num_computed_tokens : num_computed_tokens + n]`` on top of its cached
context. The runner builds the flat inputs (token ids, positions, cache slots) and the per-sequence metadata
(block table, lengths, query offsets) once per step, sets the forward context that the attention operator reads
(:mod:`engine.flat_attention`), runs transformers' model class unchanged, and computes logits only for the
sequences whose last known token was in the step (a prefill chunk that leaves part of the prompt for later
samples nothing).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.decoder_stack import StackForward
from engine.device import Device
from engine.forward_context import AttendFn, ForwardContext, forward_context
from engine.kv_cache import KVCache
from engine.request import Request
from engine.sampler import greedy_tokens

logger = logging.getLogger(__name__)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# Whether torch.compile freezes the weights into the graph, per device. CPU: the linears become prepacked oneDNN
# ones. CUDA: no. Frozen, the compiler may concatenate linears that share an input into one GEMM, but on an H100
# (Llama-3-8B shapes, bf16) the decode step ran the same GEMM kernels in the same time either way, and the
# engine took twice as long to start.
FREEZE_WEIGHTS = {"cpu": True, "cuda": False}


def compile_flat_forward(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device_type: str, options: dict | None = None
):
    """``torch.compile`` for flat steps, with the inductor cache under ``$BUCKETSERVE_CACHE`` so a later start
    reuses the generated code; the weights frozen where ``FREEZE_WEIGHTS`` says, and the device's own inductor
    ``options`` (``Device.compile_options``). The other gain is the fused elementwise work (norms, rotary,
    activations) between the GEMMs."""
    import os

    from engine.model_builder import cache_root

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    options = {**(options or {}), **({"freezing": True} if FREEZE_WEIGHTS.get(device_type, False) else {})}
    return torch.compile(fn, dynamic=False, options=options)


# Above the skinny linear kernel's 64 rows, so both linear paths run once. The token budget's step took 2.7 s for
# `small` (2048 tokens, most of it attention over one 2048-token sequence) and twice that with two workers
# warming on two cores: most of a worker's start-up, for nothing an eager CPU step needs.
CPU_EAGER_WARMUP_TOKENS = 128

StepItem = tuple[Request, int]  # a request and how many of its tokens this step computes
GraphKey = tuple[int, int]  # (padded decode batch, padded block-table width)


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: ForwardContext
    # Rows of the [T] hidden states whose logits are sampled: the last token of each sequence that completes.
    logits_rows: torch.Tensor  # [S]
    sampled: list[Request]  # the S requests those rows belong to, in order


class FlatRunner:
    """The flat-token runner; the ``flat`` shape policy. Nothing is padded, so nothing is warmed per shape."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: Device,
        attend: AttendFn,
        max_tokens: int,
        compile_forward: bool = False,
        graph_batches: Sequence[int] = (),
        graph_widths: Sequence[int] = (),
        stack: StackForward | None = None,
    ) -> None:
        """``graph_batches`` x ``graph_widths``: the padded (decode batch, block-table width) shapes whose decode
        steps are captured as graphs at warm-up, where the device captures flat decode steps (CUDA). ``stack``:
        an eager forward over the decoder layers that stands in for the model's own (``engine.decoder_stack``);
        unused by a compiled forward."""
        self.model = model
        self._stack = None if compile_forward else stack
        self.kv = kv_cache
        self.device = device
        self.attend = attend
        self.write = device.kv_writer()  # the device's K/V writer, in every step's forward context
        # Parts of the greedy argmax over the vocabulary, in the decode graphs and after eager steps.
        self.greedy_splits = device.greedy_splits(model.lm_head.weight.shape[0])
        self.block_size = kv_cache.spec.block_size
        self.max_tokens = max_tokens  # the step's token budget: the largest T a forward pass sees
        self.warmed_up = False
        self._forward_hidden = self._eager_forward
        # A compiled graph specialises a dimension of size 1, so compiled steps have at least 2 tokens (a lone
        # decode gets one padding token, written to the null block and never sampled).
        self.min_tokens = 1
        self._compiled = None
        self._graphs_at_warmup = 0
        if compile_forward and device.name in ("cpu", "cuda"):
            self._compiled = compile_flat_forward(self._eager_forward, device.name, device.compile_options())
            self._forward_hidden = self._compiled_forward
            self.min_tokens = 2
        self._graph_shapes: list[GraphKey] = []
        if device.flat_decode_graphs:
            # A compiled forward takes at least min_tokens rows: smaller batches pad up to it.
            batches = sorted({max(b, self.min_tokens) for b in graph_batches})
            self._graph_shapes = sorted((b, w) for b in batches for w in graph_widths)
        self._graphs: dict[GraphKey, tuple[dict[str, torch.Tensor], Callable[[], torch.Tensor]]] = {}
        self._host_inputs: dict[GraphKey, list[torch.Tensor]] = {}  # per graph: two host buffers (pinned)

    @property
    def runtime_compilations(self) -> int:
        """Graphs compiled after warm-up: 0 eagerly (no shape to miss), and 0 compiled unless something the
        one dynamic graph was specialised on changed."""
        if self._compiled is None or not self.warmed_up:
            return 0
        return compiled_graphs() - self._graphs_at_warmup

    def _compiled_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The token count is the graph's one dynamic dimension, from 2 to the step budget.
        top = max(self.max_tokens, self.min_tokens + 1)
        torch._dynamo.mark_dynamic(input_ids, 0, min=self.min_tokens, max=top)
        torch._dynamo.mark_dynamic(positions, 0, min=self.min_tokens, max=top)
        return self._compiled(input_ids, positions)

    # ------------------------------------------------------------------ inputs
    def prepare(self, items: Sequence[StepItem], ahead: bool = False) -> FlatBatch:
        """The step's flat inputs. ``ahead``: each request computes one token past the ones it knows, whose id
        the caller puts into ``input_ids`` on the device (a step launched before the previous one's tokens
        reached the host); its id here is a placeholder."""
        bs = self.block_size
        extra = int(ahead)
        null = self.kv.null_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        rows: list[int] = []
        sampled: list[Request] = []
        width = max(-(-(r.num_computed_tokens + n) // bs) for r, n in items)
        table = []
        for r, n in items:
            c = r.num_computed_tokens
            known = r.num_tokens + extra
            if n < 1 or c + n > known:
                raise ValueError(f"{r.request_id}: cannot compute {n} tokens from {c} of {known}")
            blocks = r.block_ids
            ids += [0] * n if ahead else r.all_token_ids[c : c + n]
            positions += range(c, c + n)
            slots += [blocks[p // bs] * bs + p % bs for p in range(c, c + n)]
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            table.append(blocks[:width] + [null] * (width - min(width, len(blocks))))
            if c + n == known:
                rows.append(starts[-1] - 1)
                sampled.append(r)
        for _ in range(
            self.min_tokens - len(ids)
        ):  # padding tokens: in no sequence, written to the null block
            ids.append(0)
            positions.append(0)
            slots.append(null * bs)
        dev = self.kv.device
        ctx = ForwardContext(
            kv_data=self.kv.data,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            attend=self.attend,
            write=self.write,
        )
        return FlatBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            ctx=ctx,
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            sampled=sampled,
        )

    # ------------------------------------------------------------------ execution
    def _eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids/positions [T] -> hidden [T, hidden]
        if self._stack is not None:
            return self._stack(input_ids, positions)
        out = self.model.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def execute(self, batch: FlatBatch) -> torch.Tensor:
        """Run the step; returns fp32 logits [S, vocab] for the sequences in ``batch.sampled``."""
        with forward_context(batch.ctx):
            hidden = self._forward_hidden(batch.input_ids, batch.positions)  # [T, hidden]
        self.device.mark_step()
        return self.model.lm_head(hidden.index_select(0, batch.logits_rows)).float()  # [S, vocab]

    def run(
        self, items: Sequence[StepItem], on_layer_written: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[Request]]:
        if self._graphs and on_layer_written is None:
            key = self._graph_key(items)
            if key is not None:
                logits, _ = self._replay(key, items)
                return logits.float(), [r for r, _ in items]
        batch = self.prepare(items)
        batch.ctx.on_layer_written = on_layer_written
        return self.execute(batch), batch.sampled

    def prefill(
        self, reqs: Sequence[Request], on_layer_written: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Every request's remaining prompt in one step; logits of each request's last token."""
        logits, _ = self.run([(r, r.num_tokens - r.num_computed_tokens) for r in reqs], on_layer_written)
        return logits

    def decode(self, reqs: Sequence[Request]) -> torch.Tensor:
        logits, _ = self.run([(r, 1) for r in reqs])
        return logits

    def decode_greedy(self, reqs: Sequence[Request], token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step of ``reqs``; returns each one's greedy token [B], on the device: nothing here waits for
        it. With ``token_ids`` [B] (still on the device), a step queued behind the previous one without waiting
        for its tokens: request ``i`` computes position ``r.num_tokens`` (``r.num_computed_tokens`` already
        counts the previous step) with token ``token_ids[i]``."""
        ahead = token_ids is not None
        items = [(r, 1) for r in reqs]
        if self._graphs:
            key = self._graph_key(items, ahead=ahead)
            if key is not None:
                return self._replay(key, items, token_ids)[1]
        # Inputs made outside inference mode, as run()'s are (token_ids, made under it, goes into a normal tensor
        # here): a compiled forward guards on the difference and would compile again on the first step ahead.
        batch = self.prepare(items, ahead=ahead)
        if ahead:
            b = len(reqs)
            batch.input_ids = torch.cat((token_ids, batch.input_ids[b:]))  # padding rows keep their ids
        return greedy_tokens(self.execute(batch), self.greedy_splits)  # [B]

    # ------------------------------------------------------------------ decode graphs
    def _graph_key(self, items: Sequence[StepItem], ahead: bool = False) -> GraphKey | None:
        """The smallest captured shape that holds this step, if it is decodes only (each request computes its
        last token, or with ``ahead`` the one after it); None runs it eagerly."""
        width = 0
        extra = int(ahead)
        for r, n in items:
            if n != 1 or r.num_computed_tokens + 1 != r.num_tokens + extra:
                return None
            width = max(width, -(-(r.num_tokens + extra) // self.block_size))
        b = len(items)
        return next(((gb, gw) for gb, gw in self._graphs if gb >= b and gw >= width), None)

    def _graph_inputs(self, items: Sequence[StepItem], key: GraphKey) -> torch.Tensor:
        """A decode step's inputs as one int64 row in a host buffer of its own, for one host-to-device copy:
        token ids, positions, cache slots and sequence lengths ``[Bp]`` each, then the block table
        ``[Bp, Wp]``. Padding rows are one-token sequences in the null block. Table entries past a sequence's
        last block keep whatever ids they held (every id is a real block, and the operator reads only the blocks
        under ``seq_len``), so only the used entries are written: numpy row copies, a few microseconds each.

        Two buffers per shape, used in turn: the copy to the device does not wait (it is queued behind the step
        before, which may still run), and a buffer is written again only after the step that read it was waited
        for. A request computing past its known tokens (a step launched ahead) gets id 0, replaced on the
        device."""
        bp, wp = key
        bs, null = self.block_size, self.kv.null_block
        pair = self._host_inputs.get(key)
        if pair is None:
            pinned = self.kv.device.type == "cuda"
            pair = [
                torch.full((4 * bp + bp * wp,), null, dtype=torch.long, pin_memory=pinned) for _ in range(2)
            ]
            self._host_inputs[key] = pair
        pair.reverse()
        host = pair[0]
        flat = host.numpy()
        table = flat[4 * bp :].reshape(bp, wp)
        pad = bp - len(items)
        ids, positions, slots, lens = [], [], [], []
        for i, (r, _) in enumerate(items):
            c = r.num_computed_tokens
            n = c // bs + 1  # blocks holding positions 0..c
            ids.append(r.all_token_ids[c] if c < r.num_tokens else 0)
            positions.append(c)
            slots.append(r.block_ids[c // bs] * bs + c % bs)
            lens.append(c + 1)
            table[i, :n] = r.block_ids[:n]
        flat[: 4 * bp] = (
            ids + [0] * pad + positions + [0] * pad + slots + [null * bs] * pad + lens + [1] * pad
        )
        table[len(items) :, 0] = null
        return host

    def _graph_body(
        self, key: GraphKey, packed: torch.Tensor, query_start_loc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # packed [4 * Bp + Bp * Wp] int64 (see _graph_inputs); query_start_loc [Bp + 1] int32, constant
        bp, wp = key
        ctx = ForwardContext(
            kv_data=self.kv.data,
            slot_mapping=packed[2 * bp : 3 * bp],
            block_table=packed[4 * bp :].view(bp, wp).to(torch.int32),
            seq_lens=packed[3 * bp : 4 * bp].to(torch.int32),
            query_start_loc=query_start_loc,
            attend=self.attend,
            write=self.write,
        )
        with forward_context(ctx):
            hidden = self._forward_hidden(packed[:bp], packed[bp : 2 * bp])  # [Bp, hidden]
        # Logits in the model's dtype (widened only where a sampler reads them) and the greedy tokens: a greedy
        # step launched ahead reads only these ids.
        logits = self.model.lm_head(hidden)  # [Bp, vocab]
        return logits, greedy_tokens(logits, self.greedy_splits)  # [Bp]

    @torch.inference_mode()
    def _replay(
        self, key: GraphKey, items: Sequence[StepItem], token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, vocab] in the model's dtype and greedy tokens [B] of a captured decode step."""
        static, replay = self._graphs[key]
        static["packed"].copy_(self._graph_inputs(items, key), non_blocking=True)
        if token_ids is not None:  # [B] ids of a step launched ahead, from the step before, on the device
            static["packed"][: len(items)].copy_(token_ids)
        logits, greedy = replay()
        b = len(items)
        return logits[:b], greedy[:b]

    @torch.inference_mode()
    def _capture_decode_graphs(self, budget: int | None) -> int:
        # Smallest first: small batches are the latency-critical ones, so they get graphs first.
        start_free = self.device.mem_get_info()[0]
        dev = self.kv.device
        for key in self._graph_shapes:
            if budget is not None and start_free - self.device.mem_get_info()[0] > budget:
                logger.info("graph memory budget reached; larger decode steps run eagerly")
                break
            # Normal tensors, as the eager steps' inputs are: a compiled forward guards on the difference.
            with torch.inference_mode(False):
                static = {
                    "packed": self._graph_inputs([], key).to(dev, copy=True),
                    "query_start_loc": torch.arange(key[0] + 1, dtype=torch.int32, device=dev),
                }
            replay = self.device.capture_graph(functools.partial(self._graph_body, key), static)
            if replay is None:
                break
            self._graphs[key] = (static, replay)
        return len(self._graphs)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, graph_memory_budget: int | None = None) -> dict[str, float]:
        """One forward of the largest step (the token budget as one sequence, every slot and block the null
        block): the compiled graph is built, and on an accelerator activation memory is first reserved and the
        libraries set up, before the first request, not in it. On the CPU without a compiled graph there is
        nothing to build per size and host memory needs no reserving, so a short step sets the kernels up."""
        t0 = time.perf_counter()
        t = self.max_tokens
        if self._compiled is None and self.device.name == "cpu":
            t = min(t, CPU_EAGER_WARMUP_TOKENS)
        null = self.kv.null_block
        dev = self.kv.device
        ctx = ForwardContext(
            kv_data=self.kv.data,
            slot_mapping=torch.full((t,), null * self.block_size, dtype=torch.long, device=dev),
            block_table=torch.full((1, -(-t // self.block_size)), null, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            attend=self.attend,
            write=self.write,
        )
        batch = FlatBatch(
            input_ids=torch.zeros(t, dtype=torch.long, device=dev),
            positions=torch.arange(t, dtype=torch.long, device=dev),
            ctx=ctx,
            logits_rows=torch.tensor([t - 1], dtype=torch.long, device=dev),
            sampled=[],
        )
        self.execute(batch)
        self.device.synchronize()
        captured = self._capture_decode_graphs(graph_memory_budget) if self._graph_shapes else 0
        self.device.synchronize()
        if self._compiled is not None:  # the graphs above may compile too (their inputs are views)
            self._graphs_at_warmup = compiled_graphs()
        self.warmed_up = True
        took = time.perf_counter() - t0
        logger.info(
            "warm-up done (flat tokens): one step of %d tokens, %d decode graphs captured, %.1f s",
            t,
            captured,
            took,
        )
        return {"seconds": took, "buckets": 0, "graphs": captured}
