"""The Ray cluster end to end through RayClusterBackend: real Ray actors, real gRPC KV transfer, the tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections.abc import Awaitable, Callable

import pytest
import ray
from cluster_helpers import (
    NUM_BLOCKS,
    cluster_config,
    collect,
    gather_all,
    make_request,
    wait_idle,
)

from gateway.backend import Rejected
from gateway.cluster_backend import RayClusterBackend

pytestmark = pytest.mark.slow

MODES = ("disaggregated", "colocated")
COLOCATED_STEP_TOKENS = 64


@pytest.fixture(scope="module")
def backends(ray_session):
    # The device's default shape policy (flat tokens on CPU) in each mode, and the padded bucket policy beside it;
    # the latter's gateways take every output by drain (no local output sockets), so both ways out are run.
    # The colocated one takes serve's CPU step budget (its prompts then span several steps), here smaller than
    # the engine config's 1024.
    made = {
        mode: RayClusterBackend(
            cluster_config(mode, f"t-{mode}", colocated_cpu_step_tokens=COLOCATED_STEP_TOKENS)
        )
        for mode in MODES
    }
    for mode in MODES:
        made[mode, "buckets"] = RayClusterBackend(
            cluster_config(mode, f"t-{mode}-b", shape_policy="buckets", local_outputs=False)
        )
    yield made
    for b in made.values():
        asyncio.run(b.shutdown())


def assert_no_leaks(stats: dict[str, dict]) -> None:
    assert_no_leaks_of(stats, NUM_BLOCKS)


def assert_no_leaks_of(stats: dict[str, dict], num_blocks: int) -> None:
    for name, s in stats.items():
        assert s["kv_blocks_used"] == 0, f"{name} still holds {s['kv_blocks_used']} blocks"
        assert s["kv_blocks_free"] + s["kv_blocks_used"] == s["kv_blocks_total"] == num_blocks, name
        assert s["integrity_error"] is None, f"{name}: {s['integrity_error']}"


@pytest.mark.parametrize("policy", ["flat", "buckets"])
@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_hf_for_16_concurrent_mixed_requests(backends, mode, policy, hf_reference):
    backend = backends[mode] if policy == "flat" else backends[mode, policy]
    rng = random.Random(7)
    # Mixed lengths; together they need far more than the 48 KV blocks there are, so most wait their turn.
    reqs = [make_request(f"{mode}-g{i}", rng.randint(3, 200), rng.randint(1, 24), seed=1) for i in range(16)]
    assert sum(-(-(r.num_prompt_tokens + r.sampling.max_tokens) // 16) for r in reqs) > NUM_BLOCKS

    async def run():
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    results = asyncio.run(run())
    for req, got in zip(reqs, results, strict=True):
        assert got.error is None, got.error
        assert got.finish_reason == "length"
        assert got.tokens == hf_reference("tiny", "cpu").greedy(
            req.prompt_token_ids, req.sampling.max_tokens, ignore_eos=True
        ), req.request_id
    stats = asyncio.run(wait_idle(backend))
    assert_no_leaks(stats)
    assert {s["shape_policy"] for s in stats.values()} == {policy}
    budget = COLOCATED_STEP_TOKENS if (mode, policy) == ("colocated", "flat") else 1024
    assert {s["max_num_batched_tokens"] for s in stats.values()} == {budget}, stats
    by_socket = sum(s["outputs_by_socket"] for s in stats.values())
    if policy == "flat":  # same node: the tokens came by the workers' output sockets
        assert by_socket > 0, stats
    else:  # local outputs off: every token came by drain
        assert by_socket == 0 and sum(s["outputs_by_drain"] for s in stats.values()) > 0, stats
    if mode == "disaggregated":  # the KV went layer by layer while each prefill ran (on in these clusters)
        assert sum(s.get("streamed_transfers", 0) for s in stats.values()) > 0, stats
        assert [s["kv_layer_streaming"] for s in stats.values() if "kv_layer_streaming" in s] == [True], stats
        # Same node: the controller handed the prefill worker its batches over the dispatch socket.
        assert sum(s.get("batches_by_socket", 0) for s in stats.values()) > 0, stats
        # ... and the gateway handed the controller its submits over the controller's socket.
        assert backend.submits_by_socket >= len(reqs)
        assert asyncio.run(_controller_state(backend))["submits_by_socket"] >= len(reqs)
    # Every accepted request reached the monitor as an arrival (the controller sizes batches from these).
    summary = ray.get(backend.handles.monitor.summary.remote())
    assert summary["arrival_rate_rps"] > 0 and summary["mean_prompt_tokens"] is not None


@pytest.mark.parametrize("mode", MODES)
def test_continuous_batching_short_requests_join_and_finish_first(backends, mode):
    backend = backends[mode]

    async def run():
        started = asyncio.Event()
        long = asyncio.ensure_future(collect(backend, make_request(f"{mode}-long", 20, 160), started))
        await started.wait()
        shorts = [collect(backend, make_request(f"{mode}-s{i}", 10 + 7 * i, 3)) for i in range(4)]
        done = await asyncio.gather(*shorts)
        return await long, done

    long, shorts = asyncio.run(run())
    assert len(long.tokens) == 160
    for s in shorts:
        assert len(s.tokens) == 3
        # Joined the running batch after the long one started, and left it while the long one still ran.
        assert long.first_token_at < s.first_token_at
        assert s.finished_at < long.finished_at
    assert_no_leaks(asyncio.run(wait_idle(backend)))


def test_messages_inline_and_through_the_object_store_both_match_hf(backends, hf_reference, monkeypatch):
    """Prompts above the inline limit go to the prefill worker as references into the gateway's object store, the
    others ride with the controller's calls: both ways give HF's tokens and leave no block behind. (The limit is
    lowered here so the tiny cluster's prompts take both ways; the gateway picks the way in this process.)"""
    import worker.messages as messages

    backend = backends["disaggregated"]
    monkeypatch.setattr(messages, "INLINE_PROMPT_TOKENS", 64)
    put = messages.MessageRef.put
    by_ref: list[str] = []

    def counted(msg):
        by_ref.append(msg.request_id)
        return put(msg)

    monkeypatch.setattr(messages.MessageRef, "put", counted)
    reqs = [make_request(f"way{i}", n, 8, seed=5) for i, n in enumerate((20, 64, 65, 180, 40, 120))]

    async def run():
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    results = asyncio.run(run())
    assert sorted(by_ref) == ["way2", "way3", "way5"]
    for req, got in zip(reqs, results, strict=True):
        assert got.error is None, got.error
        assert got.tokens == hf_reference("tiny", "cpu").greedy(req.prompt_token_ids, 8, ignore_eos=True), (
            req.request_id
        )
    assert_no_leaks(asyncio.run(wait_idle(backend)))


def test_memory_burst_waits_and_completes_without_leaks(backends):
    backend = backends["disaggregated"]
    # Each needs 12 blocks on the decode worker (150 + 40 tokens); 14 of them need 168 of 48 blocks.
    reqs = [make_request(f"burst{i}", 150, 40, seed=3) for i in range(14)]

    async def run():
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    results = asyncio.run(run())
    assert all(r.error is None and len(r.tokens) == 40 for r in results)
    assert_no_leaks(asyncio.run(wait_idle(backend)))
    state = asyncio.run(_controller_state(backend))
    assert state["in_cluster"] == 0 and state["queued"] == 0
    assert all(d["reserved"] == 0 for d in state["decode"].values())


async def _controller_state(backend) -> dict:
    return await backend.handles.controller.state.remote()


def test_online_first_token_before_earlier_offline_under_backlog(backends):
    backend = backends["disaggregated"]

    async def run():
        offline = [
            asyncio.ensure_future(collect(backend, make_request(f"off{i}", 100, 2, priority="offline")))
            for i in range(16)
        ]
        # Wait for a backlog at the controller, then send online work that arrives after all of it.
        deadline = time.monotonic() + 10
        while (await _controller_state(backend))["queued"] < 4:
            assert time.monotonic() < deadline, "no backlog formed"
            await asyncio.sleep(0.005)
        online_sent = time.monotonic()
        online = [collect(backend, make_request(f"on{i}", 100, 2)) for i in range(2)]
        online_done = await asyncio.gather(*online)
        return online_sent, online_done, await asyncio.gather(*offline)

    online_sent, online, offline = asyncio.run(run())
    last_online = max(o.first_token_at for o in online)
    overtaken = [o for o in offline if o.first_token_at > last_online]
    # Every offline request arrived before the online ones; those still queued were overtaken.
    assert len(overtaken) >= 2, [round(o.first_token_at - online_sent, 3) for o in offline]
    assert_no_leaks(asyncio.run(wait_idle(backend)))


def test_colocated_online_first_token_before_earlier_offline_under_backlog(backends):
    backend = backends["colocated"]

    async def waiting() -> int:
        return sum(s["waiting"] for s in (await backend.worker_stats()).values())

    async def run():
        offline = [
            asyncio.ensure_future(collect(backend, make_request(f"c-off{i}", 100, 2, priority="offline")))
            for i in range(16)
        ]
        # The backlog forms in the worker's engine queue (no controller in this mode): wait for it.
        deadline = time.monotonic() + 10
        while await waiting() < 4:
            assert time.monotonic() < deadline, "no backlog formed"
            await asyncio.sleep(0.005)
        online = [collect(backend, make_request(f"c-on{i}", 100, 2)) for i in range(2)]
        online_done = await asyncio.gather(*online)
        return online_done, await asyncio.gather(*offline)

    online, offline = asyncio.run(run())
    last_online = max(o.first_token_at for o in online)
    overtaken = [o for o in offline if o.first_token_at > last_online]
    # FCFS would serve every earlier offline request first; online ones must jump the waiting queue.
    assert len(overtaken) >= 2, len(overtaken)
    assert_no_leaks(asyncio.run(wait_idle(backend)))


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_stream_frees_blocks_on_every_worker(backends, mode):
    backend = backends[mode]

    async def run():
        gen = backend.generate(make_request(f"{mode}-cancel", 120, 300))
        seen = 0
        async for out in gen:
            seen += len(out.new_token_ids)
            if seen >= 5:
                break
        busy = await backend.worker_stats()
        await gen.aclose()  # the client went away mid-stream
        return busy, await wait_idle(backend)

    busy, idle = asyncio.run(run())
    # It held KV somewhere (the decode worker, or the colocated one) before the client left.
    assert sum(s["kv_blocks_used"] for s in busy.values()) > 0
    assert_no_leaks(idle)


def test_too_long_prompt_is_rejected_naming_the_limit(backends):
    backend = backends["disaggregated"]

    async def run():
        async for _ in backend.generate(make_request("too-long", 600, 4)):
            pass

    with pytest.raises(Rejected, match="max_model_len"):
        asyncio.run(run())


def test_health_reports_every_worker_up_and_warmed(backends):
    for key, backend in backends.items():
        mode = key if isinstance(key, str) else key[0]
        health = asyncio.run(backend.health())
        assert health["ready"] is True, health
        roles = sorted(w["role"] for w in health["workers"])
        assert roles == (["decode", "prefill"] if mode == "disaggregated" else ["colocated"])
        assert "bucketserve" in asyncio.run(backend.metrics_text())


@pytest.mark.parametrize("setting", [False, None])
def test_kv_sent_after_the_batch_when_layer_streaming_is_off(ray_session, hf_reference, setting):
    # The unstreamed hand-off (--kv-stream-layers off, and auto on these one-thread CPU workers): same exact
    # answers, no streamed transfer, no leak.
    name = "t-nostream" if setting is False else "t-autostream"
    backend = RayClusterBackend(cluster_config("disaggregated", name, stream_kv_layers=setting))
    try:
        rng = random.Random(11)
        reqs = [make_request(f"ns{i}", rng.randint(3, 150), rng.randint(2, 12), seed=4) for i in range(6)]

        async def run():
            return await asyncio.gather(*(collect(backend, r) for r in reqs))

        for req, got in zip(reqs, asyncio.run(run()), strict=True):
            assert got.error is None, got.error
            assert got.tokens == hf_reference("tiny", "cpu").greedy(
                req.prompt_token_ids, req.sampling.max_tokens, ignore_eos=True
            ), req.request_id
        stats = asyncio.run(wait_idle(backend))
        assert_no_leaks(stats)
        assert sum(s.get("streamed_transfers", 0) for s in stats.values()) == 0
        assert [s["kv_layer_streaming"] for s in stats.values() if "kv_layer_streaming" in s] == [False], (
            stats
        )
    finally:
        asyncio.run(backend.shutdown())


def test_actors_find_each_other_in_the_clusters_namespace_not_the_drivers(ray_session):
    # Under `serve run` the process that starts the cluster runs in another Ray namespace than the cluster's
    # actors: workers must still reach the monitor and the controller, or /metrics has no worker series.
    backend = RayClusterBackend(cluster_config("disaggregated", "t-ns", namespace="bucketserve-tests-other"))
    try:
        got = asyncio.run(collect(backend, make_request("ns-0", 20, 4)))
        assert got.error is None and len(got.tokens) == 4
        deadline = time.monotonic() + 10
        while True:
            summary = ray.get(backend.handles.monitor.summary.remote())
            if set(summary["workers"]) == set(backend.handles.workers) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert set(summary["workers"]) == set(backend.handles.workers), summary["workers"]
        assert_no_leaks(asyncio.run(wait_idle(backend)))
    finally:
        asyncio.run(backend.shutdown())


def test_elastic_prefill_lends_a_burst_to_the_idle_decode_worker(ray_session, hf_reference):
    """serve's default (--elastic on): while the prefill worker holds a batch, the decode worker prefills prompts
    itself (no KV transfer). Exact answers, including requests whose client leaves after the first token, no
    block leaked on either worker, and the lending on /metrics."""
    backend = RayClusterBackend(cluster_config("disaggregated", "t-elastic", elastic=True))
    try:
        rng = random.Random(5)
        reqs = [make_request(f"el{i}", rng.randint(40, 120), rng.randint(2, 10), seed=6) for i in range(12)]
        leaving = {r.request_id for r in reqs[3::4]}

        async def leave_early(req):
            async for out in backend.generate(req):
                if out.new_token_ids:
                    return None  # the client goes away after its first token

        async def run():
            return await asyncio.gather(
                *(leave_early(r) if r.request_id in leaving else collect(backend, r) for r in reqs)
            )

        for req, got in zip(reqs, asyncio.run(run()), strict=True):
            if req.request_id in leaving:
                continue
            assert got.error is None, got.error
            assert got.tokens == hf_reference("tiny", "cpu").greedy(
                req.prompt_token_ids, req.sampling.max_tokens, ignore_eos=True
            ), req.request_id
        assert_no_leaks(asyncio.run(wait_idle(backend)))
        state = ray.get(backend.handles.controller.state.remote())
        assert state["lent_batches"] >= 1, state
        assert all(d["lent_batches"] == 0 and d["requests"] == 0 for d in state["decode"].values()), state
        text = asyncio.run(backend.metrics_text())
        assert 'bucketserve:lent_prompts_total{model_name="tiny",worker="t-elastic:decode-0"}' in text
    finally:
        asyncio.run(backend.shutdown())


def test_a_lone_prompt_prefills_on_the_idle_decode_workers_core_too(ray_session, hf_reference):
    """serve's default (--elastic on, --share-cores on, workers pinned): a prompt that arrives while the decode
    worker holds nothing runs its prefill on the decode worker's core as well (two threads), and its answer is still
    exact. The borrowing shows in the controller's state, the prefill worker's stats and on /metrics."""
    backend = RayClusterBackend(cluster_config("disaggregated", "t-cores", stream_kv_layers=None))
    try:
        infos = backend.handles.infos
        if (os.cpu_count() or 1) < 2:
            pytest.skip("one core: nothing to borrow (prefill and decode workers share it)")
        if len({c for i in infos.values() for c in i.cores}) < 2:
            pytest.fail(
                f"the workers were not pinned to two cores: {[(n, i.cores) for n, i in infos.items()]}"
            )
        reference = hf_reference("tiny", "cpu")
        for i in range(3):
            req = make_request(f"core{i}", 90, 5, seed=11)
            got = asyncio.run(collect(backend, req))
            assert got.error is None, got.error
            assert got.tokens == reference.greedy(req.prompt_token_ids, 5, ignore_eos=True), req.request_id
            # The next prompt is lone only once the controller knows this one ended (the decode worker says so) and
            # its prompt batch is done (the prefill worker says so, on its own message, which on a loaded machine
            # can come after the request's last token).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                state = ray.get(backend.handles.controller.state.remote())
                if state["decode"]["t-cores:decode-0"]["requests"] == 0 and not any(
                    w["outstanding"] for w in state["prefill"].values()
                ):
                    break
                time.sleep(0.05)
        assert state["core_shared_batches"] == 3, state
        assert not state["decode"]["t-cores:decode-0"]["cores_lent"], state
        stats = asyncio.run(wait_idle(backend))
        assert_no_leaks(stats)
        assert stats["t-cores:prefill-0"]["core_shared_batches"] == 3, stats["t-cores:prefill-0"]
        text = asyncio.run(backend.metrics_text())
        assert 'bucketserve:lent_core_batches_total{model_name="tiny",worker="t-cores:decode-0"} 3.0' in text
    finally:
        asyncio.run(backend.shutdown())

    # Off: the prefill worker keeps to its own core.
    backend = RayClusterBackend(cluster_config("disaggregated", "t-cores-off", share_cores=False))
    try:
        got = asyncio.run(collect(backend, make_request("nocore", 90, 5, seed=11)))
        assert got.error is None, got.error
        assert ray.get(backend.handles.controller.state.remote())["core_shared_batches"] == 0
    finally:
        asyncio.run(backend.shutdown())


def test_without_elastic_prefill_every_prompt_goes_to_the_prefill_worker(ray_session):
    backend = RayClusterBackend(cluster_config("disaggregated", "t-rigid", elastic=False))
    try:
        reqs = [make_request(f"rg{i}", 80, 4, seed=2) for i in range(12)]

        async def run():
            return await asyncio.gather(*(collect(backend, r) for r in reqs))

        assert all(got.error is None for got in asyncio.run(run()))
        assert_no_leaks(asyncio.run(wait_idle(backend)))
        assert ray.get(backend.handles.controller.state.remote())["lent_batches"] == 0
    finally:
        asyncio.run(backend.shutdown())


def with_small_model(config):
    """``config`` serving `small` (prompts up to 2,048 tokens, 256 KV blocks): its forward passes take hundreds of
    ms, long enough for the cores-lending estimates to decide rather than timing noise."""
    engine = dataclasses.replace(
        config.engine,
        model="small",
        scheduler=dataclasses.replace(
            config.engine.scheduler, max_model_len=2048, max_num_batched_tokens=2048
        ),
        cache=dataclasses.replace(config.engine.cache, num_blocks=256),
    )
    return dataclasses.replace(config, engine=engine)


def needy_prompt_beside_a_decode(
    backend, reference, pace: float | Callable[[], Awaitable[float]], min_prompt: int
) -> None:
    """While a request decodes a long answer, send a prompt whose forward takes 0.9 s alone at ``pace`` (0.5 s on
    two cores, inside the 800 ms pause limit), however fast this machine is right now (1,400 tokens at 0.65 ms a
    token on a quiet 2-core EPYC, 740 at 1.2 ms beside other clusters), with a TTFT target of 0.8x that: missed on
    one core, met on two. ``pace`` may be a coroutine function, asked once the first request decodes (the pace of
    the worker the prompt will go to, where two workers' cores differ). Both answers equal HF greedy, and the first
    was still decoding when the second began."""
    decoding = make_request("decoding", 20, 400, seed=3)

    async def run():
        started = asyncio.Event()
        first = asyncio.ensure_future(collect(backend, decoding, started))
        # A hang names what the cluster holds (and who holds the core gates) instead of pytest's timeout.
        waiting = asyncio.ensure_future(started.wait())
        await gather_all(backend, [waiting], 120)
        await asyncio.sleep(0.2)
        nonlocal pace
        if callable(pace):
            pace = await pace()
        long_prompt = max(min_prompt, min(1800, round(0.9 / pace)))
        needy = make_request("needy", long_prompt, 8, seed=4)  # made when sent: its target counts from here
        needy.slo_ttft_ms = 0.8 * long_prompt * pace * 1e3
        second, done = await gather_all(backend, [asyncio.ensure_future(collect(backend, needy)), first], 180)
        return needy, second, done

    needy, second, first = asyncio.run(run())
    for req, got in ((decoding, first), (needy, second)):
        assert got.error is None, got.error
        assert got.tokens == reference.greedy(
            req.prompt_token_ids, req.sampling.max_tokens, ignore_eos=True
        ), req.request_id
    assert first.finished_at > second.first_token_at, (
        "the first request was not decoding when the prompt came"
    )


def test_a_long_prompt_that_needs_both_cores_pauses_the_busy_decode_worker(ray_session, hf_reference):
    """serve's default (--pause-decode-ms 800): while the decode worker decodes a long answer, a long prompt whose
    TTFT target its prefill worker's core alone would miss (at the pace the controller measured), and both cores
    would meet, runs its forward on the decode worker's core too; the decode worker stops stepping meanwhile. Both
    answers stay exact and no block leaks. `small`, so that the prompt's forward takes long enough (hundreds of ms)
    for the controller's estimate to decide, not its timing noise."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to borrow (prefill and decode workers share it)")
    config = cluster_config("disaggregated", "t-pause", stream_kv_layers=None)
    backend = RayClusterBackend(with_small_model(config))
    try:
        infos = backend.handles.infos
        if len({c for i in infos.values() for c in i.cores}) < 2:
            pytest.fail(
                f"the workers were not pinned to two cores: {[(n, i.cores) for n, i in infos.items()]}"
            )
        reference = hf_reference("small", "cpu")
        # A first prompt teaches the controller the prefill pace (it ran on both cores: counted as its time alone).
        warm = make_request("pace", 600, 2, seed=3)
        assert asyncio.run(collect(backend, warm)).error is None
        deadline = time.monotonic() + 10
        while (pace := ray.get(backend.handles.controller.state.remote())["prefill_s_per_token"]) == 0.0:
            assert time.monotonic() < deadline, "the controller never learned the prefill pace"
            time.sleep(0.05)
        needy_prompt_beside_a_decode(backend, reference, pace, 64)
        state = ray.get(backend.handles.controller.state.remote())
        assert state["decode_pausing_batches"] == 1, (pace, state)
        assert_no_leaks_of(asyncio.run(wait_idle(backend)), 256)
    finally:
        asyncio.run(backend.shutdown())


def test_colocated_workers_lend_each_other_their_cores_for_long_prompts(ray_session, hf_reference):
    """Two one-core colocated workers (serve --mode colocated --colocated-workers 2 on a 2-core host): a long prompt
    runs its chunks on the idle neighbour's core too; and while that neighbour decodes, a long prompt whose TTFT
    target one core would miss (at the pace the worker measured) and two cores meet pauses it for its chunks. The
    answers stay exact and no block leaks. `small`, so that chunks take hundreds of ms and the estimates decide."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no neighbour to borrow from")
    config = cluster_config("colocated", "t-colo-share", colocated_workers=2, colocated_cpu_step_tokens=512)
    backend = RayClusterBackend(with_small_model(config))
    try:
        infos = backend.handles.infos
        if sorted(c for i in infos.values() for c in i.cores) != [0, 1]:
            pytest.fail(
                f"the workers were not pinned to a core each: {[(n, i.cores) for n, i in infos.items()]}"
            )
        reference = hf_reference("small", "cpu")

        async def stats() -> dict[str, dict]:
            return await backend.worker_stats()

        # Two prompts at once, one to each worker (the gateway sends a request to the one with the fewest prompt
        # tokens waiting): neither lends, each busy with its own, and each learns its pace on its own core.
        pair = [make_request(f"pair{i}", 600, 2, seed=i) for i in range(2)]

        async def both():
            return await asyncio.gather(*(collect(backend, r) for r in pair))

        for req, got in zip(pair, asyncio.run(both()), strict=True):
            assert got.error is None and got.tokens == reference.greedy(
                req.prompt_token_ids, 2, ignore_eos=True
            )
        by_worker = asyncio.run(stats())
        assert all(s["prompt_s_per_token"] > 0 for s in by_worker.values()), by_worker
        # The pace of the worker that gets the needy prompt sizes it below (the two cores' speeds may differ by a
        # third: a prompt sized by the faster one's pace is then late on the slower one's two cores as well). Taken
        # before the lone prompt: a widened step's time counts at an assumed speed-up.
        paces = {n: s["prompt_s_per_token"] for n, s in by_worker.items()}

        async def idle_worker_pace() -> float:
            # The gateway sends a request to the worker with fewer in flight: the one not decoding.
            idle = [n for n, s in (await stats()).items() if s["running"] == 0]
            assert len(idle) == 1, idle
            return paces[idle[0]]

        shared_before = sum(s["core_shared_steps"] for s in by_worker.values())
        # Alone: its chunks run on both cores (the other worker is idle).
        lone = make_request("lone", 700, 2, seed=3)
        got = asyncio.run(collect(backend, lone))
        assert got.error is None and got.tokens == reference.greedy(lone.prompt_token_ids, 2, ignore_eos=True)
        by_worker = asyncio.run(stats())
        assert sum(s["core_shared_steps"] for s in by_worker.values()) > shared_before, by_worker
        assert sum(s["neighbour_pausing_steps"] for s in by_worker.values()) == 0, by_worker
        # To the other worker: the gateway sends a request to the one with fewer in flight.
        needy_prompt_beside_a_decode(backend, reference, idle_worker_pace, 200)
        by_worker = asyncio.run(stats())
        assert sum(s["neighbour_pausing_steps"] for s in by_worker.values()) >= 1, (
            paces,
            {n: (s["prompt_s_per_token"], s["core_shared_steps"]) for n, s in by_worker.items()},
        )
        assert_no_leaks_of(asyncio.run(wait_idle(backend)), 256)
    finally:
        asyncio.run(backend.shutdown())


def test_a_short_prompt_queued_behind_a_long_one_is_taken_back_and_lent_when_the_decode_worker_frees_up(
    ray_session, hf_reference
):
    """The prefill worker runs a long prompt (a second on one core); a mid-length prompt is lent to the decode
    worker meanwhile, and a short prompt with a TTFT target that comes while that lent batch runs queues on the
    prefill worker behind the long one. When the decode worker's lent batch is done, the controller takes the short
    prompt's batch back (it has not started) and lends it: it gets its first token before the long prompt does.
    Every answer equals HF greedy and no block leaks."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the prefill and decode workers share it, nothing runs side by side")
    config = cluster_config("disaggregated", "t-withdraw", stream_kv_layers=None)
    backend = RayClusterBackend(with_small_model(config))
    try:
        reference = hf_reference("small", "cpu")
        warm = make_request("pace", 600, 2, seed=3)  # teaches the controller the prefill pace
        assert asyncio.run(collect(backend, warm)).error is None
        deadline = time.monotonic() + 10
        while (pace := ray.get(backend.handles.controller.state.remote())["prefill_s_per_token"]) == 0.0:
            assert time.monotonic() < deadline, "the controller never learned the prefill pace"
            time.sleep(0.05)
        # At least a second and a half on the prefill worker's one core however fast the machine (the decode worker
        # decodes, so the long prompt borrows no core: it has no TTFT target to need one). Shorter, the lent batch,
        # the take-back and the short prompt's own forward on the decode worker fill the long prompt's time (at
        # 909 tokens the short one came 5 ms ahead of it; at 1.1 ms a token this is 1,500).
        long_len = max(1500, min(2000, round(1.5 / pace)))
        decoding = make_request("decoding", 20, 300, seed=5)
        long = make_request("long", long_len, 4, seed=6)
        lent = make_request("lent", 400, 4, seed=7)
        short = None

        async def run():
            started = asyncio.Event()
            tasks = [asyncio.ensure_future(collect(backend, decoding, started))]
            await gather_all(backend, [asyncio.ensure_future(started.wait())], 120)
            tasks.append(asyncio.ensure_future(collect(backend, long)))
            await asyncio.sleep(0.05)
            tasks.append(asyncio.ensure_future(collect(backend, lent)))  # the prefill worker is busy: lent
            await asyncio.sleep(0.05)
            # Made when sent, its target counting from here: missed behind the long prompt, met if lent at once.
            nonlocal short
            short = make_request("short", 100, 4, seed=8)
            short.slo_ttft_ms = 0.6 * long_len * pace * 1e3
            tasks.append(asyncio.ensure_future(collect(backend, short)))
            return await gather_all(backend, tasks, 180)

        results = dict(zip(("decoding", "long", "lent", "short"), asyncio.run(run()), strict=True))
        for req in (decoding, long, lent, short):
            got = results[req.request_id]
            assert got.error is None, got.error
            assert got.tokens == reference.greedy(
                req.prompt_token_ids, req.sampling.max_tokens, ignore_eos=True
            ), req.request_id
        state = ray.get(backend.handles.controller.state.remote())
        assert state["withdrawn_batches"] >= 1, (pace, long_len, state)
        assert results["short"].first_token_at < results["long"].first_token_at, (pace, long_len, state)
        assert_no_leaks_of(asyncio.run(wait_idle(backend)), 256)
    finally:
        asyncio.run(backend.shutdown())
