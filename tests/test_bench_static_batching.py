"""The static batching baseline of ``bench sweep`` (:mod:`bench.baselines.static_batching`) behind the real HTTP
gateway on the tiny model: per request, the greedy tokens of a batched, left-padded ``generate`` are Hugging
Face's for that prompt alone."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import HFReference
from gateway_helpers import greedy_completions, serve_app, sse_events

from bench.baselines.static_batching import StaticBatchBackend
from gateway.app import create_app
from gateway.settings import GatewaySettings

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog and then",
    "In a distant land, long ago, " * 6,
    "1 2 3 4 5",
]


@pytest.fixture(scope="module")
def backend() -> Iterator[StaticBatchBackend]:
    # A long wait so that concurrent requests surely share one batch.
    b = StaticBatchBackend("tiny", batch_size=4, max_wait_ms=500, max_model_len=512)
    yield b
    b.close()


@pytest.fixture(scope="module")
def url(backend: StaticBatchBackend) -> Iterator[str]:
    with serve_app(create_app(backend, GatewaySettings())) as u:
        yield u


@pytest.fixture(scope="module")
def hf(backend: StaticBatchBackend, hf_reference) -> HFReference:
    return hf_reference(backend.model_info().path, "cpu")


def _token_ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_batched_greedy_equals_hf_generate_per_request(
    url: str, backend: StaticBatchBackend, hf: HFReference
) -> None:
    max_tokens = [12, 5, 20, 9]
    batches_before = len(backend.batch_sizes)

    results = greedy_completions(url, PROMPTS, max_tokens, timeout=120)
    # The four requests ran as one padded batch of mixed lengths, not one by one.
    assert backend.batch_sizes[batches_before:] == [4]
    for prompt, n, res in zip(PROMPTS, max_tokens, results, strict=True):
        prompt_ids = hf.tokenizer(prompt).input_ids
        expected = hf.greedy(prompt_ids, n)
        choice = res["choices"][0]
        assert _token_ids(choice) == expected
        assert choice["text"] == hf.tokenizer.decode(expected, skip_special_tokens=True)
        assert res["usage"]["completion_tokens"] == len(expected)
        assert choice["finish_reason"] == ("length" if len(expected) == n else "stop")
        assert all(isinstance(lp, float) and lp <= 0 for lp in choice["logprobs"]["token_logprobs"])


def test_streaming_returns_every_token_with_ignore_eos(url: str, hf: HFReference) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 24
    text = "".join(ch["text"] for e in events[:-1] for ch in e.get("choices", []))
    expected = hf.greedy(hf.tokenizer(PROMPTS[1]).input_ids, 24)
    if hf.tokenizer.eos_token_id not in expected:  # otherwise HF stopped early where ignore_eos goes on
        assert text == hf.tokenizer.decode(expected, skip_special_tokens=True)


def test_sampling_and_overlong_prompts_are_400s(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0.7}
        )
        assert r.status_code == 400 and "greedy" in r.text
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 600, "max_tokens": 4})
        assert r.status_code == 400 and "max_model_len" in r.text


def test_health_reports_ready(url: str) -> None:
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["ready"] is True
