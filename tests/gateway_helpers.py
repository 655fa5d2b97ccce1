"""Shared pieces of the gateway tests: the tiny-model backend, a real uvicorn server in a thread,
and SSE parsing."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from engine.config import CacheConfig, EngineConfig, SchedulerConfig

MAX_MODEL_LEN = 512


def tiny_config() -> EngineConfig:
    return EngineConfig(
        model="tiny",
        skip_warmup=True,
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=16),
    )


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Run ``app`` on a real uvicorn server on a free 127.0.0.1 port; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def sse_events(lines: Iterator[str]) -> list[Any]:
    """The data payloads of an SSE stream: parsed JSON objects, and the final "[DONE]" as a string."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def greedy_completions(
    url: str, prompts: list[str], max_tokens: list[int], timeout: float = 60
) -> list[dict]:
    """Send greedy completions concurrently, asking for chosen-token ids through logprobs; the JSON bodies."""

    async def one(c: httpx.AsyncClient, prompt: str, n: int) -> dict:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, max_tokens, strict=True)))

    return asyncio.run(run_all())
