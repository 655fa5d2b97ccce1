"""API fuzzing over the gateway's own OpenAPI document, on a real uvicorn server over the in-process engine with
the tiny model: bodies drawn from the request schemas it serves (and any JSON in place of their fields), raw and
malformed bodies, odd headers, every route with every method and unknown routes. Never a 5xx; every 4xx in
OpenAI's error shape with a message; every 2xx body parses; and no KV block is left in use.

Also the route inventory: with an API key set, every route either is one of the few open ones or refuses a
request without the key, so a new route cannot be added unguarded by accident."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_helpers import serve_app, sse_events, tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_schema_strategy import ANY_JSON, TEXT, from_schema, one_in
from starlette.routing import Route

from gateway.app import create_app
from gateway.local_backend import LocalEngineBackend
from gateway.protocol import ChatCompletionResponse, CompletionResponse, ModelList
from gateway.settings import GatewaySettings

API_KEY = "fuzz-key"
# Routes anyone may call, with or without the API key: nothing else may be added to this list unnoticed.
OPEN_ROUTES = {"/", "/health", "/metrics", "/dashboard", "/openapi.json"}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
RESPONSE_MODELS = {
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionResponse,
    "/v1/models": ModelList,
}


@pytest.fixture(scope="module")
def backend() -> Iterator[LocalEngineBackend]:
    b = LocalEngineBackend(tiny_config())
    yield b
    b.close()


@pytest.fixture(scope="module")
def client(backend: LocalEngineBackend) -> Iterator[httpx.Client]:
    with (
        serve_app(create_app(backend, GatewaySettings())) as url,
        httpx.Client(base_url=url, timeout=120) as c,
    ):
        yield c


@pytest.fixture(autouse=True)
def no_leaks(backend: LocalEngineBackend) -> Iterator[None]:
    """Every test leaves the engine idle with no KV block held."""
    yield
    assert backend.wait_idle(60), "requests still in flight after the test"
    backend.inspect(lambda e: e.check_integrity())
    assert backend.inspect(lambda e: e.allocator.num_used) == 0


def check_answer(method: str, path: str, r: httpx.Response) -> None:
    """Never a 5xx; a 4xx in OpenAI's error shape with a message; a 2xx whose body parses."""
    assert r.status_code < 500, (method, path, r.status_code, r.text[:2000])
    if method == "HEAD":
        return  # no body to look at
    if 400 <= r.status_code < 500:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"].strip(), err
        assert isinstance(err["type"], str) and err["type"], err
        return
    if not 200 <= r.status_code < 300:
        return
    kind = r.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        events = sse_events(r.text.splitlines())
        assert events and events[-1] == "[DONE]", events[-3:]
        assert all(isinstance(e, dict) for e in events[:-1]), events
    elif kind.startswith("application/json"):
        body = r.json()
        if path in RESPONSE_MODELS:
            RESPONSE_MODELS[path].model_validate(body)
    else:
        assert r.content is not None  # /metrics, /dashboard: text


# --------------------------------------------------------------------------- strategies


def _weighted(
    usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], odd_in: int
) -> st.SearchStrategy[Any]:
    """``usual`` values, and ``odd`` ones about once in ``odd_in`` draws."""
    return one_in(odd_in).flatmap(lambda is_odd: odd if is_odd else usual)


# Header values the HTTP client sends as they are: printable, no space at either end.
PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24).map(str.strip)
ODD_NUMBERS = st.sampled_from(["0", "-1", "1e309", "nan", "inf", "-inf", "1e-320", "0x10", "", "12ms"])
USUAL_HEADERS = {
    "x-priority": st.sampled_from(["online", "offline", "ONLINE", "7", "-3", "0"]),
    "x-request-timeout-ms": st.sampled_from(["1", "50", "5000", "60000", "1e12", "5.5"]),
    "x-slo-ttft-ms": st.sampled_from(["1", "100", "450", "1e9"]),
    "x-slo-tpot-ms": st.sampled_from(["1", "50", "1e9"]),
    "authorization": st.sampled_from(["Bearer x", "bearer", "Basic abc", "Bearer " + "k" * 300]),
    "x-request-id": PRINTABLE,
    "content-type": st.sampled_from(["application/json", "text/plain", "multipart/form-data"]),
}
ODD_HEADERS = {"x-priority": st.sampled_from([str(2**70), "-" + str(2**70), "1.5", "high"]) | PRINTABLE}


@st.composite
def headers_st(draw: st.DrawFn) -> dict[str, str]:
    """A few of the headers the gateway reads, each now and then, with a value it may refuse."""
    out = {}
    for name, usual in USUAL_HEADERS.items():
        if draw(one_in(5)):
            odd = ODD_HEADERS.get(name, ODD_NUMBERS | PRINTABLE)
            out[name] = draw(_weighted(usual, odd, 6))
    return out


RAW_BODIES = st.sampled_from(
    [
        b"",
        b" ",
        b"{",
        b"[]",
        b"null",
        b"42",
        b'"text"',
        b'{"prompt": "hi", "max_tokens": NaN}',
        b'{"prompt": "hi", "temperature": Infinity}',
        b'{"prompt": "hi", "max_tokens": 1e400}',
        b'{"prompt": "\\ud800", "max_tokens": 2}',
        b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
        b'{"prompt": "hi", "prompt": ["a", "b"], "max_tokens": 2}',
        b"\xff\xfe\x00{}",
        b'{"prompt": "caf\xc3", "max_tokens": 2}',
        b"[" * 5000 + b"]" * 5000,
        b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b'{"messages": ' + b"{" * 1000 + b"}",
    ]
) | st.binary(max_size=64)


def json_body(values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return values.map(lambda v: json.dumps(v).encode())


GENERATION = ["/v1/completions", "/v1/chat/completions"]
UNKNOWN = ["/v1", "/v1/completion", "/nope", "/v1/models/tiny", "/dashboard/data/x"]


@st.composite
def calls(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[str, str, dict[str, str], bytes | None]:
    """(method, path, headers, body) of one request: mostly the generation routes with bodies drawn from their
    request schemas, then the document's other operations, other methods on known routes and unknown routes."""
    defs = doc["components"]["schemas"]
    others = sorted(set(doc["paths"]) - set(GENERATION))
    path = draw(_weighted(st.sampled_from(GENERATION), st.sampled_from(others + UNKNOWN), 3))
    ops = doc["paths"].get(path, {})
    documented = st.sampled_from(sorted(m.upper() for m in ops)) if ops else st.sampled_from(METHODS)
    method = draw(_weighted(documented, st.sampled_from(METHODS), 8))
    headers = draw(headers_st())
    body = None
    op = ops.get(method.lower(), {})
    if "requestBody" in op:
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        body = draw(_weighted(json_body(from_schema(schema, defs)), json_body(ANY_JSON) | RAW_BODIES, 5))
    elif method in ("POST", "PUT", "PATCH") and draw(st.booleans()):
        body = draw(RAW_BODIES | json_body(st.dictionaries(TEXT, ANY_JSON, max_size=3)))
    if method == "GET" and path == "/dashboard/data" and draw(st.booleans()):
        path += "?window_s=" + draw(st.sampled_from(["0", "-1", "nan", "inf", "1e999", "abc", "60", ""]))
    return method, path, headers, body


# --------------------------------------------------------------------------- tests


def fuzz_settings(examples: int) -> settings:
    """Reproducible (the same examples on every run, none saved between runs) and bounded in time."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


@pytest.fixture(scope="module")
def doc(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def test_openapi_document_names_the_real_request_models(doc: dict[str, Any]) -> None:
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert {p["name"] for p in op["parameters"]} >= {"x-priority", "x-request-timeout-ms"}
        assert op["security"] == [{"apiKey": []}]
    schemas = doc["components"]["schemas"]
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    # The document marks as open exactly the routes this test knows to be (itself aside: it is not listed in it).
    unguarded = {p for p, item in doc["paths"].items() if any("security" not in op for op in item.values())}
    assert unguarded == OPEN_ROUTES - {"/openapi.json"}


@fuzz_settings(250)
@given(data=st.data())
def test_fuzzed_requests_never_get_a_5xx(
    client: httpx.Client, doc: dict[str, Any], data: st.DataObject
) -> None:
    method, path, headers, body = data.draw(calls(doc))
    r = client.request(method, path, headers=headers, content=body)
    check_answer(method, path.split("?")[0], r)


# The fields that steer the engine (sampling, stopping, logprobs, scheduling), all drawn at once on a prompt, so
# most requests are served and their values reach the sampler.
SAMPLING_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "echo",
    "stream",
    "priority",
    "priority_level",
]


@st.composite
def sampling_bodies(draw: st.DrawFn, doc: dict[str, Any]) -> bytes:
    defs = doc["components"]["schemas"]
    props = defs["CompletionRequest"]["properties"]
    body = {"prompt": draw(from_schema(props["prompt"], defs, inside=True))}
    for name in SAMPLING_FIELDS:
        if not draw(one_in(4)):
            body[name] = draw(from_schema(props[name], defs, inside=True))
    return json.dumps(body).encode()


@fuzz_settings(150)
@given(data=st.data())
def test_fuzzed_sampling_parameters_never_get_a_5xx(
    client: httpx.Client, doc: dict[str, Any], data: st.DataObject
) -> None:
    body = data.draw(sampling_bodies(doc))
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    check_answer("POST", "/v1/completions", r)


# Found by the fuzz: each once a 5xx.
@pytest.mark.parametrize(
    ("path", "body"),
    [
        # A temperature just above 0 overflowed the scaled logits (and failed every request in the engine step).
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 1e-300}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 5e-324}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 5e-324, "top_p": 5e-324}),
    ],
)
def test_regressions_found_by_the_fuzz(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = client.post(path, json={**body, "max_tokens": 3})
    assert r.status_code == 200, r.text
    check_answer("POST", path, r)


def test_route_inventory_every_route_is_open_or_guarded(backend: LocalEngineBackend) -> None:
    app = create_app(backend, GatewaySettings(api_key=API_KEY))
    routes = [(r.path, sorted(r.methods or ())) for r in app.routes if isinstance(r, Route)]
    assert {p for p, _ in routes} >= OPEN_ROUTES | {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        for path, methods in routes:
            for method in methods:
                if path in OPEN_ROUTES:
                    continue
                r = c.request(method, path, content=b"{}" if method == "POST" else None)
                assert r.status_code == 401, (method, path, r.status_code, r.text)
                if method != "HEAD":
                    assert r.json()["error"]["type"] == "authentication_error", r.text
                r = c.request(method, path, headers={"authorization": "Bearer wrong"})
                assert r.status_code == 401, (method, path, r.status_code)
        # The open ones answer without it, and the key opens the guarded ones.
        for path in OPEN_ROUTES:
            assert c.get(path, follow_redirects=False).status_code in (200, 307), path
        ok = c.get("/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
