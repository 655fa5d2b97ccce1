"""Runs the model on padded, bucketed batches: prompt ``(batch, query_len, ctx_blocks)`` and decode
``(batch, 1, num_blocks)``. Owns warm-up, graph capture and the runtime-compilation counter.

Padding rules: padded rows and padded tokens write their K/V into the cache's null block and read
only from it; their outputs are dropped before sampling, so padding never reaches a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm import tqdm

from engine.attention import _MASKED, AttentionMetadata
from engine.device import Device
from engine.kv_cache import KVCache
from engine.request import Request

logger = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # (batch, query_len, blocks)


class BucketFinder(Protocol):
    prompt: Sequence[Shape]
    decode: Sequence[Shape]

    def find_prompt(self, batch_size: int, query_len: int, ctx_blocks: int) -> Shape | None: ...

    def find_decode(self, batch_size: int, num_blocks: int) -> Shape | None: ...


@dataclass
class BatchInputs:
    """One padded batch ready for the model. B/Q/NB are the bucket's padded sizes."""

    shape: Shape
    is_prompt: bool
    input_ids: torch.Tensor  # [B, Q]
    positions: torch.Tensor  # [B, Q]
    meta: AttentionMetadata
    # Flat indices into the [B * Q] token rows of the tokens whose logits we need, one per real request.
    logits_rows: torch.Tensor  # [num_real]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: Device,
        buckets: BucketFinder | None,
        max_model_len: int,
        use_graphs: bool = True,
        compile_cpu: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.device = device
        self.buckets = buckets
        self.block_size = kv_cache.spec.block_size
        self.max_model_len = max_model_len
        self.null_slot = kv_cache.null_block * self.block_size
        self.warmed_shapes: set[tuple[bool, Shape]] = set()
        self.runtime_shapes: set[tuple[bool, Shape]] = set()
        self.warmed_up = False
        self._graphs: dict[Shape, tuple[dict[str, torch.Tensor], object]] = {}
        self._use_graphs = use_graphs and device.supports_graphs
        self._forward_hidden = self._eager_forward
        if compile_cpu and device.name == "cpu":
            # dynamic=False: one specialised graph per bucket shape, compiled during warm-up.
            self._forward_hidden = torch.compile(self._eager_forward, dynamic=False)

    # ------------------------------------------------------------------ counters
    @property
    def runtime_compilations(self) -> int:
        """Distinct batch shapes first seen while serving (each would compile a new graph)."""
        return len(self.runtime_shapes)

    def _note_shape(self, is_prompt: bool, shape: Shape, padded: bool) -> None:
        key = (is_prompt, shape)
        if not self.warmed_up or key in self.warmed_shapes or key in self.runtime_shapes:
            return
        self.runtime_shapes.add(key)
        kind = "prompt" if is_prompt else "decode"
        reason = "above every warmed bucket" if not padded else "not warmed"
        logger.warning(
            "runtime compilation #%d: %s shape %s is %s (batch runs unpadded)",
            len(self.runtime_shapes),
            kind,
            shape,
            reason,
        )

    # ------------------------------------------------------------------ inputs
    def _slot(self, req: Request, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare_prompt(self, reqs: Sequence[Request]) -> BatchInputs:
        """Each request computes ``all_token_ids[num_computed_tokens:]`` on top of its cached context."""
        bs = self.block_size
        chunks = [r.all_token_ids[r.num_computed_tokens :] for r in reqs]
        ctx_lens = [r.num_computed_tokens for r in reqs]
        real = (len(reqs), max(len(c) for c in chunks), max(-(-c // bs) for c in ctx_lens))
        shape = self.buckets.find_prompt(*real) if self.buckets else None
        padded = shape is not None
        shape = shape or real
        self._note_shape(True, shape, padded)
        b, q, c = shape
        ids = [[0] * q for _ in range(b)]
        pos = [[0] * q for _ in range(b)]
        slots = [self.null_slot] * (b * q)
        rows = []
        for i, (r, chunk, ctx) in enumerate(zip(reqs, chunks, ctx_lens, strict=True)):
            ids[i][: len(chunk)] = chunk
            pos[i][: len(chunk)] = range(ctx, ctx + len(chunk))
            slots[i * q : i * q + len(chunk)] = [self._slot(r, p) for p in range(ctx, ctx + len(chunk))]
            rows.append(i * q + len(chunk) - 1)
        table = bias = None
        if c > 0:
            null = self.kv.null_block
            table_rows = [(r.block_ids[:c] + [null] * c)[:c] for r in reqs] + [[null] * c] * (b - len(reqs))
            table = torch.tensor(table_rows, dtype=torch.long)  # [B, C]
            ctx_valid = torch.tensor(ctx_lens + [0] * (b - len(reqs)))  # [B]
            kpos = torch.arange(c * bs)  # [C * S]
            ctx_mask = kpos[None, :] < ctx_valid[:, None]  # [B, C * S]
            causal = torch.ones(q, q, dtype=torch.bool).tril()  # [Q, Q]
            allowed = torch.cat([ctx_mask[:, None, :].expand(b, q, c * bs), causal.expand(b, q, q)], dim=-1)
            bias = torch.zeros(b, 1, q, c * bs + q, dtype=self.kv.data.dtype)
            bias.masked_fill_(~allowed[:, None], _MASKED)
        dev = self.kv.device
        meta = AttentionMetadata(
            is_prompt=True,
            kv_data=self.kv.data,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            ctx_block_table=None if table is None else table.to(dev),
            ctx_bias=None if bias is None else bias.to(dev),
        )
        return BatchInputs(
            shape=shape,
            is_prompt=True,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            meta=meta,
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        )

    def prepare_decode(self, reqs: Sequence[Request]) -> BatchInputs:
        """Each request feeds its last token at position ``num_tokens - 1``; its blocks must cover it."""
        bs = self.block_size
        block_list: list[int] = []
        groups: list[int] = []
        valid: list[int] = []
        positions = []
        for i, r in enumerate(reqs):
            p = r.num_tokens - 1
            n = p // bs + 1
            positions.append(p)
            block_list += r.block_ids[:n]
            groups += [i] * n
            valid += [bs] * (n - 1) + [p - (n - 1) * bs + 1]
        real = (len(reqs), 1, len(block_list))
        shape = self.buckets.find_decode(len(reqs), len(block_list)) if self.buckets else None
        padded = shape is not None
        shape = shape or real
        self._note_shape(False, shape, padded)
        b, _, nb = shape
        pad_blocks = nb - len(block_list)
        return self._decode_inputs(
            shape,
            ids=[r.last_token_id for r in reqs] + [0] * (b - len(reqs)),
            positions=positions + [0] * (b - len(reqs)),
            slots=[self._slot(r, p) for r, p in zip(reqs, positions, strict=True)]
            + [self.null_slot] * (b - len(reqs)),
            block_list=block_list + [self.kv.null_block] * pad_blocks,
            groups=groups + [b] * pad_blocks,
            valid=valid + [0] * pad_blocks,
            num_real=len(reqs),
        )

    def _decode_inputs(
        self, shape, ids, positions, slots, block_list, groups, valid, num_real
    ) -> BatchInputs:
        dev = self.kv.device
        b, _, nb = shape
        valid_t = torch.tensor(valid, dtype=torch.long)  # [NB]
        bias = torch.zeros(nb, 1, 1, self.block_size, dtype=self.kv.data.dtype)
        bias.masked_fill_(
            (torch.arange(self.block_size)[None, :] >= valid_t[:, None])[:, None, None, :], _MASKED
        )
        meta = AttentionMetadata(
            is_prompt=False,
            kv_data=self.kv.data,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_list=torch.tensor(block_list, dtype=torch.long, device=dev),
            block_groups=torch.tensor(groups, dtype=torch.long, device=dev),
            block_bias=bias.to(dev),
        )
        return BatchInputs(
            shape=shape,
            is_prompt=False,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev).view(b, 1),
            positions=torch.tensor(positions, dtype=torch.long, device=dev).view(b, 1),
            meta=meta,
            logits_rows=torch.arange(num_real, device=dev),
        )

    # ------------------------------------------------------------------ execution
    def _eager_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = self.model.model(input_ids=input_ids, position_ids=positions, attn_meta=meta, use_cache=False)
        return out.last_hidden_state  # [B, Q, hidden]

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Run the batch; returns fp32 logits [num_real, vocab] for each real request's last token."""
        graph = None if batch.is_prompt else self._graphs.get(batch.shape)
        if graph is not None:
            hidden = self._replay(graph, batch)
        else:
            hidden = self._forward_hidden(batch.input_ids, batch.positions, batch.meta)
        self.device.mark_step()
        flat = hidden.reshape(-1, hidden.shape[-1])  # [B * Q, hidden]
        logits = self.model.lm_head(flat.index_select(0, batch.logits_rows))  # [num_real, vocab]
        return logits.float()

    def prefill(
        self, reqs: Sequence[Request], on_layer_written: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        batch = self.prepare_prompt(reqs)
        batch.meta.on_layer_written = on_layer_written
        return self.execute(batch)

    def decode(self, reqs: Sequence[Request]) -> torch.Tensor:
        return self.execute(self.prepare_decode(reqs))

    # ------------------------------------------------------------------ graphs
    def _graph_inputs(self, batch: BatchInputs) -> dict[str, torch.Tensor]:
        m = batch.meta
        return {
            "input_ids": batch.input_ids,
            "positions": batch.positions,
            "slot_mapping": m.slot_mapping,
            "block_list": m.block_list,
            "block_groups": m.block_groups,
            "block_bias": m.block_bias,
        }

    def _graph_body(
        self, input_ids, positions, slot_mapping, block_list, block_groups, block_bias
    ) -> torch.Tensor:
        meta = AttentionMetadata(
            is_prompt=False,
            kv_data=self.kv.data,
            slot_mapping=slot_mapping,
            block_list=block_list,
            block_groups=block_groups,
            block_bias=block_bias,
        )
        return self._eager_forward(input_ids, positions, meta)

    def _replay(self, graph, batch: BatchInputs) -> torch.Tensor:
        static, replay = graph
        for name, t in self._graph_inputs(batch).items():
            static[name].copy_(t)
        return replay()

    # ------------------------------------------------------------------ warm-up
    def _dummy_prompt(self, shape: Shape) -> BatchInputs:
        b, q, c = shape
        dev = self.kv.device
        null = self.kv.null_block
        meta = AttentionMetadata(
            is_prompt=True,
            kv_data=self.kv.data,
            slot_mapping=torch.full((b * q,), self.null_slot, dtype=torch.long, device=dev),
            ctx_block_table=torch.full((b, c), null, dtype=torch.long, device=dev) if c else None,
            ctx_bias=torch.zeros(b, 1, q, c * self.block_size + q, dtype=self.kv.data.dtype, device=dev)
            if c
            else None,
        )
        zeros = torch.zeros(b, q, dtype=torch.long, device=dev)
        return BatchInputs(shape, True, zeros, zeros, meta, torch.arange(b, device=dev) * q + q - 1)

    def _dummy_decode(self, shape: Shape) -> BatchInputs:
        b, _, nb = shape
        return self._decode_inputs(
            shape,
            ids=[0] * b,
            positions=[0] * b,
            slots=[self.null_slot] * b,
            block_list=[self.kv.null_block] * nb,
            groups=[i % b for i in range(nb)],
            valid=[1] * nb,
            num_real=b,
        )

    def warmup(self, graph_memory_budget: int | None = None) -> dict[str, float]:
        """Run every bucket once, largest first; capture decode graphs where the device has them."""
        if self.buckets is None:
            raise RuntimeError("warm-up needs shape buckets")
        t0 = time.perf_counter()
        plan = [(True, s) for s in sorted(self.buckets.prompt, reverse=True)]
        plan += [(False, s) for s in sorted(self.buckets.decode, reverse=True)]
        n_prompt = len(self.buckets.prompt)
        for i, (is_prompt, shape) in enumerate(tqdm(plan, desc="warm-up", unit="bucket", leave=False)):
            batch = self._dummy_prompt(shape) if is_prompt else self._dummy_decode(shape)
            self.execute(batch)
            self.warmed_shapes.add((is_prompt, shape))
            kind, idx, n = (
                ("Prompt", i + 1, n_prompt)
                if is_prompt
                else ("Decode", i + 1 - n_prompt, len(plan) - n_prompt)
            )
            free = self.device.mem_get_info()[0]
            logger.info(
                "[Warmup][%s][%d/%d] batch_size:%d query_len:%d num_blocks:%d free_mem:%.2f GiB",
                kind,
                idx,
                n,
                shape[0],
                shape[1],
                shape[2],
                free / 2**30,
            )
        self.device.synchronize()
        captured = 0
        if self._use_graphs:
            captured = self._capture_decode_graphs(graph_memory_budget)
        self.warmed_up = True
        took = time.perf_counter() - t0
        logger.info(
            "warm-up done: %d prompt + %d decode buckets, %d graphs captured, %.1f s",
            n_prompt,
            len(plan) - n_prompt,
            captured,
            took,
        )
        return {"seconds": took, "buckets": len(plan), "graphs": captured}

    @torch.inference_mode()
    def _capture_decode_graphs(self, budget: int | None) -> int:
        # Smallest first: small batches are the latency-critical ones, so they get graphs first.
        start_free = self.device.mem_get_info()[0]
        for shape in sorted(self.buckets.decode):
            if budget is not None and start_free - self.device.mem_get_info()[0] > budget:
                logger.info("graph memory budget reached; larger decode buckets run eagerly")
                break
            static = {k: v.clone() for k, v in self._graph_inputs(self._dummy_decode(shape)).items()}
            replay = self.device.capture_graph(self._graph_body, static)
            if replay is None:
                return 0
            self._graphs[shape] = (static, replay)
        return len(self._graphs)
