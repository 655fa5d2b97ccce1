"""The KV transfer's share of a prefill's time (``bucketserve bench kv``): one prompt's KV sent after its
prefill, or streamed layer by layer while the prefill runs, against the prefill alone."""

from __future__ import annotations

import statistics
import time

import torch

from bench.kv_endpoint import EndpointProcess
from kv_transfer import TransferConfig, create_transport


def time_prefill_share(
    num_tokens: int, repeats: int, cfg: TransferConfig, backend: str = "grpc"
) -> dict[str, float]:
    """Transfer time of one prompt's KV against its prefill time, through our engine (``small``
    model, CPU, eager) and a receiving endpoint in another process. Each round runs, in turn:

    - ``prefill``: ``prefill_only`` alone;
    - ``sequential``: prefill, then ``send`` of the KV; exposed = the send (end of prefill to ack);
    - ``streamed``: the transfer begins before the prefill and each layer is sent as the engine
      writes it (:class:`LayerStreamer`); exposed = end of prefill to ack. ``added`` = streamed
      start-to-ack minus the median prefill alone: it also counts any slowdown of the forward pass
      by the sending thread, which shares the host's cores.
    """
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.request import Request, SamplingParams
    from kv_transfer.streaming import LayerStreamer

    engine = LLMEngine(
        EngineConfig(
            model="small",
            device="cpu",
            skip_warmup=True,
            cache=CacheConfig(block_size=16, num_blocks=4 * (num_tokens // 16 + 1)),
            scheduler=SchedulerConfig(
                max_model_len=max(4096, num_tokens), max_num_batched_tokens=max(4096, num_tokens)
            ),
        )
    )
    spec = engine.kv_spec
    nb = spec.blocks_for_tokens(num_tokens) + 8
    endpoint = EndpointProcess("grpc", spec, nb, cfg)
    sender = create_transport(backend, engine.kv_cache, engine.allocator, cfg)
    gen = torch.Generator().manual_seed(0)
    n = 0

    def request() -> Request:
        nonlocal n
        n += 1
        prompt = torch.randint(10, 4000, (num_tokens,), generator=gen).tolist()
        return Request(f"prefill-{n}", prompt, SamplingParams(max_tokens=2))

    def received() -> None:
        if endpoint.receive(60, with_data=False) is None:
            raise RuntimeError("prefill share: transfer not received")

    def prefill_alone() -> float:
        req = request()
        t0 = time.perf_counter()
        engine.prefill_only([req])
        t = time.perf_counter() - t0
        engine.allocator.free(engine.detach(req.request_id).block_ids)
        return t

    def sequential() -> float:
        req = request()
        engine.prefill_only([req])
        done = engine.detach(req.request_id)
        t0 = time.perf_counter()
        sender.send(peer, done.request_id, done.block_ids, num_tokens, done.output_token_ids[0])
        t = time.perf_counter() - t0
        received()
        return t

    def streamed() -> tuple[float, float]:
        req = request()
        # Blocks first: the transfer's handshake needs them, and prefill_only grows only what is missing.
        req.block_ids = engine.allocator.allocate(spec.blocks_for_tokens(num_tokens))
        streamer = LayerStreamer(sender)
        t0 = time.perf_counter()
        streamer.begin(peer, req.request_id, req.block_ids, num_tokens)
        engine.prefill_only([req], on_layer_written=streamer.on_layer_written)
        t1 = time.perf_counter()
        engine.detach(req.request_id).block_ids = []  # the transport owns them
        result = streamer.finish()[req.request_id]
        t2 = time.perf_counter()
        if isinstance(result, Exception):
            raise result
        received()
        return t2 - t1, t2 - t0

    out: dict[str, list[float]] = {"prefill": [], "sequential": [], "streamed": [], "streamed_total": []}
    try:
        peer = endpoint.wait_ready()
        sequential()  # warm-up: connections, pages of both caches
        for _ in range(repeats):
            out["prefill"].append(prefill_alone())
            out["sequential"].append(sequential())
            exposed, total = streamed()
            out["streamed"].append(exposed)
            out["streamed_total"].append(total)
    finally:
        sender.close()
        endpoint.close()
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "prefill_s": med["prefill"],
        "sequential_transfer_s": med["sequential"],
        "streamed_exposed_s": med["streamed"],
        "streamed_total_s": med["streamed_total"],
        "share_overlapped": med["streamed"] / med["prefill"],
        "share_not_overlapped": med["sequential"] / med["prefill"],
        "share_added": (med["streamed_total"] - med["prefill"]) / med["prefill"],
        # Conservative bounds: the slowest transfer against the fastest prefill seen.
        "share_overlapped_max": max(out["streamed"]) / min(out["prefill"]),
        "share_not_overlapped_max": max(out["sequential"]) / min(out["prefill"]),
        "prefill_s_min": min(out["prefill"]),
        "prefill_s_max": max(out["prefill"]),
        "rounds": repeats,
    }
