"""Gateways on the Redis monitor store, against a real redis-server and the real tiny model.

Two gateways (each its own engine and its own Monitor) sharing one Redis show one view: the
requests either served, both engines in the worker table, the same cumulative counters on both
`/metrics`. A gateway that is stopped and started again reads its history back from Redis. And
`/metrics` from a gateway parses with prometheus_client's own parser, with every family named by
the metrics contract and `model_name` on every sample.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from gateway_helpers import serve_app, tiny_config
from prometheus_client.parser import text_string_to_metric_families
from redis_fixture import redis_server  # noqa: F401 - the fixture, used by name

from gateway.app import create_app
from gateway.local_backend import LocalEngineBackend
from gateway.settings import GatewaySettings
from monitor import Monitor, MonitorConfig, metrics

# Each test writes under its own key prefix, so tests sharing the server never see each other.
_prefixes = itertools.count()


def _config(redis_url: str) -> MonitorConfig:
    return MonitorConfig.for_url(redis_url, key_prefix=f"gwtest{next(_prefixes)}-{time.time_ns()}")


@contextmanager
def gateway(config: MonitorConfig, worker_id: str) -> Iterator[str]:
    """A whole gateway process's worth: engine, monitor on the given store, HTTP server."""
    monitor = Monitor(config)
    backend = LocalEngineBackend(tiny_config(), monitor=monitor, worker_id=worker_id, stats_interval_s=0.2)
    try:
        with serve_app(create_app(backend, GatewaySettings())) as url:
            yield url
    finally:
        backend.close()
        monitor.close()


def send(url: str, priorities: list[str], max_tokens: int = 3) -> None:
    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:

            async def one(i: int, priority: str) -> int:
                body = {"prompt": f"request {i} of the batch", "max_tokens": max_tokens, "priority": priority}
                return (await c.post("/v1/completions", json=body)).status_code

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(priorities)))

    assert asyncio.run(run()) == [200] * len(priorities)


def window_totals(url: str) -> dict[str, int]:
    data = httpx.get(f"{url}/dashboard/data", params={"window_s": 300}, timeout=30).json()
    return {cls: t["requests"] for cls, t in data["window_totals"].items()}


def wait_for_totals(url: str, expected: dict[str, int], timeout_s: float = 10.0) -> dict[str, int]:
    """Requests are recorded as their responses finish, which can trail the client by a moment."""
    deadline = time.monotonic() + timeout_s
    seen = window_totals(url)
    while seen != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = window_totals(url)
    return seen


def parse(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def successes(url: str) -> dict[str, float]:
    """bucketserve:request_success_total per priority class, summed over finish reasons."""
    samples = parse(httpx.get(f"{url}/metrics", timeout=30).text)["bucketserve:request_success"]
    out: dict[str, float] = {}
    for s in samples:
        out[s.labels["priority_class"]] = out.get(s.labels["priority_class"], 0.0) + s.value
    return out


def test_two_gateways_share_one_view(redis_server: str) -> None:  # noqa: F811
    config = _config(redis_server)
    with gateway(config, "gw-a") as a, gateway(config, "gw-b") as b:
        send(a, ["online", "online", "offline"])
        send(b, ["offline", "online"])
        expected = {"online": 3, "offline": 2}
        assert wait_for_totals(a, expected) == expected
        assert window_totals(b) == expected
        assert successes(a) == successes(b) == {"online": 3.0, "offline": 2.0}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = httpx.get(f"{b}/dashboard/data", timeout=30).json()
            if [w["worker_id"] for w in data["workers"]] == ["gw-a", "gw-b"]:
                break
            time.sleep(0.1)
        assert [(w["worker_id"], w["up"]) for w in data["workers"]] == [("gw-a", True), ("gw-b", True)]
        # A third reader (the dashboard or controller side) on the same store sees the same.
        reader = Monitor(config)
        try:
            assert {
                c: t["requests"] for c, t in reader.dashboard_data(300)["window_totals"].items()
            } == expected
        finally:
            reader.close()


def test_a_restarted_gateway_reads_its_history_back(redis_server: str) -> None:  # noqa: F811
    config = _config(redis_server)
    with gateway(config, "gw-a") as first:
        send(first, ["online", "offline", "offline", "online", "online"])
        before = wait_for_totals(first, {"online": 3, "offline": 2})
        assert before == {"online": 3, "offline": 2}
        metrics_before = successes(first)
    # Everything of the first gateway is gone now: engine, monitor, server.
    with gateway(config, "gw-a") as second:
        assert window_totals(second) == before
        assert successes(second) == metrics_before == {"online": 3.0, "offline": 2.0}
        text = httpx.get(f"{second}/metrics", timeout=30).text
        ttft = parse(text)["bucketserve:time_to_first_token_seconds"]
        assert sum(s.value for s in ttft if s.name.endswith("_count")) == 5
        # New traffic adds to the history rather than starting over.
        send(second, ["offline"])
        assert wait_for_totals(second, {"online": 3, "offline": 3}) == {"online": 3, "offline": 3}
        assert successes(second) == {"online": 3.0, "offline": 3.0}


# The families the metrics contract names, as operators graph them; each must carry model_name.
CONTRACT = (
    "bucketserve:time_to_first_token_seconds",
    "bucketserve:inter_token_latency_seconds",
    "bucketserve:e2e_request_latency_seconds",
    "bucketserve:request_queue_time_seconds",
    "bucketserve:num_requests_running",
    "bucketserve:num_requests_waiting",
    "bucketserve:kv_cache_usage_perc",
    "bucketserve:prompt_tokens",
    "bucketserve:generation_tokens",
    "bucketserve:request_success",
    "bucketserve:kv_transfer_latency_seconds",
    "bucketserve:kv_transfer_bytes",
    "bucketserve:slo_attainment_ratio",
    "bucketserve:bucket_count",
    "bucketserve:bucket_queue_depth",
    "bucketserve:padding_waste_ratio",
    "bucketserve:runtime_compilations",
    "bucketserve:batch_size",
)
# Families fed by the cluster's controller, workers and transports; everything else in the contract
# one engine behind the gateway feeds by itself.
FED_BY_THE_CLUSTER = {
    "bucketserve:request_queue_time_seconds",
    "bucketserve:kv_transfer_latency_seconds",
    "bucketserve:kv_transfer_bytes",
    "bucketserve:bucket_count",
    "bucketserve:bucket_queue_depth",
    "bucketserve:padding_waste_ratio",
    "bucketserve:batch_size",
}
FED_BY_A_SINGLE_ENGINE = tuple(n for n in CONTRACT if n not in FED_BY_THE_CLUSTER)


def test_gateway_metrics_parse_with_model_name_everywhere(redis_server: str) -> None:  # noqa: F811
    with gateway(_config(redis_server), "gw-m") as url:
        send(url, ["online", "offline"], max_tokens=5)
        wait_for_totals(url, {"online": 1, "offline": 1})
        time.sleep(0.5)  # a heartbeat after the requests, so the worker gauges are present
        resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    missing = [n for n in (*CONTRACT, *metrics.METRIC_NAMES) if n not in families]
    assert not missing, f"families missing from /metrics: {missing}"
    unlabelled = [
        (f.name, s.name, s.labels)
        for f in families.values()
        for s in f.samples
        if s.labels.get("model_name") != "tiny"
    ]
    assert not unlabelled, f"samples without model_name='tiny': {unlabelled[:5]}"
    empty = [n for n in FED_BY_A_SINGLE_ENGINE if not families[n].samples]
    assert not empty, f"families without samples after traffic: {empty}"
    assert families["bucketserve:num_requests_running"].samples[0].labels["worker_id"] == "gw-m"
    prompt = {s.labels["priority_class"]: s.value for s in families["bucketserve:prompt_tokens"].samples}
    assert prompt["online"] > 0 and prompt["offline"] > 0
