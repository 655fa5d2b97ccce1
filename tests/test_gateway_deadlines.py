"""Request deadlines: a request past its deadline is a 408 (a begun stream ends with a timeout error chunk and
[DONE]) and is aborted everywhere, its KV blocks freed; the x-request-timeout-ms header asks for less than the
server's request_timeout_s, never more; a request within its deadline is unaffected; and a worker that stops
answering (alive, not dead) is declared down, so its requests end with an error.

First over the in-process engine with the real tiny model (a real uvicorn server), then through the real Ray
cluster behind Ray Serve (one cluster launch; its last test stops a worker's process, so it runs last).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from cluster_helpers import NUM_BLOCKS, cluster_config, wait_idle
from gateway_helpers import serve_app, sse_events, tiny_config

import gateway.generation as generation
from bench.server_process import free_port
from gateway.app import build_app, create_app
from gateway.cluster_backend import RayClusterBackend
from gateway.cluster_launch import ClusterConfig
from gateway.commands.serve import _serve_parser, checked_cluster_config, connect_backend
from gateway.deadline import HEADER
from gateway.flags import FlagError
from gateway.local_backend import LocalEngineBackend
from gateway.settings import GatewaySettings

PROMPT = "In a distant land, long ago, " * 6
# 2.5-7 ms a token on the machines measured: 400 tokens take seconds, beyond the deadlines below.
LONG = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
# A stuck engine's deadline: no token comes whatever the machine's speed.
SHORT_MS = 300
# How late a 408 may come after its deadline (a loaded 2-core machine).
SLACK_S = 1.5


@pytest.fixture(scope="module")
def backend() -> Iterator[LocalEngineBackend]:
    b = LocalEngineBackend(tiny_config())
    yield b
    b.close()


@pytest.fixture(scope="module")
def url(backend: LocalEngineBackend) -> Iterator[str]:
    with serve_app(create_app(backend, GatewaySettings())) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def quarter_of_a_run(url: str, body: dict) -> int:
    """A deadline (ms) a quarter of ``body``'s time without one, measured here: a fixed one stops being shorter
    than the run once the engine gets faster (a 500 ms deadline let a 400-token request make half its tokens at
    2.5 ms a token)."""
    with httpx.Client(base_url=url, timeout=60) as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=body)
        took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    return max(50, int(took * 1000 / 4))


@pytest.fixture(scope="module")
def deadline_ms_local(url: str, backend: LocalEngineBackend) -> int:
    limit = quarter_of_a_run(url, LONG)
    assert_engine_free(backend)
    return limit


def output_tokens(backend: LocalEngineBackend) -> int:
    return backend.inspect(lambda e: e.stats["output_tokens"])


def assert_engine_free(backend: LocalEngineBackend) -> None:
    """Idle, no request left in the engine, every KV block free."""
    assert backend.wait_idle(20), "requests still in flight"
    backend.inspect(lambda e: e.check_integrity())
    assert backend.inspect(lambda e: e.requests) == {}
    free, total = backend.inspect(lambda e: (e.allocator.num_free, e.allocator.num_blocks))
    assert free == total, f"{total - free} KV blocks still held"


def assert_timeout_error(err: dict, fragment: str) -> None:
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "timeout_error" and err["code"] == "request_timeout", err
    assert "timed out" in err["message"] and fragment in err["message"], err


@contextlib.contextmanager
def engine_stuck(backend: LocalEngineBackend, seconds: float) -> Iterator[None]:
    """The engine thread cannot step for ``seconds`` (as a hung worker): a test thread holds its lock."""
    held = threading.Event()

    def hold() -> None:
        backend.inspect(lambda _: (held.set(), time.sleep(seconds)))

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    try:
        yield
    finally:
        t.join()


# --------------------------------------------------------------------------- past the deadline


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_json_request_past_its_deadline_is_a_408_and_frees_its_blocks(
    client: httpx.Client, backend: LocalEngineBackend, deadline_ms_local: int, route: str
) -> None:
    body = (
        dict(LONG)
        if route == "/v1/completions"
        else {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 400,
            "ignore_eos": True,
        }
    )
    limit = deadline_ms_local
    before = output_tokens(backend)
    t0 = time.monotonic()
    r = client.post(route, json=body, headers={HEADER: str(limit)})
    took = time.monotonic() - t0
    assert r.status_code == 408, r.text
    assert limit / 1e3 <= took < limit / 1e3 + SLACK_S
    assert_timeout_error(r.json()["error"], f"{HEADER}: {limit}")
    assert_engine_free(backend)
    made = output_tokens(backend) - before
    assert 0 < made < body["max_tokens"] // 2, f"{made} tokens: the request was not aborted at its deadline"


def test_stream_past_its_deadline_ends_with_a_timeout_chunk_then_done(
    client: httpx.Client, backend: LocalEngineBackend, deadline_ms_local: int
) -> None:
    limit = deadline_ms_local
    before = output_tokens(backend)
    t0 = time.monotonic()
    with client.stream(
        "POST", "/v1/completions", json={**LONG, "stream": True}, headers={HEADER: str(limit)}
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    took = time.monotonic() - t0
    assert took < limit / 1e3 + SLACK_S
    assert events[-1] == "[DONE]"
    assert_timeout_error(events[-2]["error"], f"{HEADER}: {limit}")
    text = [e["choices"][0]["text"] for e in events[:-2]]
    assert text and all("error" not in e for e in events[:-2]), "tokens streamed before the deadline"
    assert_engine_free(backend)
    assert output_tokens(backend) - before < LONG["max_tokens"] // 2


def test_a_stuck_engine_cannot_hold_a_request_past_its_deadline(
    client: httpx.Client, backend: LocalEngineBackend
) -> None:
    """No first token can come while the engine is stuck: the JSON request and the stream (refused before its 200,
    as nothing was sent yet) both get their 408 on time, and the engine frees them once it moves again."""
    with engine_stuck(backend, 3.0):
        for stream in (False, True):
            t0 = time.monotonic()
            r = client.post(
                "/v1/completions", json={**LONG, "stream": stream}, headers={HEADER: str(SHORT_MS)}
            )
            assert r.status_code == 408, r.text
            assert time.monotonic() - t0 < SHORT_MS / 1e3 + SLACK_S
            assert_timeout_error(r.json()["error"], HEADER)
    assert_engine_free(backend)


def test_the_header_cannot_raise_the_servers_timeout(backend: LocalEngineBackend) -> None:
    app = create_app(backend, GatewaySettings(request_timeout_s=0.5))
    with serve_app(app) as u, httpx.Client(base_url=u, timeout=60) as c:
        for headers, fragment in (({}, "server's request timeout"), ({HEADER: "600000"}, "capped")):
            t0 = time.monotonic()
            r = c.post("/v1/completions", json=LONG, headers=headers)
            assert r.status_code == 408, r.text
            assert time.monotonic() - t0 < 0.5 + SLACK_S
            assert_timeout_error(r.json()["error"], fragment)
            assert "0.5 s" in r.json()["error"]["message"]
    assert_engine_free(backend)


def test_a_stream_whose_client_stops_reading_ends_soon_after_its_deadline(
    backend: LocalEngineBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app driven as ASGI with a client that neither reads nor leaves: from its third message on, ``send``
    never returns (a full socket). The stream cannot report its timeout, so it is cut ``STREAM_GRACE_S`` after its
    deadline, and its request aborted."""
    monkeypatch.setattr(generation, "STREAM_GRACE_S", 0.5)
    app = create_app(backend, GatewaySettings())
    payload = json.dumps({**LONG, "stream": True}).encode()
    sent: list[dict] = []

    async def run() -> float:
        requests = [{"type": "http.request", "body": payload, "more_body": False}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await asyncio.Event().wait()  # no disconnect either
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            sent.append(message)
            if len(sent) >= 3:
                await asyncio.Event().wait()

        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [*headers, (HEADER.encode(), b"500")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 80),
        }
        t0 = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), 30)
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert took < 0.5 + 0.5 + SLACK_S, f"the stream outlived its deadline by {took - 0.5:.1f} s"
    assert_engine_free(backend)


# --------------------------------------------------------------------------- within the deadline, bad values


def test_a_request_within_its_deadline_is_unaffected(
    client: httpx.Client, backend: LocalEngineBackend
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=body)
    timed = client.post("/v1/completions", json=body, headers={HEADER: "30000"})
    assert plain.status_code == timed.status_code == 200, (plain.text, timed.text)
    assert timed.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert timed.json()["choices"][0]["finish_reason"] == "length"
    with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers={HEADER: "30000"}
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == plain.json()["choices"][0]["text"]
    assert_engine_free(backend)


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf", "", "1e400"])
def test_bad_timeout_header_is_a_400_naming_it(client: httpx.Client, value: str) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={HEADER: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == HEADER and HEADER in err["message"]


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_request_timeout_setting_is_checked(value: object) -> None:
    with pytest.raises(ValueError, match="request_timeout_s"):
        GatewaySettings(request_timeout_s=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--request-timeout-s", "0"], "--request-timeout-s"),
        (["--request-timeout-s", "-3"], "--request-timeout-s"),
        (["--worker-timeout-s", "0.2"], "--worker-timeout-s"),
    ],
)
def test_serve_flags_are_checked_before_start_up(argv: list[str], flag: str) -> None:
    args = _serve_parser().parse_args(["--model", "tiny", *argv])
    with pytest.raises(FlagError, match=flag):
        checked_cluster_config(args)


def test_serve_flags_reach_the_gateway_and_the_cluster() -> None:
    from gateway.commands.serve import _settings

    args = _serve_parser().parse_args(
        ["--model", "tiny", "--request-timeout-s", "12.5", "--worker-timeout-s", "9"]
    )
    config, _ = checked_cluster_config(args)
    assert config.worker_timeout_s == 9.0
    assert _settings(config, args).request_timeout_s == 12.5
    defaults = _serve_parser().parse_args([])
    assert defaults.request_timeout_s == GatewaySettings().request_timeout_s
    assert defaults.worker_timeout_s == ClusterConfig().worker_timeout_s


# --------------------------------------------------------------------------- through the Ray cluster

HUNG_S = 2.0  # the gateway replica's worker_timeout_s


@dataclass
class Cluster:
    url: str
    backend: RayClusterBackend  # the launcher's own handle: worker stats, controller state


@pytest.fixture(scope="module")
def cluster(ray_session) -> Iterator[Cluster]:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = cluster_config("disaggregated", "deadlines")
    backend = RayClusterBackend(config)
    try:
        # The replica connects to the cluster by actor name, as `bucketserve serve` does.
        factory = functools.partial(connect_backend, dataclasses.replace(config, worker_timeout_s=HUNG_S))
        app = build_app(
            GatewaySettings(backend_factory=factory), ray_actor_options={"num_cpus": 0}, name="gw-deadlines"
        )
        serve.run(app, name="deadlines", route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}", backend)
    finally:
        with contextlib.suppress(Exception):
            serve.delete("deadlines")
        asyncio.run(backend.shutdown())
        serve.shutdown()


def assert_cluster_clean(backend: RayClusterBackend) -> None:
    """Both workers idle with every block free, and the controller holds nothing for any request."""
    stats = asyncio.run(wait_idle(backend, timeout=20))
    for name, s in stats.items():
        assert s["kv_blocks_used"] == 0, f"{name} still holds {s['kv_blocks_used']} blocks"
        assert s["kv_blocks_free"] == s["kv_blocks_total"] == NUM_BLOCKS, name
        assert s["integrity_error"] is None, f"{name}: {s['integrity_error']}"
    state = asyncio.run(_controller_state_once_clean(backend, timeout=20))
    assert state["in_cluster"] == 0 and all(d["reserved"] == 0 for d in state["decode"].values()), state


async def _controller_state(backend: RayClusterBackend) -> dict:
    return await backend.handles.controller.state.remote()


def _controller_clean(state: dict) -> bool:
    return state["in_cluster"] == 0 and all(d["reserved"] == 0 for d in state["decode"].values())


async def _controller_state_once_clean(backend: RayClusterBackend, timeout: float) -> dict:
    """The controller's state once it holds nothing (or the last state at the timeout). The decode worker
    frees its blocks first and then tells the controller the request ended, so the controller's release can
    trail the workers' idle stats by a message."""
    deadline = time.monotonic() + timeout
    while True:
        state = await _controller_state(backend)
        if _controller_clean(state) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


CLUSTER_LONG = {"prompt": list(range(100, 120)), "max_tokens": 480, "ignore_eos": True}


@pytest.fixture(scope="module")
def deadline_ms(cluster: Cluster) -> int:
    """A deadline a quarter of CLUSTER_LONG's time without one (a fixed 1 s stopped being shorter than the run
    once the engine got faster)."""
    limit = quarter_of_a_run(cluster.url, CLUSTER_LONG)
    assert_cluster_clean(cluster.backend)
    return limit


def _stream_until_cut(c: httpx.Client, limit: str) -> list | None:
    """CLUSTER_LONG streamed under a ``limit`` ms deadline: its events, or None where the deadline passed before the
    first token (a 408 whose error names the limit)."""
    with c.stream(
        "POST", "/v1/completions", json={**CLUSTER_LONG, "stream": True}, headers={HEADER: limit}
    ) as s:
        if s.status_code == 408:
            s.read()
            assert_timeout_error(s.json()["error"], f"{HEADER}: {limit}")
            return None
        assert s.status_code == 200
        return sse_events(s.iter_lines())


@pytest.mark.slow
def test_cluster_request_past_its_deadline_is_a_408_and_frees_every_worker(
    cluster: Cluster, deadline_ms: int
) -> None:
    # Half a run: the first token leaves the prefill worker and the KV cache the decode worker's join before the
    # stream's next tokens, and on two busy cores a quarter of a run (246 ms) once let through the first alone.
    half_a_run = 2 * deadline_ms
    limit = str(half_a_run)
    with httpx.Client(base_url=cluster.url, timeout=60) as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=CLUSTER_LONG, headers={HEADER: limit})
        assert r.status_code == 408, r.text
        assert time.monotonic() - t0 < half_a_run / 1000 + SLACK_S
        assert_timeout_error(r.json()["error"], f"{HEADER}: {limit}")
        assert_cluster_clean(cluster.backend)

        # A stall before the first token (once over 400 ms on two busy cores, where the whole run took 800) can
        # outlast the deadline: that answer is a 408 naming the limit too, and the stream is tried again.
        events = None
        for _ in range(3):
            events = _stream_until_cut(c, limit)
            assert_cluster_clean(cluster.backend)
            if events is not None:
                break
        assert events is not None, "the first token came after the deadline three times"
        assert events[-1] == "[DONE]"
        # 480 tokens take twice the deadline (the JSON request above is the proof): the stream is cut.
        assert "error" in events[-2], (len(events), events[-3:])
        assert_timeout_error(events[-2]["error"], f"{HEADER}: {limit}")
        assert len(events) > 3, "tokens should stream before the deadline"
    assert_cluster_clean(cluster.backend)


@pytest.mark.slow
def test_cluster_request_queued_past_its_deadline_leaves_the_queue(
    cluster: Cluster, deadline_ms: int
) -> None:
    """While one request holds most of the decode worker's cache, a second as large cannot be placed: it waits in
    the controller's queue until its deadline, then is a 408 and is dequeued."""

    async def run() -> tuple[httpx.Response, list[dict]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as c:
            held = await c.send(
                c.build_request("POST", "/v1/completions", json={**CLUSTER_LONG, "stream": True}), stream=True
            )
            try:
                assert held.status_code == 200
                body = {**CLUSTER_LONG, "prompt": list(range(200, 220))}
                queued = asyncio.ensure_future(
                    c.post("/v1/completions", json=body, headers={HEADER: str(deadline_ms)})
                )
                states = []  # the controller's, while the second request waits
                while not queued.done():
                    states.append(await _controller_state(cluster.backend))
                    await asyncio.sleep(0.1)
                # Still holding the first: the second has left the controller (its abort runs right after the 408).
                for _ in range(50):
                    after = await _controller_state(cluster.backend)
                    if after["in_cluster"] == 1:
                        break
                    await asyncio.sleep(0.1)
                assert after["in_cluster"] == 1 and after["queued"] == 0, after
                return queued.result(), states
            finally:
                await held.aclose()

    queued, states = asyncio.run(run())
    assert queued.status_code == 408, queued.text
    assert_timeout_error(queued.json()["error"], f"{HEADER}: {deadline_ms}")
    # The first request's decode reservation left no room for the second, which sat in the queue.
    assert any(s["queued"] == 1 and s["in_cluster"] == 2 for s in states), states
    assert all(d["reserved"] > NUM_BLOCKS // 2 for d in states[0]["decode"].values()), states[0]
    assert_cluster_clean(cluster.backend)


def _pid(handle) -> int:
    import ray

    return ray.get(handle.__ray_call__.remote(lambda _: os.getpid()))


@pytest.mark.slow
def test_cluster_hung_decode_worker_is_declared_down_and_its_stream_ends(cluster: Cluster) -> None:
    """The decode worker's process is stopped (alive, deaf): within the gateway's worker_timeout_s its stream ends
    with an error chunk and [DONE]. Once it runs again it frees what it held. Runs last: the controller keeps the
    worker down."""
    ((decode_name, decode),) = cluster.backend.handles.by_role("decode").items()
    pid = _pid(decode)
    before = asyncio.run(cluster.backend.worker_stats())[decode_name]["output_tokens"]
    stopped = None
    try:
        with (
            httpx.Client(base_url=cluster.url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json={**CLUSTER_LONG, "stream": True}) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = [line for _, line in zip(range(6), lines, strict=False)]
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            events = sse_events(iter(seen + list(lines)))
            ended = time.monotonic() - stopped
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert "stopped answering" in err["message"] and "aborted" in err["message"], err
        assert ended < HUNG_S + 5.0, f"the stream ended {ended:.1f} s after the worker stopped"
    finally:
        if stopped is not None:
            os.kill(pid, signal.SIGCONT)
    stats = asyncio.run(wait_idle(cluster.backend, timeout=30))
    for name, s in stats.items():
        assert s["kv_blocks_used"] == 0, f"{name} still holds {s['kv_blocks_used']} blocks after waking up"
    # Woken up, it found the gateway's abort waiting: it did not run the request on to max_tokens.
    made = stats[decode_name]["output_tokens"] - before
    assert made < CLUSTER_LONG["max_tokens"] // 2, (
        f"{made} tokens decoded: the abort did not reach the worker"
    )
