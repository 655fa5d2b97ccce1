"""The HTTP gateway end to end on a real uvicorn server over the in-process engine with the real
tiny model: greedy equality with Hugging Face, SSE, usage, chat template, stop strings, the OpenAI
client, bad input, API keys, admission (429), client disconnects and the operator endpoints."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest
from conftest import HFReference
from gateway_helpers import MAX_MODEL_LEN, greedy_completions, serve_app, sse_events, tiny_config

from gateway.app import create_app
from gateway.local_backend import LocalEngineBackend
from gateway.settings import GatewaySettings

API_KEY = "s3cret-key"


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


@pytest.fixture(scope="module")
def hf(backend: LocalEngineBackend, hf_reference) -> HFReference:
    return hf_reference(backend.model_info().path, "cpu")


@pytest.fixture(autouse=True)
def no_leaks(backend: LocalEngineBackend) -> Iterator[None]:
    """Every test leaves the engine idle with no KV block held."""
    yield
    assert backend.wait_idle(30), "requests still in flight after the test"
    backend.inspect(lambda e: e.check_integrity())
    assert backend.inspect(lambda e: e.allocator.num_used) == 0


def token_ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog and then",
    "In a distant land, long ago, " * 6,
    "1 2 3 4 5",
]


# --------------------------------------------------------------------------- correctness


def test_greedy_completions_equal_hf_generate(url: str, hf: HFReference) -> None:
    """Concurrent greedy requests of mixed lengths give HF generate's tokens and text."""
    max_tokens = [12, 5, 20, 9]

    results = greedy_completions(url, PROMPTS, max_tokens, timeout=60)
    for prompt, n, res in zip(PROMPTS, max_tokens, results, strict=True):
        prompt_ids = hf.tokenizer(prompt).input_ids
        expected = hf.greedy(prompt_ids, n)
        choice = res["choices"][0]
        assert token_ids(choice) == expected
        assert choice["text"] == hf.tokenizer.decode(expected, skip_special_tokens=True)
        assert res["usage"] == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(expected),
            "total_tokens": len(prompt_ids) + len(expected),
        }
        assert choice["finish_reason"] == ("length" if len(expected) == n else "stop")
        assert all(isinstance(lp, float) and lp <= 0 for lp in choice["logprobs"]["token_logprobs"])


def test_prompt_lists_and_token_ids(client: httpx.Client, hf: HFReference) -> None:
    ids = hf.tokenizer(PROMPTS[1]).input_ids
    r = client.post(
        "/v1/completions",
        json={"prompt": [PROMPTS[0], PROMPTS[3]], "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c, p in zip(body["choices"], [PROMPTS[0], PROMPTS[3]], strict=True):
        pids = hf.tokenizer(p).input_ids
        assert c["text"] == hf.tokenizer.decode(hf.greedy(pids, 6), skip_special_tokens=True)
    r = client.post("/v1/completions", json={"prompt": [ids, ids[:3]], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [hf.tokenizer.decode(hf.greedy(p, 4), skip_special_tokens=True) for p in (ids, ids[:3])]
    assert r.json()["usage"]["prompt_tokens"] == len(ids) + 3
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert r.json()["choices"][0]["text"] == texts[0]


def test_echo_returns_prompt_then_completion(client: httpx.Client) -> None:
    base = client.post(
        "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0}
    ).json()
    r = client.post(
        "/v1/completions",
        json={"prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1},
    ).json()
    choice = r["choices"][0]
    assert choice["text"] == PROMPTS[1] + base["choices"][0]["text"]
    lp = choice["logprobs"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 5
    assert lp["token_logprobs"][:n_prompt] == [None] * n_prompt
    assert all(x is not None for x in lp["token_logprobs"][n_prompt:])


def test_streaming_sse_matches_non_streaming(client: httpx.Client) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    text_chunks = chunks[:-1]
    assert len(text_chunks) > 1, "tokens must arrive as they are made, not in one piece"
    assert all(c["object"] == "text_completion" and c["id"] == text_chunks[0]["id"] for c in text_chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])


def test_stop_strings_cut_text_streaming_and_not(client: httpx.Client) -> None:
    base = {"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    assert len(full) > 12, full
    # A stop string from the middle of the greedy text: the answer must end right before it.
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    expected = full[: full.find(stop)]
    r = client.post("/v1/completions", json={**base, "stop": [stop, "\u0000never"]}).json()
    assert r["choices"][0]["text"] == expected
    assert r["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**base, "stop": stop, "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == expected
    assert stop not in "".join(texts)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_chat_uses_the_chat_template(client: httpx.Client, hf: HFReference) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
    ]
    as_text = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    templated = hf.tokenizer.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True)
    ids = hf.tokenizer(templated, add_special_tokens=False).input_ids
    expected = hf.greedy(ids, 7)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": hf.tokenizer.decode(expected, skip_special_tokens=True),
    }
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(expected)
    # max_completion_tokens is the newer name of the same limit.
    r2 = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 3, "temperature": 0}
    )
    assert r2.json()["usage"]["completion_tokens"] == 3


def test_openai_client_works_unchanged(url: str, hf: HFReference) -> None:
    import openai  # a dev extra: missing means a broken set-up, not a skip

    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    comp = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    expected_ids = hf.greedy(hf.tokenizer(PROMPTS[0]).input_ids, 6)
    assert comp.choices[0].text == hf.tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert comp.usage.completion_tokens == 6
    stream = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    whole = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10, temperature=0
    )
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)


# --------------------------------------------------------------------------- bad input

BAD_COMPLETIONS = [
    (b"{not json", 400, None, "malformed JSON"),
    (b"", 400, None, "empty"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"prompt": ""}), 400, "prompt", "empty"),
    (json.dumps({"prompt": []}), 400, "prompt", "prompt"),
    (json.dumps({"prompt": [[]]}), 400, "prompt", "empty"),
    (json.dumps({"prompt": ["a", 3]}), 400, "prompt", "mixed"),
    (json.dumps({"max_tokens": 4}), 400, "prompt", "required"),
    (json.dumps({"prompt": "hi", "max_tokens": -3}), 400, "max_tokens", ">= 1"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens", ">= 1"),
    (json.dumps({"prompt": "hi", "max_tokens": "ten"}), 400, "max_tokens", "integer"),
    (json.dumps({"prompt": "hi", "max_tokens": True}), 400, "max_tokens", "integer"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}), 400, "temperature", "number"),
    (json.dumps({"prompt": "hi", "temperature": -1}), 400, "temperature", "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}), 400, "top_p", "top_p"),
    (json.dumps({"prompt": "hi", "stream": "yes"}), 400, "stream", "bool"),
    (json.dumps({"prompt": "hi", "n": 2}), 400, "n", "n=1"),
    (json.dumps({"prompt": "hi", "stop": ""}), 400, "stop", "empty"),
    (json.dumps({"prompt": "hi", "stop": 5}), 400, "stop", "stop"),
    (json.dumps({"prompt": "hi", "logprobs": 50}), 400, "logprobs", "<= 20"),
    (json.dumps({"prompt": [10**9]}), 400, "prompt", "vocabulary"),
    (json.dumps({"prompt": "hi", "priority": "urgent"}), 400, "priority", "online"),
    (json.dumps({"prompt": "hi", "priority_level": "high"}), 400, "priority_level", "integer"),
    (json.dumps({"prompt": "hi", "model": "no-such-model"}), 404, "model", "no-such-model"),
    (
        json.dumps({"prompt": "word " * (MAX_MODEL_LEN + 10)}),
        400,
        "prompt",
        f"max_model_len is {MAX_MODEL_LEN}",
    ),
    (json.dumps({"prompt": "hello", "max_tokens": MAX_MODEL_LEN}), 400, "max_tokens", str(MAX_MODEL_LEN)),
]


@pytest.mark.parametrize(("raw", "status", "param", "fragment"), BAD_COMPLETIONS)
def test_bad_completion_input_is_a_4xx_naming_the_problem(
    client: httpx.Client, raw: str | bytes, status: int, param: str | None, fragment: str
) -> None:
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert fragment.lower() in err["message"].lower()
    if status == 404:
        assert err["code"] == "model_not_found"


BAD_CHAT = [
    (json.dumps({"messages": []}), "messages", "at least one"),
    (json.dumps({"messages": "hi"}), "messages", "array"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "messages.0.role", "user"),
    (json.dumps({"messages": [{"content": "x"}]}), "messages.0.role", "required"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}), "max_tokens", ">= 1"),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": MAX_MODEL_LEN}),
        "max_completion_tokens",
        "max_model_len",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "go " * MAX_MODEL_LEN}]}),
        "messages",
        "max_model_len",
    ),
]


@pytest.mark.parametrize(("raw", "param", "fragment"), BAD_CHAT)
def test_bad_chat_input_is_a_400_naming_the_field(
    client: httpx.Client, raw: str, param: str, fragment: str
) -> None:
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert fragment.lower() in err["message"].lower()


def test_bad_headers_are_400s(client: httpx.Client) -> None:
    for name, value in [("x-priority", "soon"), ("x-slo-ttft-ms", "-5"), ("x-slo-tpot-ms", "fast")]:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={name: value})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == name


def test_unknown_route_and_method_use_the_error_shape(client: httpx.Client) -> None:
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_request_id_is_echoed_or_generated(client: httpx.Client) -> None:
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "abc-123"}
    )
    assert r.headers["x-request-id"] == "abc-123"
    r = client.post("/v1/completions", json={"prompt": ""})
    assert r.status_code == 400 and len(r.headers["x-request-id"]) >= 16


def test_priority_and_slo_reach_the_engine(client: httpx.Client, backend: LocalEngineBackend) -> None:
    seen = []
    original = backend.engine.add_request

    def spy(req):  # runs on the engine thread
        # The API level (higher = more urgent) is the engine priority (smaller first) negated.
        seen.append((req.priority_class.value, -req.priority, req.slo_ttft_ms, req.slo_tpot_ms))
        return original(req)

    backend.engine.add_request = spy  # type: ignore[method-assign]
    try:
        client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 1, "priority": "offline"},
            headers={"x-priority": "7", "x-slo-ttft-ms": "250"},
        )
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority_level": 3})
        # vLLM's integer priority (smaller is more urgent) is accepted as the level, negated.
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 2})
    finally:
        del backend.engine.add_request
    defaults = GatewaySettings()
    assert seen == [
        ("offline", 7, 250.0, None),
        ("online", 3, defaults.default_slo_ttft_ms, defaults.default_slo_tpot_ms),
        ("online", -2, defaults.default_slo_ttft_ms, defaults.default_slo_tpot_ms),
    ]


# --------------------------------------------------------------------------- auth, admission


def test_api_key_guards_v1_and_dashboard_data(backend: LocalEngineBackend) -> None:
    app = create_app(backend, GatewaySettings(api_key=API_KEY))
    with serve_app(app) as u, httpx.Client(base_url=u, timeout=60) as c:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert c.post("/v1/completions", json=body, headers=good).status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers=good).status_code == 200
        # The dashboard page holds no data and is open (it asks for the key); its data is guarded,
        # by the header alone: a key in the query string (logs, history) is not taken.
        page = c.get("/dashboard")
        assert page.status_code == 200 and 'id="login-key"' in page.text
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = c.get("/dashboard/data", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/dashboard/data", params={"api_key": API_KEY}).status_code == 401
        data = c.get("/dashboard/data", headers=good)
        assert data.status_code == 200 and data.json()["workers"][0]["worker_id"] == "local-0"
        root = c.get("/", follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/dashboard"
        # Probes and scrapers stay open.
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_full_admission_queue_answers_429(
    client: httpx.Client, backend: LocalEngineBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "max_inflight", 1)
    long = {"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=long) as held:
        assert held.status_code == 200
        lines = held.iter_lines()
        next(lines)  # the first token is out: the request holds the only slot
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        r = client.post("/v1/completions", json={**long, "max_tokens": 2})
        assert r.status_code == 429, "a stream must be refused with a status, not inside a 200"
    # Closing the stream freed the slot.
    assert backend.wait_idle(30)
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


# --------------------------------------------------------------------------- disconnects


def _output_tokens(backend: LocalEngineBackend) -> int:
    return backend.inspect(lambda e: e.stats["output_tokens"])


def test_disconnect_mid_stream_aborts_and_frees_kv(client: httpx.Client, backend: LocalEngineBackend) -> None:
    before = _output_tokens(backend)
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = sum(1 for _, line in zip(range(8), lines, strict=False) if line.startswith("data: "))
        assert got >= 3
        assert backend.inspect(lambda e: e.allocator.num_used) > 0, "the request should hold KV now"
    # The response is closed mid-stream: the engine must drop the request well before 400 tokens.
    assert backend.wait_idle(20)
    made = _output_tokens(backend) - before
    assert made < 200, f"{made} tokens were generated after the client left"
    assert backend.inspect(lambda e: e.requests) == {}


def test_disconnect_while_waiting_for_a_json_answer_aborts(url: str, backend: LocalEngineBackend) -> None:
    before = _output_tokens(backend)
    host = urlparse(url)
    payload = json.dumps({"prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host.hostname, host.port)) as s:
        s.sendall(head + payload)
        deadline = time.monotonic() + 20
        while backend.inspect(lambda e: e.stats["output_tokens"]) - before < 5:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    assert backend.wait_idle(20)
    assert _output_tokens(backend) - before < 200


def test_many_streams_closed_at_once_leave_no_blocks(url: str, backend: LocalEngineBackend) -> None:
    before = _output_tokens(backend)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": PROMPTS[i % 4], "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n >= 2 + i % 3:
                    break

    async def run_all() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            await asyncio.gather(*(one(c, i) for i in range(8)))

    asyncio.run(run_all())
    assert backend.wait_idle(20)
    made = _output_tokens(backend) - before
    assert made < 8 * 200 // 2, f"{made} tokens made: the closed streams were not aborted"


# --------------------------------------------------------------------------- operator endpoints


def test_models_health_metrics_and_dashboard(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["ready"] is True
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    m = client.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    assert "bucketserve:request_success_total{" in m.text and 'model_name="tiny"' in m.text
    d = client.get("/dashboard")
    assert d.status_code == 200 and d.headers["content-type"].startswith("text/html")
    assert "<script>" in d.text and "/dashboard/data" in d.text
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/dashboard"
    assert client.get("/", follow_redirects=True).text == d.text
    data = client.get("/dashboard/data", params={"window_s": 300}).json()
    assert data["workers"] and data["workers"][0]["worker_id"] == "local-0"
    assert data["window_totals"]["online"]["requests"] >= 1
    assert client.get("/dashboard/data", params={"window_s": "soon"}).status_code == 400


def test_health_is_503_when_the_backend_is_not_ready(backend: LocalEngineBackend) -> None:
    class NotReady(LocalEngineBackend):
        async def health(self) -> dict:
            return {"ready": False, "workers": []}

    shim = NotReady.__new__(NotReady)
    shim.__dict__.update(backend.__dict__)
    with serve_app(create_app(shim, GatewaySettings())) as u:
        assert httpx.get(f"{u}/health").status_code == 503
