"""``bucketserve bench monitor``: what recording costs, Redis store vs in-memory store, in one run.

Two figures per store, measured in the same process on the same engine:

* **Gateway requests/s.** The same short completions (``--num-requests`` prompts, ``--max-tokens``
  each, all in flight at once by default) go over HTTP through the gateway to one in-process engine
  whose monitor uses that store. Every request writes an arrival and a request record, and the engine
  heartbeats its worker stats, exactly as when serving. Rounds alternate the stores so that drift of a
  shared machine hits both alike; the median round is reported.
* **record_request/s.** ``Monitor.record_request`` alone, called back to back with records shaped like
  the gateway's: the raw cost of one write to the store.

Redis is a private ``redis-server`` started on a free loopback port (no persistence) unless
``--redis-url`` names one; then keys go under a fresh prefix that is deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.server_process import free_port

logger = logging.getLogger(__name__)

STORES = ("memory", "redis")


def register(sub) -> None:
    from engine.args import add_engine_args

    p = sub.add_parser(
        "monitor", help="recording overhead: gateway requests/s with the Redis vs memory store"
    )
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=64, help="completions per round")
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per completion")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per store, alternating")
    p.add_argument("--records", type=int, default=2000, help="record_request calls per store")
    p.add_argument("--redis-url", default=None, help="an existing Redis (default: start a private one)")
    p.add_argument("--json", action="store_true", help="print only the final JSON line")
    p.add_argument("--out", default="bench/results/monitor_overhead", help="report path (without extension)")
    p.set_defaults(func=run, model="tiny")


# --------------------------------------------------------------------------- redis


@contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "redis-server not found: install it (apt-get install redis-server) or pass --redis-url"
        )
    with tempfile.TemporaryDirectory(prefix="bucketserve-redis-") as workdir:
        port = free_port()
        args = [
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ]
        proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            client = redis.Redis.from_url(url)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None:
                        raise SystemExit(
                            f"redis-server exited with {proc.returncode} on port {port}"
                        ) from None
                    time.sleep(0.05)
            else:
                raise SystemExit(f"redis-server did not answer on port {port} within 10 s")
            client.close()
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def drop_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=prefix + ":*", count=1000))
        for i in range(0, len(keys), 1000):
            client.delete(*keys[i : i + 1000])
    finally:
        client.close()


# --------------------------------------------------------------------------- gateway


@contextmanager
def http_gateway(app: Any) -> Iterator[str]:
    """``app`` on uvicorn in a background thread, on a free loopback port; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(400):
            if server.started:
                break
            if not thread.is_alive():
                raise RuntimeError("the gateway's HTTP server stopped while starting")
            time.sleep(0.025)
        else:
            raise RuntimeError("the gateway's HTTP server did not start within 10 s")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


async def burst(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> float:
    """Send every prompt (at most ``concurrency`` at once); seconds from the first send to the last reply."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one(i: int, prompt: str) -> None:
            body = {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                # Both classes, as in service: each is accounted separately.
                "priority": "online" if i % 2 == 0 else "offline",
            }
            async with gate:
                r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"request {i} failed: HTTP {r.status_code} {r.text[:200]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t0


def gateway_round(engine: Any, monitor: Any, prompts: list[str], args: argparse.Namespace) -> float:
    """One measured burst through a fresh gateway whose backend reports to ``monitor``; requests/s."""
    from gateway.app import create_app
    from gateway.local_backend import LocalEngineBackend
    from gateway.settings import GatewaySettings

    backend = LocalEngineBackend(engine=engine, model_name=args.model, monitor=monitor)
    try:
        with http_gateway(create_app(backend, GatewaySettings())) as url:
            concurrency = args.concurrency or len(prompts)
            # Connections, the event loop and the store's client warm up outside the measurement.
            asyncio.run(burst(url, prompts[: min(8, len(prompts))], args.max_tokens, concurrency))
            # A full collection of the previous round's garbage would stall whichever round it hit.
            gc.collect()
            gc.freeze()
            try:
                seconds = asyncio.run(burst(url, prompts, args.max_tokens, concurrency))
            finally:
                gc.unfreeze()
            if not backend.wait_idle(60):
                raise RuntimeError("the engine did not go idle after the burst")
    finally:
        backend.close()
    return len(prompts) / seconds


# --------------------------------------------------------------------------- raw record rate


def record_rate(monitor: Any, n: int, tag: str) -> float:
    """``record_request`` calls per second, with records shaped like the gateway's."""
    from monitor.records import RequestRecord

    now = time.time()
    records = [
        RequestRecord(
            request_id=f"bench-{tag}-{i}",
            arrival=now,
            priority_class="online" if i % 2 == 0 else "offline",
            prompt_tokens=16 + i % 64,
            output_tokens=4,
            finish_reason="length",
            slo_met=i % 7 != 0,
            queue_s=0.001 * (i % 11),
            ttft_s=0.02 + 0.001 * (i % 37),
            tpot_s=0.005 + 0.0001 * (i % 13),
            e2e_s=0.05 + 0.001 * (i % 29),
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    for rec in records:
        monitor.record_request(rec)
    return n / (time.perf_counter() - t0)


# --------------------------------------------------------------------------- command


def measure(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    from engine.config import config_from_args
    from engine.llm_engine import LLMEngine
    from monitor import Monitor, MonitorConfig

    engine = LLMEngine(config_from_args(args))
    prompts = [f"Request {i}: summarise the weather report for day {i}." for i in range(args.num_requests)]
    prefix = f"bench-monitor-{time.time_ns()}"
    configs = {
        "memory": MonitorConfig(),
        "redis": MonitorConfig.for_url(redis_url, key_prefix=prefix),
    }
    rps: dict[str, list[float]] = {s: [] for s in STORES}
    records: dict[str, float] = {}
    try:
        for r in range(args.rounds):
            # Alternate which store goes first, so neither always runs on a warmer machine.
            for store in STORES if r % 2 == 0 else STORES[::-1]:
                monitor = Monitor(configs[store])
                try:
                    rps[store].append(gateway_round(engine, monitor, prompts, args))
                finally:
                    monitor.close()
                if not args.json:
                    print(f"round {r + 1}/{args.rounds} {store:6s}: {rps[store][-1]:.1f} req/s", flush=True)
        for store in STORES:
            monitor = Monitor(configs[store])
            try:
                records[store] = record_rate(monitor, args.records, store)
            finally:
                monitor.close()
    finally:
        drop_prefix(redis_url, prefix)
    memory_rps, redis_rps = (statistics.median(rps[s]) for s in STORES)
    return {
        "model": args.model,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency or args.num_requests,
        "rounds": args.rounds,
        "memory_rps": round(memory_rps, 2),
        "redis_rps": round(redis_rps, 2),
        # Below 1: the Redis store costs gateway throughput; 1: recording is free at this load.
        "ratio": round(redis_rps / memory_rps, 3),
        "rounds_rps": {s: [round(v, 2) for v in rps[s]] for s in STORES},
        "record_request_per_s": {s: round(records[s], 1) for s in STORES},
        "record_request_us": {s: round(1e6 / records[s], 1) for s in STORES},
        "records": args.records,
    }


def run(args: argparse.Namespace) -> int:
    from bench.report import write_report

    for name in ("num_requests", "max_tokens", "rounds", "records"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit(f"--concurrency must be >= 1, got {args.concurrency}")
    logging.getLogger("gateway").setLevel(logging.WARNING)
    if args.redis_url:
        result = measure(args, args.redis_url)
    else:
        with private_redis() as url:
            result = measure(args, url)
    table = [
        ("store", "gateway req/s (median)", "rounds", "record_request/s", "µs per record"),
        *(
            (
                s,
                f"{result[f'{s}_rps']:.1f}",
                ", ".join(f"{v:.1f}" for v in result["rounds_rps"][s]),
                f"{result['record_request_per_s'][s]:.0f}",
                f"{result['record_request_us'][s]:.1f}",
            )
            for s in STORES
        ),
    ]
    path = write_report(args.out, "Monitor recording overhead: Redis vs memory store", result, table)
    if not args.json:
        for row in table:
            print(" | ".join(row))
        print(f"report: {path}")
    print(json.dumps(result))
    return 0
