"""Static batching behind the gateway: the Hugging Face ``generate`` baseline of ``bucketserve bench sweep``.

The way LLMs were served before continuous batching: a thread collects up to ``batch_size`` requests, or
whatever arrived within ``max_wait_ms`` of the first one, left-pads them into one batch and runs Hugging Face
``generate`` (greedy) for the longest ``max_tokens`` of the batch. Nothing joins a running batch, and every
request waits for the whole batch to finish; its tokens come back in one output at the end. Those are the
costs the benchmarks measure against, so they are kept on purpose.

Per request the output is what ``generate`` gives for that prompt alone: tokens are cut at the request's own
``max_tokens``, at ``max_model_len``, and after the first EOS or stop token (unless ``ignore_eos``), the way
the engine does. Only greedy decoding is offered (a batch shares one ``generate`` call).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.request import FinishReason, Request, RequestOutput
from gateway.backend import ModelInfo, Overloaded, Rejected, ServingBackend, Unavailable

logger = logging.getLogger(__name__)

WORKER_ID = "static-0"


@dataclass
class _Pending:
    req: Request
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    arrived: float = field(default_factory=time.monotonic)


class StaticBatchBackend(ServingBackend):
    """``model``: a built-in model name or a checkpoint folder. ``max_queued``: requests waiting beyond the
    running batch before new ones get 429."""

    def __init__(
        self,
        model: str,
        *,
        batch_size: int = 8,
        max_wait_ms: float = 50.0,
        max_model_len: int | None = None,
        model_name: str | None = None,
        max_queued: int = 256,
        dtype: str = "float32",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from engine.kv_cache import torch_dtype
        from engine.model_loader import load_tokenizer, resolve_model_path

        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self._torch = torch
        path = resolve_model_path(model)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).eval()
        self.model.requires_grad_(False)
        tokenizer = load_tokenizer(str(path))
        config = self.model.config
        eos = config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        limit = int(getattr(config, "max_position_embeddings", 2048))
        self._info = ModelInfo(
            name=model_name or model,
            path=str(path),
            max_model_len=min(max_model_len or limit, limit),
            eos_token_ids=tuple(sorted(eos_ids)),
        )
        pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
        # Padding sits under a zero attention mask, so any id works when the model names none.
        self._pad_id = int(pad) if pad is not None else (min(eos_ids) if eos_ids else 0)
        # An id outside the vocabulary: ``generate`` never stops early on it (for batches with ignore_eos).
        self._no_eos = int(config.vocab_size)
        self.batch_size = batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_inflight = batch_size + max_queued
        self._cv = threading.Condition()
        self._queue: list[_Pending] = []
        self._aborted: set[str] = set()
        self._inflight: set[str] = set()
        self._stopping = False
        self.batches = 0
        self.batch_sizes: list[int] = []
        self._thread = threading.Thread(target=self._run, name="static-batcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ ServingBackend

    def model_info(self) -> ModelInfo:
        return self._info

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        if self._stopping or not self._thread.is_alive():
            raise Unavailable("the static batcher is not running")
        self._validate(req)
        if req.request_id in self._inflight:
            raise Rejected(f"duplicate request id {req.request_id!r}")
        if len(self._inflight) >= self.max_inflight:
            raise Overloaded(
                f"admission queue full: {len(self._inflight)} requests in flight (limit {self.max_inflight})"
            )
        loop = asyncio.get_running_loop()
        pending = _Pending(req, loop, loop.create_future())
        self._inflight.add(req.request_id)
        with self._cv:
            self._queue.append(pending)
            self._cv.notify()
        finished = False
        try:
            out = await pending.future
            finished = True
            yield out
        finally:
            self._inflight.discard(req.request_id)
            if not finished:
                self._drop(req.request_id)

    async def abort(self, request_id: str) -> None:
        self._drop(request_id)

    async def health(self) -> dict:
        up = self._thread.is_alive() and not self._stopping
        return {
            "ready": up,
            "workers": [{"id": WORKER_ID, "role": "static", "up": up, "warmed": True}],
            "batches": self.batches,
        }

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    # ------------------------------------------------------------------ local API

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            left, self._queue = self._queue, []
            self._cv.notify()
        self._thread.join(timeout=60)
        for p in left:
            _settle(p, Unavailable("the server was shut down"))

    def _validate(self, req: Request) -> None:
        sp = req.sampling
        if not sp.greedy:
            raise Rejected("the static batching baseline serves greedy requests only: send temperature 0")
        limit = self._info.max_model_len
        if req.num_prompt_tokens >= limit:
            raise Rejected(
                f"prompt has {req.num_prompt_tokens} tokens; max_model_len is {limit} (prompt + output must fit)"
            )

    def _drop(self, request_id: str) -> None:
        with self._cv:
            before = len(self._queue)
            self._queue = [p for p in self._queue if p.req.request_id != request_id]
            if len(self._queue) == before:
                # Running (its result is thrown away) or already done: nothing else to free.
                self._aborted.add(request_id)

    # ------------------------------------------------------------------ batching thread

    def _take_batch(self) -> list[_Pending] | None:
        """Wait for a first request, then for the batch to fill or the wait to run out; None when stopping."""
        with self._cv:
            while not self._queue and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            deadline = self._queue[0].arrived + self.max_wait_s
            while len(self._queue) < self.batch_size and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(timeout=left)
            if self._stopping:
                return None
            batch, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
            self._aborted.difference_update(p.req.request_id for p in batch)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                break
            try:
                results = self.run_batch([p.req for p in batch])
            except Exception as e:  # a failed batch must not leave its clients waiting
                logger.exception("static batch of %d failed", len(batch))
                for p in batch:
                    _settle(p, RuntimeError(f"generate failed: {type(e).__name__}: {e}"))
                continue
            self.batches += 1
            self.batch_sizes.append(len(batch))
            with self._cv:
                aborted = set(self._aborted)
                self._aborted.clear()
            for p, out in zip(batch, results, strict=True):
                if p.req.request_id not in aborted:
                    _settle(p, out)
        logger.info("static batcher stopped")

    def run_batch(self, reqs: list[Request]) -> list[RequestOutput]:
        """One ``generate`` call over the batch, left-padded; one finished output per request."""
        torch = self._torch
        longest = max(r.num_prompt_tokens for r in reqs)
        limit = self._info.max_model_len
        budgets = [min(r.sampling.max_tokens, limit - r.num_prompt_tokens) for r in reqs]
        ids = torch.full((len(reqs), longest), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), longest), dtype=torch.long)
        for i, r in enumerate(reqs):
            n = r.num_prompt_tokens
            ids[i, longest - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, longest - n :] = 1
        # Early stop on EOS only when every request of the batch stops on it; per-request cuts follow.
        stop_on_eos = not any(r.sampling.ignore_eos for r in reqs)
        eos = list(self._info.eos_token_ids) if stop_on_eos and self._info.eos_token_ids else [self._no_eos]
        want_logprobs = any(r.sampling.logprobs for r in reqs)
        with torch.inference_mode():
            gen = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(budgets),
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=self._pad_id,
                return_dict_in_generate=True,
                output_scores=want_logprobs,
            )
        new = gen.sequences[:, longest:].tolist()
        outs = []
        for i, (r, budget) in enumerate(zip(reqs, budgets, strict=True)):
            tokens, reason = self._cut(r, new[i][:budget])
            logprobs: list[float] = []
            if r.sampling.logprobs and gen.scores is not None:
                logprobs = [
                    float(torch.log_softmax(gen.scores[j][i].float(), dim=-1)[t])
                    for j, t in enumerate(tokens)
                ]
            outs.append(
                RequestOutput(
                    request_id=r.request_id,
                    new_token_ids=tokens,
                    new_logprobs=logprobs,
                    finished=True,
                    finish_reason=reason,
                    num_prompt_tokens=r.num_prompt_tokens,
                    num_generated_tokens=len(tokens),
                )
            )
        return outs

    def _cut(self, req: Request, tokens: list[int]) -> tuple[list[int], FinishReason]:
        """The request's own tokens: up to and including its first stop token, as the engine ends it."""
        sp = req.sampling
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self._info.eos_token_ids))
        if not sp.ignore_eos:
            for k, t in enumerate(tokens):
                if t in stops:
                    return tokens[: k + 1], FinishReason.STOP
        return tokens, FinishReason.LENGTH


def _settle(p: _Pending, result: Any) -> None:
    def put() -> None:
        if p.future.done():
            return
        if isinstance(result, BaseException):
            p.future.set_exception(result)
        else:
            p.future.set_result(result)

    # A closed loop's request is gone with it: nothing to deliver.
    with contextlib.suppress(RuntimeError):
        p.loop.call_soon_threadsafe(put)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.baselines.static_batching",
        description="Hugging Face generate in static batches behind the OpenAI-compatible gateway (a baseline)",
    )
    p.add_argument("--model", default="default", help="built-in model name or checkpoint folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    p.add_argument("--batch-size", type=int, default=8, help="requests per batch")
    p.add_argument("--max-wait-ms", type=float, default=50.0, help="wait for a batch to fill")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (as one of our workers)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1/*")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument(
        "--max-pending", type=int, default=256, help="requests waiting beyond the batch before 429"
    )
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """This backend behind the gateway on uvicorn, until Ctrl-C."""
    import torch
    import uvicorn

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # As many threads as each of our workers gets: more threads than free cores slows generate several-fold.
    torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    backend = StaticBatchBackend(
        args.model,
        batch_size=args.batch_size,
        max_wait_ms=args.max_wait_ms,
        max_model_len=args.max_model_len,
        model_name=args.served_model_name,
        max_queued=args.max_pending,
        dtype=args.dtype,
    )
    app = create_app(backend, GatewaySettings(api_key=args.api_key))
    base = f"http://{args.host}:{args.port}"
    print(
        f"BucketServe (static batching, batch {args.batch_size}, wait {args.max_wait_ms} ms, "
        f"{args.num_threads} thread(s)) "
        f"ready in {time.perf_counter() - t0:.1f}s, model {backend.model_info().name!r}",
        flush=True,
    )
    print(f"  OpenAI API  {base}/v1  (completions, chat/completions, models)", flush=True)
    print(f"  health      {base}/health", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
