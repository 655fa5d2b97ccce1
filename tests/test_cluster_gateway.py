"""The product end to end: HTTP through the Ray Serve gateway into the Ray cluster (controller, prefill/decode or
colocated workers, real gRPC KV transfer, the tiny model), in both modes.

Per mode, one cluster is launched here (its handle reads the workers' own KV figures) and two small gateway
applications connect to it by actor name, as ``bucketserve serve`` does: ``/`` with a roomy admission bound and
``/tight`` with a bound of two requests (for the 429). They are deleted, and the cluster stopped, between modes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from cluster_helpers import NUM_BLOCKS, cluster_config, wait_idle

from bench.server_process import free_port
from gateway.app import build_app
from gateway.cluster_backend import RayClusterBackend
from gateway.commands.serve import connect_backend
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.slow

MODES = ("disaggregated", "colocated")
MAX_MODEL_LEN = 512  # cluster_helpers.cluster_config's
TIGHT = 2  # admission bound of the /tight application


@pytest.fixture(scope="module")
def serve_url(ray_session) -> Iterator[str]:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@dataclass
class Served:
    mode: str
    url: str
    backend: RayClusterBackend  # the launcher's own handle: worker stats, controller state


@pytest.fixture(scope="module", params=MODES)
def served(request, serve_url: str) -> Iterator[Served]:
    from ray import serve

    mode = request.param
    config = cluster_config(mode, f"gw-{mode}")
    backend = RayClusterBackend(config)
    apps = {"main": ("/", 64), "tight": ("/tight", TIGHT)}
    try:
        for name, (prefix, bound) in apps.items():
            # Each replica connects to the cluster by actor name; only the admission bound differs.
            factory = functools.partial(connect_backend, dataclasses.replace(config, max_pending=bound))
            app = build_app(
                GatewaySettings(backend_factory=factory), ray_actor_options={"num_cpus": 0}, name=f"gw-{name}"
            )
            serve.run(app, name=f"{mode}-{name}", route_prefix=prefix)
        yield Served(mode, serve_url, backend)
    finally:
        for name in apps:
            serve.delete(f"{mode}-{name}")
        asyncio.run(backend.shutdown())


def assert_no_leaks(stats: dict[str, dict]) -> None:
    for name, s in stats.items():
        assert s["kv_blocks_used"] == 0, f"{name} still holds {s['kv_blocks_used']} blocks"
        assert s["kv_blocks_free"] == s["kv_blocks_total"] == NUM_BLOCKS, name
        assert s["integrity_error"] is None, f"{name}: {s['integrity_error']}"


def _ids(labels: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in labels), labels
    return [int(t.split(":", 1)[1]) for t in labels]


async def _complete(c: httpx.AsyncClient, prompt: list[int], n: int, stream: bool) -> tuple[list[int], str]:
    """Token ids and finish reason of one greedy completion, streamed (SSE) or not."""
    body = {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }
    if not stream:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        res = r.json()
        assert res["usage"]["completion_tokens"] == n
        choice = res["choices"][0]
        return _ids(choice["logprobs"]["tokens"]), choice["finish_reason"]
    tokens: list[int] = []
    finish = None
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk
        choice = chunk["choices"][0]
        if choice["logprobs"] is not None:
            tokens += _ids(choice["logprobs"]["tokens"])
        finish = choice["finish_reason"] or finish
    return tokens, str(finish)


def test_greedy_over_http_equals_hf_for_16_concurrent_requests(served: Served, hf_reference) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randint(3, 200))] for _ in range(16)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    # Together they need more KV blocks than a worker has: some wait their turn.
    assert sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, max_tokens, strict=True)) > NUM_BLOCKS

    async def run() -> list[tuple[list[int], str]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as c:
            return await asyncio.gather(
                *(
                    _complete(c, p, n, stream=i % 2 == 0)
                    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
                )
            )

    results = asyncio.run(run())
    for i, (p, n, (tokens, finish)) in enumerate(zip(prompts, max_tokens, results, strict=True)):
        assert tokens == hf_reference("tiny", "cpu").greedy(p, n, ignore_eos=True), (
            f"request {i} ({'streamed' if i % 2 == 0 else 'json'})"
        )
        assert finish == "length"
    assert_no_leaks(asyncio.run(wait_idle(served.backend)))


BAD_INPUT = [
    (b'{"prompt": "hi", "max_tokens": ', 400, "json"),
    (json.dumps({"prompt": "hi", "max_tokens": "ten"}), 400, "max_tokens"),
    (json.dumps({"prompt": 3.5}), 400, "prompt"),
    (json.dumps({"prompt": ""}), 400, "prompt"),
    (json.dumps({"prompt": []}), 400, "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": -4}), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "model": "no-such-model"}), 404, "no-such-model"),
    (json.dumps({"prompt": "word " * (MAX_MODEL_LEN + 10)}), 400, "max_model_len"),
    (json.dumps({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}), 400, "max_model_len"),
]


def test_bad_input_through_the_gateway_is_a_4xx_naming_the_problem(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for raw, status, fragment in BAD_INPUT:
            r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, (raw, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert fragment in err["message"].lower() or fragment == err["param"], (raw, err)


def test_disconnect_mid_stream_frees_blocks_on_every_worker(served: Served) -> None:
    body = {"prompt": list(range(100, 220)), "max_tokens": 300, "ignore_eos": True, "stream": True}

    async def run() -> tuple[dict, dict]:
        async with (
            httpx.AsyncClient(base_url=served.url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break
            busy = await served.backend.worker_stats()
        # Leaving the block closed the connection (and the client) mid-stream.
        return busy, await wait_idle(served.backend, timeout=20)

    busy, idle = asyncio.run(run())
    assert sum(s["kv_blocks_used"] for s in busy.values()) > 0, "the request should hold KV while it streams"
    assert_no_leaks(idle)
    if served.backend.handles.controller is not None:
        state = asyncio.run(_controller_state(served.backend))
        assert state["in_cluster"] == 0 and all(d["reserved"] == 0 for d in state["decode"].values())


async def _controller_state(backend: RayClusterBackend) -> dict:
    return await backend.handles.controller.state.remote()


def test_admission_bound_answers_429_with_retry_after(served: Served) -> None:
    long = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=f"{served.url}/tight", timeout=60) as c:
            held = [
                await c.send(c.build_request("POST", "/v1/completions", json=long), stream=True)
                for _ in range(TIGHT)
            ]
            try:
                for r in held:
                    assert r.status_code == 200, await r.aread()
                # The gateway answered 200 once each had its first token: both slots are taken.
                return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            finally:
                for r in held:
                    await r.aclose()

    r = asyncio.run(run())
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and "limit 2" in err["message"]
    assert_no_leaks(asyncio.run(wait_idle(served.backend, timeout=20)))
    # The closed streams gave their slots back.
    with httpx.Client(base_url=f"{served.url}/tight", timeout=60) as c:
        again = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert again.status_code == 200, again.text


def test_sixteen_times_the_admission_bound_at_once_is_served_or_refused_fast_never_a_5xx(
    served: Served,
) -> None:
    """32 streams at once against a bound of 2: each one either completes whole or is refused at once with a 429
    and Retry-After (never a 5xx, never cut off), and the cluster is left with nothing in use."""
    n, tokens = 16 * TIGHT, 24
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True}

    async def one(c: httpx.AsyncClient) -> tuple[int, float, list[str], str | None]:
        t0 = time.monotonic()
        async with c.stream("POST", "/v1/completions", json=body) as r:
            answered = time.monotonic() - t0
            lines = [line async for line in r.aiter_lines() if line]
            return r.status_code, answered, lines, r.headers.get("retry-after")

    async def run() -> list[tuple[int, float, list[str], str | None]]:
        async with httpx.AsyncClient(base_url=f"{served.url}/tight", timeout=120) as c:
            return await asyncio.gather(*(one(c) for _ in range(n)))

    results = asyncio.run(run())
    statuses = [status for status, *_ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= TIGHT and statuses.count(429) >= 1, statuses
    for status, answered, lines, retry_after in results:
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1
            assert answered < 5.0, f"a refusal took {answered:.1f} s"
            assert json.loads(lines[0])["error"]["type"] == "rate_limit_error"
        else:
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            assert not any("error" in c for c in chunks), chunks[-1]
            assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"] != "") <= tokens
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert_no_leaks(asyncio.run(wait_idle(served.backend, timeout=30)))


def test_each_request_records_where_its_time_to_first_token_went(served: Served) -> None:
    """Every process on the way stamps its part; the gateway's record of the request has each stage of the mode,
    and the stages of the time to first token add up to it."""
    import ray

    ttft_stages = ["admission", "prefill_queue", "prefill_forward", "first_token_out"]
    if served.mode == "disaggregated":
        ttft_stages.insert(1, "controller_queue")
    ids = []
    with httpx.Client(base_url=served.url, timeout=60) as c:
        for stream in (True, False):
            body = {"prompt": [5, 6, 7, 8, 9] * 6, "max_tokens": 4, "ignore_eos": True, "stream": stream}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            first = r.text.splitlines()[0].removeprefix("data: ") if stream else r.text
            ids.append(json.loads(first)["id"])
    monitor = served.backend.handles.monitor
    for rid in ids:
        deadline = time.monotonic() + 30
        while (rec := ray.get(monitor.request.remote(rid))) is None:  # recorded without the response waiting
            assert time.monotonic() < deadline, f"no record of {rid}"
            time.sleep(0.1)
        assert rec.stages is not None, rec
        assert [s for s in rec.stages if s in ttft_stages] == ttft_stages, rec.stages
        assert sum(rec.stages[s] for s in ttft_stages) == pytest.approx(rec.ttft_s, abs=1e-3)
        assert rec.stages["overhead"] == pytest.approx(rec.ttft_s - rec.stages["prefill_forward"], abs=1e-3)
        assert rec.prefill_s == rec.stages["prefill_forward"] > 0
        if served.mode == "disaggregated":
            # The hand-off to the decode worker, after the first token.
            assert rec.stages["kv_transfer"] >= 0 and rec.stages["decode_join"] > 0, rec.stages
            assert rec.queue_s == pytest.approx(rec.stages["controller_queue"] + rec.stages["prefill_queue"])
        else:
            assert "kv_transfer" not in rec.stages and "controller_queue" not in rec.stages, rec.stages


def test_health_and_models_through_the_gateway(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as c:
        health = c.get("/health")
        assert health.status_code == 200, health.text
        assert health.json()["mode"] == served.mode
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_metrics_through_the_gateway_carry_the_cluster_families(served: Served) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=served.url, timeout=30) as c:
        # Traffic of its own, so the test does not depend on the order tests run in.
        body = {"prompt": [5, 6, 7, 8, 9] * 8, "max_tokens": 4}
        assert all(c.post("/v1/completions", json=body).status_code == 200 for _ in range(3))
        text = c.get("/metrics").text
    samples = {
        s.name: s for family in text_string_to_metric_families(text) for s in family.samples if s.value > 0
    }
    assert all('model_name="tiny"' in line for line in text.splitlines() if line.startswith("bucketserve:"))
    assert "bucketserve:request_success_total" in samples
    assert "bucketserve:time_to_first_token_seconds_count" in samples
    assert "bucketserve:generation_tokens_total" in samples
    if served.mode == "disaggregated":
        # Filled by the cluster itself: prefill batches (size, padding) and the controller's request buckets.
        assert "bucketserve:batch_size_count" in samples
        assert "bucketserve:bucket_count" in samples
        # Each acknowledged KV transfer, as the prefill worker reported it.
        assert "bucketserve:kv_transfer_bytes_total" in samples
        assert "bucketserve:kv_transfer_latency_seconds_count" in samples
