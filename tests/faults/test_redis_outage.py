"""A Redis outage costs figures, never service: redis-server is killed (or frozen) and started again under load.

- The monitor on its own: through the outage every method answers from memory, quickly (the client's timeouts
  bound the calls that meet it first), `check()` names the outage, and once Redis is back new figures are
  written to it again, with the worker table restored at once.
- The cluster behind the HTTP gateway, its monitor on that Redis: a steady stream of greedy requests goes on
  while redis-server is killed and restarted on the same port (or frozen and resumed). Every request completes
  with Hugging Face's tokens, none takes long while Redis is gone, no KV block leaks, and `/metrics` reads
  Redis again afterwards.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cluster_helpers import NUM_BLOCKS, cluster_config, wait_idle
from gateway_helpers import serve_app
from monitor_helpers import request, worker
from prometheus_client.parser import text_string_to_metric_families
from redis_fixture import RedisProcess

from gateway.app import create_app
from gateway.cluster_backend import RayClusterBackend
from gateway.settings import GatewaySettings
from monitor import Monitor, MonitorConfig

# A call that meets the outage first pays one socket timeout (a refused connection is retried after a short
# backoff; a timed-out operation is not retried); later calls go straight to memory.
FIRST_CALL_BOUND_S = 2.5
# Under the 1 s socket timeout (MonitorConfig.redis_socket_timeout_s) that a later call would pay if it still
# touched Redis; a bound of 0.5 s failed once on a loaded 2-core host, where a call from memory waited for CPU.
LATER_CALL_BOUND_S = 0.9


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def _wait_until(what: str, cond: Callable[[], bool], timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def _finished_now() -> float:
    """The arrival time of a request (``request()``'s e2e_s) that finishes at this moment."""
    return time.time() - request("probe").e2e_s


def _outage_lines(mon: Monitor) -> list[str]:
    return [p for p in mon.check() if "store unreachable" in p]


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_monitor_answers_from_memory_while_redis_is_down(tmp_path: Path, fault: str) -> None:
    server = RedisProcess(tmp_path)
    url = server.start()
    prefix = f"outage-{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2)
    mon = Monitor(MonitorConfig.for_url(url, key_prefix=prefix, redis_reconnect_s=0.2))
    try:
        now = time.time()
        mon.report_worker(worker("decode-0", kv_blocks_used=10, kv_blocks_free=90, timestamp=now))
        assert mon.record_request(request("before", arrival=now))
        mon.set_buckets([0, 64, 512], [1, 2])
        assert raw.hexists(f"{prefix}:workers", "decode-0") and raw.exists(f"{prefix}:req:before")
        assert _outage_lines(mon) == []

        if fault == "kill":
            server.kill()  # gone, with every key (no persistence)
        else:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)  # hung: connections open, no answers
        # The first write to meet the outage pays the client's bounded timeouts, not redis-py's 5 s x retries.
        _, first = _timed(lambda: mon.report_worker(worker("decode-0", kv_blocks_used=60, kv_blocks_free=40)))
        assert first < FIRST_CALL_BOUND_S, f"the first call in the outage took {first:.2f} s"
        # Every method answers, from memory, at once: the latest figures, the outage named.
        calls = {
            # Finished (arrival + its 0.2 s latency) a second ago: a record finishing in the future falls in the
            # next series slot when "now" is within 0.2 s of a slot boundary, outside the dashboard's window.
            "record_request": lambda: mon.record_request(request("during", arrival=time.time() - 1.2)),
            "record_arrival": lambda: mon.record_arrival("online", 100),
            "summary": mon.summary,
            "metrics_text": lambda: mon.metrics_text("tiny"),
            "dashboard_data": lambda: mon.dashboard_data(300),
            "check": mon.check,
        }
        answers = {}
        for name, call in calls.items():
            answers[name], took = _timed(call)
            assert took < LATER_CALL_BOUND_S, f"{name} took {took:.2f} s in the outage"
        assert answers["record_request"] is True
        assert answers["summary"]["free_kv_blocks"] == {"decode-0": 40}, "heartbeats go on through the outage"
        assert answers["summary"]["buckets"]["boundaries"] == [0, 64, 512], "the bucket state is mirrored"
        assert "bucketserve:request_success_total" in answers["metrics_text"]
        # Degraded: the request series counts only what was written since the outage began.
        assert answers["dashboard_data"]["window_totals"]["online"]["requests"] == 1
        assert len(_outage_lines(mon)) == 1

        if fault == "kill":
            assert server.start() == url  # the same port, empty
        else:
            os.kill(server.proc.pid, signal.SIGCONT)
        _wait_until("the monitor uses Redis again", lambda: not _outage_lines(mon), 5.0)
        # The worker table and bucket state are written back at once, not at the next heartbeat.
        assert raw.hexists(f"{prefix}:workers", "decode-0")
        assert raw.exists(f"{prefix}:doc:buckets")
        # New figures go to Redis again.
        assert mon.record_request(request("after", arrival=time.time()))
        assert raw.exists(f"{prefix}:req:after")
        assert mon.summary()["free_kv_blocks"] == {"decode-0": 40}
    finally:
        if fault == "freeze" and server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        mon.close()
        raw.close()
        server.stop()


# --------------------------------------------------------------------------- the cluster under load

CLIENTS = 3
MAX_TOKENS = 8
BEFORE_S = 3.0
OUTAGE_S = 5.0
AFTER_S = 3.0
# Nothing waits on Redis: a request in the outage takes as long as one before it, far below this.
REQUEST_BOUND_S = 10.0
# A monitor call through Ray (and /metrics through the gateway) in the outage: well below one Redis timeout
# of redis-py's defaults (5 s), with room for a busy machine.
CLUSTER_CALL_BOUND_S = 1.0


@dataclass
class Sent:
    prompt: int
    phase: str
    started: float
    took: float
    status: int
    tokens: list[int]
    text: str


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def _redis_requests(raw: redis.Redis, prefix: str) -> float:
    """Finished requests in the Redis totals (every finish reason, every class)."""
    totals = raw.hgetall(f"{prefix}:totals")
    return sum(float(v) for k, v in totals.items() if k.startswith("req|"))  # type: ignore[union-attr]


def _success_total(text: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "bucketserve:request_success"
        for s in family.samples
    )


class _Outage:
    """Takes Redis away and brings it back: ``kill`` (gone, then started empty on the same port) or ``freeze``
    (SIGSTOP: connections stay open and nothing answers, then SIGCONT with its data)."""

    def __init__(self, server: RedisProcess, fault: str) -> None:
        self.server = server
        self.fault = fault

    def begin(self) -> None:
        if self.fault == "kill":
            self.server.kill()
        else:
            assert self.server.proc is not None
            os.kill(self.server.proc.pid, signal.SIGSTOP)

    def end(self) -> None:
        if self.fault == "kill":
            url = self.server.url
            assert self.server.start() == url
        elif self.server.proc is not None and self.server.proc.poll() is None:
            os.kill(self.server.proc.pid, signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_cluster_serves_through_a_redis_outage(ray_session, tmp_path: Path, hf_reference, fault: str) -> None:
    server = RedisProcess(tmp_path)
    url = server.start()
    outage = _Outage(server, fault)
    prefix = f"cluster-outage-{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2)
    monitor_config = MonitorConfig.for_url(url, key_prefix=prefix, redis_reconnect_s=0.5)
    backend = RayClusterBackend(cluster_config("disaggregated", f"redis-{fault}", monitor=monitor_config))
    prompts = _prompts(4)
    reference = [hf_reference("tiny", "cpu").greedy(p, MAX_TOKENS, ignore_eos=True) for p in prompts]
    phase = {"now": "before"}
    sent: list[Sent] = []
    marks: dict[str, float] = {}

    async def client(c: httpx.AsyncClient, k: int) -> None:
        i = k
        while phase["now"] != "done":
            p = i % len(prompts)
            i += 1
            body = {
                "prompt": prompts[p],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            at, started = phase["now"], time.monotonic()
            r = await c.post("/v1/completions", json=body)
            took = time.monotonic() - started
            tokens: list[int] = []
            text = r.text
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            sent.append(Sent(p, at, started, took, r.status_code, tokens, text))

    async def monitor_call(name: str, *args: Any) -> tuple[Any, float]:
        t0 = time.monotonic()
        out = await asyncio.wait_for(getattr(backend.handles.monitor, name).remote(*args), 30)
        return out, time.monotonic() - t0

    async def redis_used_again() -> float:
        t0 = time.monotonic()
        while True:
            problems, _ = await monitor_call("check")
            if not any("store unreachable" in p for p in problems) and raw.hlen(f"{prefix}:workers") == 2:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < 15, f"the monitor did not use Redis again: {problems}"
            await asyncio.sleep(0.1)

    async def drive(base: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            clients = [asyncio.ensure_future(client(c, k)) for k in range(CLIENTS)]
            try:
                await asyncio.sleep(BEFORE_S)
                assert raw.hlen(f"{prefix}:workers") == 2, "the workers report to Redis before the outage"
                outage.begin()
                phase["now"] = "outage"
                # Past the first calls' timeouts, the monitor answers (from memory) and names the outage; /metrics
                # answers too.
                await asyncio.sleep(1.5)
                problems, took = await monitor_call("check")
                assert any("store unreachable" in p for p in problems), problems
                assert took < CLUSTER_CALL_BOUND_S, f"check took {took:.2f} s in the outage"
                t0 = time.monotonic()
                assert (await c.get("/metrics")).status_code == 200
                took = time.monotonic() - t0
                assert took < CLUSTER_CALL_BOUND_S, f"/metrics took {took:.2f} s in the outage"
                await asyncio.sleep(OUTAGE_S - 1.5)
                outage.end()
                phase["now"] = "after"
                marks["recovered_in"] = await redis_used_again()
                phase["now"] = "recovered"
                await asyncio.sleep(AFTER_S)
            finally:
                phase["now"] = "done"
                await asyncio.gather(*clients)
            # Every request that started once the monitor used Redis again is recorded there (records are
            # fire-and-forget, so they may trail the answers a little), and /metrics reads it from there.
            recovered = sum(s.phase == "recovered" for s in sent)
            t0 = time.monotonic()
            while True:
                in_redis = _redis_requests(raw, prefix)
                on_metrics = _success_total((await c.get("/metrics")).text)
                if in_redis >= recovered and on_metrics == in_redis == _redis_requests(raw, prefix):
                    break
                assert time.monotonic() - t0 < 10, (
                    f"{recovered} requests served since Redis came back; Redis holds {in_redis}, "
                    f"/metrics shows {on_metrics}"
                )
                await asyncio.sleep(0.2)
            marks["in_redis_after"] = in_redis

    try:
        with serve_app(create_app(backend, GatewaySettings())) as base:
            asyncio.run(drive(base))
        stats = asyncio.run(wait_idle(backend, timeout=30))
        state = asyncio.run(asyncio.wait_for(backend.handles.controller.state.remote(), 30))
    finally:
        if fault == "freeze":
            outage.end()  # never leave a stopped process behind
        asyncio.run(backend.shutdown())
        raw.close()
        server.stop()

    by_phase = {p: [s for s in sent if s.phase == p] for p in ("before", "outage", "after", "recovered")}
    print(
        {p: len(v) for p, v in by_phase.items()},
        {p: round(max((s.took for s in v), default=0.0), 3) for p, v in by_phase.items()},
        marks,
    )
    counts = {p: len(v) for p, v in by_phase.items()}
    assert all(counts[p] for p in ("before", "outage", "recovered")), f"requests per phase: {counts}"
    assert len(by_phase["outage"]) >= CLIENTS * 2, "a steady stream went on through the outage"
    for s in sent:
        assert s.status == 200, f"{s.phase} request failed: {s.status} {s.text[:300]}"
        assert s.tokens == reference[s.prompt], f"{s.phase} request for prompt {s.prompt}: {s.tokens}"
        assert s.took < REQUEST_BOUND_S, f"a {s.phase} request took {s.took:.1f} s"
    # Redis holds the requests served since the monitor went back to it; restarted empty, no more than those
    # served since it came back: the outage's figures stayed in memory.
    assert marks["in_redis_after"] >= len(by_phase["recovered"])
    if fault == "kill":
        # Records are written after their answers, in the background: those of the last requests of the outage
        # (one per client at most) may land just after the restart. The rest of the outage's never reach Redis.
        assert marks["in_redis_after"] <= len(by_phase["after"] + by_phase["recovered"]) + CLIENTS
    for name, s in stats.items():
        assert s["kv_blocks_used"] == 0, f"{name} still holds {s['kv_blocks_used']} blocks"
        assert s["kv_blocks_free"] + s["kv_blocks_used"] == s["kv_blocks_total"] == NUM_BLOCKS, (name, s)
        assert s["integrity_error"] is None, f"{name}: {s['integrity_error']}"
    assert state["in_cluster"] == 0 and state["queued"] == 0, state
