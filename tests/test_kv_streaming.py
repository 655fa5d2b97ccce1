"""Layer streaming from the engine's prefill: the KV of layer i leaves while later layers compute,
arrives intact in another process, and every failure path frees the blocks on both sides."""

from __future__ import annotations

import time

import pytest
import torch
from engine_helpers import random_prompts, small_config

from bench.kv_endpoint import EndpointProcess, gather_tokens
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams
from kv_transfer import KVTransferError, TransferConfig, TransferStatus, create_transport
from kv_transfer.streaming import FIRST_TOKEN_PENDING, LayerStreamer

# 2 KiB block layers on the tiny model: a 60-token prompt is several chunks per layer.
CFG = TransferConfig(chunk_bytes=4096, max_message_bytes=1 << 20, rpc_timeout_s=20, same_node_fast_path=False)
RECEIVER_BLOCKS = 32


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(small_config())


@pytest.fixture(scope="module")
def endpoint(engine: LLMEngine):
    ep = EndpointProcess("grpc", engine.kv_spec, RECEIVER_BLOCKS, CFG)
    ep.wait_ready()
    yield ep
    ep.close()


@pytest.fixture
def sender(engine: LLMEngine):
    tx = create_transport("grpc", engine.kv_cache, engine.allocator, CFG)
    yield tx
    tx.close()


def _request(engine: LLMEngine, rid: str, n: int, seed: int) -> Request:
    req = Request(rid, random_prompts([n], seed=seed)[0], SamplingParams(max_tokens=4))
    # Blocks before the prefill: the handshake leases them; prefill_only grows only what is missing.
    req.block_ids = engine.allocator.allocate(engine.kv_spec.blocks_for_tokens(n))
    return req


def _assert_no_leaks(engine: LLMEngine, endpoint: EndpointProcess, sender) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        rx = endpoint.stats()
        if engine.allocator.num_used == 0 and rx["used_blocks"] == 0 and rx["in_flight"] == 0:
            break
        time.sleep(0.05)
    engine.check_integrity()
    assert engine.allocator.num_used == 0, "sender leaks blocks"
    assert rx["used_blocks"] == 0 and rx["in_flight"] == 0, f"receiver holds blocks: {rx}"
    assert len(sender.leases) == 0


def test_layers_leave_during_prefill_and_arrive_intact(engine, endpoint, sender) -> None:
    n = 60
    req = _request(engine, "stream", n, seed=1)
    streamer = LayerStreamer(sender)
    assert streamer.begin(endpoint.address, req.request_id, req.block_ids, n)
    last = engine.kv_spec.num_layers - 1
    sent_before_last: list[set[int]] = []

    def hook(layer: int) -> None:
        streamer.on_layer_written(layer)
        if layer == last:
            # Still inside the forward pass: the earlier layers must already be on their way.
            deadline = time.monotonic() + 10
            while sender.sent_layers("stream") < set(range(last)) and time.monotonic() < deadline:
                time.sleep(0.005)
            sent_before_last.append(sender.sent_layers("stream"))

    outs = engine.prefill_only([req], on_layer_written=hook)
    want = gather_tokens(engine.kv_cache, req.block_ids, n).clone()  # [L, 2, n, KVH, D]
    engine.detach("stream")  # the transport owns the blocks now
    results = streamer.finish()

    assert sent_before_last and sent_before_last[0] >= set(range(last))
    m = results["stream"]
    assert not isinstance(m, Exception) and m.status == "ok" and m.attempts == 1
    got = endpoint.receive(10)
    assert got["request_id"] == "stream" and got["num_tokens"] == n
    # The first token is sampled after the last layer: the announcement carries it, not the handshake.
    assert got["first_token"] == FIRST_TOKEN_PENDING and outs[0].new_token_ids
    assert torch.equal(got["data"], want)
    _assert_no_leaks(engine, endpoint, sender)


def test_without_the_hook_finish_sends_every_layer(engine, endpoint, sender) -> None:
    req = _request(engine, "nohook", 33, seed=2)
    streamer = LayerStreamer(sender)
    streamer.begin(endpoint.address, req.request_id, req.block_ids, 33, first_token=7)
    engine.prefill_only([req])
    want = gather_tokens(engine.kv_cache, req.block_ids, 33).clone()
    engine.detach("nohook")
    assert streamer.finish()["nohook"].status == "ok"
    got = endpoint.receive(10)
    assert got["first_token"] == 7 and torch.equal(got["data"], want)
    _assert_no_leaks(engine, endpoint, sender)


def test_abort_while_streaming_frees_both_sides(engine, endpoint, sender) -> None:
    req = _request(engine, "abort", 60, seed=3)
    streamer = LayerStreamer(sender)
    streamer.begin(endpoint.address, req.request_id, req.block_ids, 60)
    streamer.on_layer_written(0)
    streamer.on_layer_written(1)
    results = streamer.abort("prefill failed")
    assert streamer.finish() == {}
    assert isinstance(results["abort"], KVTransferError)
    assert results["abort"].status is TransferStatus.ABORTED
    assert endpoint.receive(0.5) is None
    _assert_no_leaks(engine, endpoint, sender)


def test_a_full_receiver_is_reported_without_leaks(engine, endpoint, sender) -> None:
    n = (RECEIVER_BLOCKS + 1) * engine.kv_spec.block_size
    req = Request("full", random_prompts([n], seed=4)[0], SamplingParams(max_tokens=2))
    req.block_ids = engine.allocator.allocate(engine.kv_spec.blocks_for_tokens(n))
    streamer = LayerStreamer(sender)
    assert not streamer.begin(endpoint.address, "full", req.block_ids, n)
    streamer.on_layer_written(0)  # nothing started: a no-op
    err = streamer.finish()["full"]
    assert isinstance(err, KVTransferError) and err.receiver_full
    req.block_ids = []  # freed by the transport on refusal
    _assert_no_leaks(engine, endpoint, sender)


def test_finish_and_cancel_one_request_at_a_time(engine, endpoint, sender) -> None:
    # A prefill worker acknowledges its batch request by request: one is refused by its decode
    # worker after the prefill (cancelled), the other is handed over.
    a, b = _request(engine, "keep", 20, seed=5), _request(engine, "drop", 24, seed=6)
    streamer = LayerStreamer(sender)
    for r in (a, b):
        streamer.begin(endpoint.address, r.request_id, r.block_ids, r.num_tokens)
    engine.prefill_only([a, b], on_layer_written=streamer.on_layer_written)
    want = gather_tokens(engine.kv_cache, a.block_ids, 20).clone()
    for r in (a, b):
        engine.detach(r.request_id)
    assert streamer.owns("drop") and not streamer.owns("elsewhere")
    assert streamer.cancel("drop", "decode worker full")
    assert not streamer.cancel("drop")
    assert streamer.finish(["keep"])["keep"].status == "ok"
    got = endpoint.receive(10)
    assert got["request_id"] == "keep" and torch.equal(got["data"], want)
    # "drop" may have arrived whole before the cancel: the abort frees it there too.
    _assert_no_leaks(engine, endpoint, sender)
    # The cancel ended its bookkeeping at once (the request may be opened again on this transport before the
    # batch's last finish(), which must not touch that new transfer): nothing is left for the batch's end.
    assert sender.stats()["sending"] == 0 and streamer.finish() == {}


def test_handshakes_run_during_the_forward_pass_and_a_refusal_is_named_after_it(
    engine, endpoint, sender
) -> None:
    # begin_all returns at once: the sender thread handshakes while the forward computes. One request is too big
    # for the receiver: refused, its blocks freed by the transport; the other streams and arrives intact.
    n_full = (RECEIVER_BLOCKS + 1) * engine.kv_spec.block_size
    ok = _request(engine, "overlap-ok", 40, seed=7)
    full = Request("overlap-full", random_prompts([n_full], seed=8)[0], SamplingParams(max_tokens=2))
    full.block_ids = engine.allocator.allocate(engine.kv_spec.blocks_for_tokens(n_full))
    streamer = LayerStreamer(sender)
    streamer.begin_all(
        [(endpoint.address, r.request_id, list(r.block_ids), r.num_tokens, 0) for r in (full, ok)]
    )
    with pytest.raises(RuntimeError, match="once per batch"):
        streamer.begin_all([])
    engine.prefill_only([ok], on_layer_written=streamer.on_layer_written)
    refused = streamer.begun()
    assert list(refused) == ["overlap-full"] and refused["overlap-full"].receiver_full
    assert streamer.owns("overlap-ok") and not streamer.owns("overlap-full")
    full.block_ids = []  # freed by the transport on refusal
    want = gather_tokens(engine.kv_cache, ok.block_ids, 40).clone()
    engine.detach("overlap-ok")
    results = streamer.finish()
    assert list(results) == ["overlap-ok"] and results["overlap-ok"].status == "ok"
    got = endpoint.receive(10)
    assert got["request_id"] == "overlap-ok" and torch.equal(got["data"], want)
    _assert_no_leaks(engine, endpoint, sender)


def test_an_abort_during_the_handshakes_waits_for_them_and_frees_everything(engine, endpoint, sender) -> None:
    reqs = [_request(engine, f"early-abort-{i}", 30, seed=10 + i) for i in range(3)]
    streamer = LayerStreamer(sender)
    streamer.begin_all([(endpoint.address, r.request_id, list(r.block_ids), r.num_tokens, 0) for r in reqs])
    streamer.on_layer_written(0)
    results = streamer.abort("prefill failed")  # may run before the thread has handshaked any of them
    assert sorted(results) == sorted(r.request_id for r in reqs)
    assert all(isinstance(e, KVTransferError) for e in results.values())
    for r in reqs:
        r.block_ids = []  # the transport frees them: aborted, or never leased
    assert endpoint.receive(0.5) is None
    _assert_no_leaks(engine, endpoint, sender)
