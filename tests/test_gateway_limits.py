"""Bounded input at the HTTP gateway, on a real uvicorn server over the in-process engine with the tiny model
(and once through Ray Serve's proxy): a body over the cap is a 413 decided before the body is read whole;
oversized lists and strings are 400s naming the field; a batch the backend could never admit is a 400, not a
retryable 429; fields we do not implement are refused when they would change the answer; and a long prompt is
tokenized without stalling the other streams."""

from __future__ import annotations

import functools
import json
import select
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from gateway_helpers import MAX_MODEL_LEN, serve_app, sse_events, tiny_config

import gateway.protocol
from engine.model_loader import load_tokenizer
from gateway.app import create_app
from gateway.local_backend import LocalEngineBackend
from gateway.settings import GatewaySettings
from gateway.tokenization import INLINE_CHARS, INLINE_MESSAGES, Tokenizer

DEFAULTS = GatewaySettings()
BIG = 20_000_000  # bytes: the body a user sent, well over the default cap


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


@pytest.fixture(autouse=True)
def no_leaks(backend: LocalEngineBackend) -> Iterator[None]:
    """Every test leaves the engine idle with no KV block held."""
    yield
    assert backend.wait_idle(30), "requests still in flight after the test"
    backend.inspect(lambda e: e.check_integrity())
    assert backend.inspect(lambda e: e.allocator.num_used) == 0


def assert_error(r: httpx.Response, status: int, param: str | None, fragment: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert fragment.lower() in err["message"].lower(), err
    return err


# --------------------------------------------------------------------------- raw HTTP


def _connect(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=60)


def _head(url: str, path: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {urlparse(url).hostname}\r\nContent-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: status, headers (lower-case names), body."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the response body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:n]


def _assert_413(status: int, body: bytes, limit: int) -> None:
    assert status == 413, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "max_body_bytes" in err["message"] and str(limit) in err["message"]


# --------------------------------------------------------------------------- the body cap


def test_declared_oversized_body_is_413_before_any_byte_of_it(url: str) -> None:
    """Content-Length over the cap: the answer comes without the client sending a byte of the body."""
    with _connect(url) as s:
        s.sendall(_head(url, "/v1/completions", f"Content-Length: {BIG}\r\n"))
        status, headers, body = _read_response(s)
    _assert_413(status, body, DEFAULTS.max_body_bytes)
    assert str(BIG) in json.loads(body)["error"]["message"]
    assert headers.get("x-request-id")


def test_chunked_body_is_413_once_its_bytes_pass_the_cap(url: str) -> None:
    """No Content-Length: the bytes are counted as they come; the 413 arrives while the body is unfinished."""
    chunk = b"x" * (1 << 20)
    with _connect(url) as s:
        s.sendall(_head(url, "/v1/completions", "Transfer-Encoding: chunked\r\n"))
        for _ in range(DEFAULTS.max_body_bytes // len(chunk) + 1):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        # The terminating zero-length chunk is never sent: the body has not ended.
        status, _, body = _read_response(s)
    _assert_413(status, body, DEFAULTS.max_body_bytes)


def test_20mb_body_is_413_with_and_without_content_length(client: httpx.Client) -> None:
    raw = json.dumps({"prompt": "a " * (BIG // 2)}).encode()
    assert len(raw) > BIG
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 413, None, "max_body_bytes")
    assert r.headers.get("x-request-id")

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(raw), 1 << 20):
            yield raw[i : i + (1 << 20)]

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert_error(r, 413, None, "max_body_bytes")
    # The connection still serves requests.
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_a_body_exactly_at_the_cap_is_read_and_one_byte_more_is_not(backend: LocalEngineBackend) -> None:
    raw = json.dumps({"prompt": "Hello there", "max_tokens": 2}).encode()
    app = create_app(backend, GatewaySettings(max_body_bytes=len(raw)))
    with serve_app(app) as u, httpx.Client(base_url=u, timeout=60) as c:
        headers = {"content-type": "application/json"}
        assert c.post("/v1/completions", content=raw, headers=headers).status_code == 200
        r = c.post("/v1/completions", content=raw + b" ", headers=headers)
        assert_error(r, 413, None, str(len(raw)))
        r = c.post("/v1/completions", content=iter([raw[:5], raw[5:] + b" "]), headers=headers)
        assert_error(r, 413, None, str(len(raw)))


# --------------------------------------------------------------------------- lists and strings


def test_300_prompts_are_a_400_naming_prompt(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": ["hi"] * 300, "max_tokens": 1})
    err = assert_error(r, 400, "prompt", f"at most {DEFAULTS.max_prompts} prompts")
    assert "300" in err["message"]
    r = client.post("/v1/completions", json={"prompt": [[1, 2]] * 300, "max_tokens": 1})
    assert_error(r, 400, "prompt", "300")


def test_a_100000_character_stop_string_is_a_400_naming_stop(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "stop": ["x" * 100_000]})
    assert_error(r, 400, "stop", f"at most {DEFAULTS.max_stop_chars} characters")
    r = client.post("/v1/completions", json={"prompt": "hi", "stop": "x" * 100_000})
    assert_error(r, 400, "stop", "100000")
    r = client.post("/v1/completions", json={"prompt": "hi", "stop": ["a"] * 17})
    assert_error(r, 400, "stop", f"at most {DEFAULTS.max_stop_strings} stop strings")
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stop": "y" * 100_000}
    )
    assert_error(r, 400, "stop", "characters")


def test_a_million_stop_token_ids_are_a_400_naming_stop_token_ids(client: httpx.Client) -> None:
    body = {"prompt": "hi", "stop_token_ids": list(range(10**6))}
    # Under the body cap, so that the list itself is what is refused.
    assert len(json.dumps(body, separators=(",", ":"))) < DEFAULTS.max_body_bytes
    r = client.post("/v1/completions", json=body)
    assert_error(r, 400, "stop_token_ids", f"at most {DEFAULTS.max_stop_token_ids} token ids")


def test_too_many_chat_messages_are_a_400_naming_messages(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}] * (DEFAULTS.max_messages + 1)
    r = client.post("/v1/chat/completions", json={"messages": messages})
    assert_error(r, 400, "messages", f"at most {DEFAULTS.max_messages} messages")


SMALL = GatewaySettings(
    max_prompts=3, max_stop_strings=2, max_stop_chars=5, max_stop_token_ids=2, max_messages=2
)
USER = {"role": "user", "content": "hi"}
# (route, a request right at a limit of SMALL, the same one step over it, the field named)
AT_AND_OVER = [
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, {"prompt": ["a", "b", "c", "d"]}, "prompt"),
    ("/v1/completions", {"prompt": [[5], [6], [7]]}, {"prompt": [[5], [6], [7], [8]]}, "prompt"),
    (
        "/v1/completions",
        {"prompt": "hi", "stop": ["ab", "cd"]},
        {"prompt": "hi", "stop": ["a", "b", "c"]},
        "stop",
    ),
    ("/v1/completions", {"prompt": "hi", "stop": "abcde"}, {"prompt": "hi", "stop": "abcdef"}, "stop"),
    (
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [1, 2]},
        {"prompt": "hi", "stop_token_ids": [1, 2, 3]},
        "stop_token_ids",
    ),
    ("/v1/chat/completions", {"messages": [USER, USER]}, {"messages": [USER, USER, USER]}, "messages"),
]


@pytest.mark.parametrize(("route", "at", "over", "param"), AT_AND_OVER)
def test_each_limit_is_a_setting_inclusive_at_its_value(
    backend: LocalEngineBackend, route: str, at: dict, over: dict, param: str
) -> None:
    with serve_app(create_app(backend, SMALL)) as u, httpx.Client(base_url=u, timeout=60) as c:
        r = c.post(route, json={**at, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert_error(c.post(route, json={**over, "max_tokens": 2}), 400, param, "at most")


def test_the_largest_batch_the_defaults_allow_succeeds(client: httpx.Client) -> None:
    """max_prompts prompts, max_stop_strings stop strings of max_stop_chars each, max_stop_token_ids ids."""
    d = DEFAULTS
    body = {
        "prompt": [[1 + (i % 50), 2, 3, 4] for i in range(d.max_prompts)],
        "max_tokens": 2,
        "stop": [chr(ord("A") + i) * d.max_stop_chars for i in range(d.max_stop_strings)],
        "stop_token_ids": list(range(10_000, 10_000 + d.max_stop_token_ids)),
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(d.max_prompts))
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)


# --------------------------------------------------------------------------- admission


def test_a_batch_that_can_never_be_admitted_is_a_400_one_that_can_later_a_429(
    client: httpx.Client, backend: LocalEngineBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 3
    monkeypatch.setattr(backend, "max_inflight", bound)
    r = client.post("/v1/completions", json={"prompt": ["hi"] * (bound + 1), "max_tokens": 1})
    err = assert_error(r, 400, "prompt", f"admits at most {bound}")
    assert err["code"] == "batch_too_large" and "retry-after" not in r.headers
    held = {"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=held) as s:
        assert s.status_code == 200
        lines = s.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # the first token is out: the stream holds one of the slots
        # Fits the bound but not what is free now: retryable.
        r = client.post("/v1/completions", json={"prompt": ["hi"] * bound, "max_tokens": 1})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        # Fits what is free now.
        r = client.post("/v1/completions", json={"prompt": ["hi"] * (bound - 1), "max_tokens": 1})
        assert r.status_code == 200, r.text
        # Never admissible, whatever is free.
        r = client.post("/v1/completions", json={"prompt": [[7]] * (bound + 1), "max_tokens": 1})
        assert_error(r, 400, "prompt", "smaller batches")


# --------------------------------------------------------------------------- fields we do not implement

REFUSED = [
    ("/v1/completions", "logit_bias", {"50": 10}),
    ("/v1/completions", "response_format", {"type": "json_object"}),
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "response_format", {"type": "json_schema", "json_schema": {}}),
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/completions", "min_tokens", 4),
    ("/v1/completions", "repetition_penalty", 1.3),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "skip_special_tokens", False),
    ("/v1/completions", "add_special_tokens", False),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "end"),
    ("/v1/chat/completions", "n", 2),
]
HARMLESS = {
    "user": "someone",
    "metadata": {"team": "a"},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": False,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "repetition_penalty": 1,
    "min_tokens": 0,
    "skip_special_tokens": True,
    "no_such_field": [1, 2],
}


def _request(route: str) -> dict:
    if route == "/v1/completions":
        return {"prompt": "hi", "max_tokens": 2}
    return {"messages": [USER], "max_tokens": 2}


@pytest.mark.parametrize(("route", "field", "value"), REFUSED)
def test_a_field_we_do_not_implement_is_a_400_naming_it(
    client: httpx.Client, route: str, field: str, value: object
) -> None:
    r = client.post(route, json={**_request(route), field: value})
    assert_error(r, 400, field, "not supported" if field not in ("n", "best_of") else "supported")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_harmless_fields_and_off_values_are_accepted(client: httpx.Client, route: str) -> None:
    r = client.post(route, json={**_request(route), **HARMLESS})
    assert r.status_code == 200, r.text


def test_the_readme_states_the_default_limits() -> None:
    d = DEFAULTS
    text = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    assert f"a body over {d.max_body_bytes // (1 << 20)} MiB is a 413" in text
    assert (
        f"at most {d.max_prompts} prompts, {d.max_stop_strings} stop strings of up to {d.max_stop_chars} "
        f"characters, {d.max_stop_token_ids} `stop_token_ids` and {d.max_messages} chat messages"
    ) in text


def test_the_module_docstring_names_every_refused_field() -> None:
    doc = gateway.protocol.__doc__ or ""
    tables = (gateway.protocol._OFF, gateway.protocol._CHAT_OFF, gateway.protocol._COMPLETION_OFF)
    for name in (n for t in tables for n in t):
        assert f"``{name}``" in doc, name


# --------------------------------------------------------------------------- tokenizing off the event loop


def test_text_tokenized_in_a_thread_gives_the_same_ids(client: httpx.Client) -> None:
    """Prompts longer than INLINE_CHARS (alone, or together in a list) and chats of more than INLINE_MESSAGES
    messages go to the tokenizer threads; the engine must get exactly the ids the tokenizer gives."""
    tok = Tokenizer(load_tokenizer("tiny"))
    for prompts in ([" " * 3000 + "end"], ["the " * 300, "one two " * 150]):
        assert sum(map(len, prompts)) > INLINE_CHARS
        body = {
            "prompt": prompts if len(prompts) > 1 else prompts[0],
            "max_tokens": 1,
            "echo": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        for choice, p in zip(r.json()["choices"], prompts, strict=True):
            ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            assert ids[:-1] == tok.encode(p)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(11)]
    assert len(messages) > INLINE_MESSAGES
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.apply_chat_template(messages, True))


def test_a_long_prompt_being_tokenized_does_not_hold_up_another_stream(
    url: str, client: httpx.Client
) -> None:
    """A prompt of a few million characters takes seconds to tokenize (and is then refused: far beyond
    max_model_len). A short stream sent after it must run to its end while that is still going on, so its
    last event comes before the long request's answer. Were the prompt tokenized on the event loop, the short
    request could not even be read until the tokenizing was over, and the long answer would come first."""
    text = ("the quick brown fox jumps over the lazy dog " * 70_000)[:3_000_000]
    raw = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    assert len(raw) < DEFAULTS.max_body_bytes
    with _connect(url) as long:
        long.sendall(_head(url, "/v1/completions", f"Content-Length: {len(raw)}\r\n") + raw)
        short = {
            "prompt": "Hello",
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with client.stream("POST", "/v1/completions", json=short) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        answered, _, _ = select.select([long], [], [], 0)
        assert not answered, "the long prompt's answer came before the short stream ended"
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 64
        status, _, body = _read_response(long)
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
    assert f"max_model_len is {MAX_MODEL_LEN}" in err["message"]


# --------------------------------------------------------------------------- through Ray Serve


@pytest.mark.slow
def test_limits_hold_behind_ray_serves_proxy(ray_session) -> None:
    """The same app as a Ray Serve ingress (built by create_app inside the replica, reached through Serve's
    proxy): the cap still answers 413 with and without Content-Length, and the field limits 400."""
    from ray import serve

    from bench.server_process import free_port
    from gateway.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        factory = functools.partial(LocalEngineBackend, tiny_config())
        app = build_app(GatewaySettings(backend_factory=factory), name="gw-limits")
        serve.run(app, name="limits", route_prefix="/")
        u = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=u, timeout=120) as c:
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            raw = json.dumps({"prompt": "a " * (BIG // 2)}).encode()
            headers = {"content-type": "application/json"}
            assert_error(c.post("/v1/completions", content=raw, headers=headers), 413, None, "max_body_bytes")
            chunked = iter([raw[i : i + (1 << 20)] for i in range(0, len(raw), 1 << 20)])
            assert_error(
                c.post("/v1/completions", content=chunked, headers=headers), 413, None, "max_body_bytes"
            )
            r = c.post("/v1/completions", json={"prompt": ["hi"] * 300})
            assert_error(r, 400, "prompt", "300")
            r = c.post("/v1/completions", json={"prompt": "hi", "stop": "x" * 100_000})
            assert_error(r, 400, "stop", "characters")
        with _connect(u) as s:
            s.sendall(_head(u, "/v1/completions", f"Content-Length: {BIG}\r\n"))
            status, _, body = _read_response(s)
        _assert_413(status, body, DEFAULTS.max_body_bytes)
    finally:
        serve.shutdown()
