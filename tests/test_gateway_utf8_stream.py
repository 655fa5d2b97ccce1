"""Streamed text equals the whole response's text when characters span several tokens.

The built-in models use a byte-level BPE: a character outside ASCII can come out of the model as
several byte tokens, each of which alone is not valid UTF-8, and a random-weight model also emits
lone bytes that never complete. The gateway's incremental detokenizer must hold back trailing
incomplete bytes until they complete (or the stream ends), so that the concatenated stream is the
tokenizer's decoding of the whole output: never a U+FFFD where the whole text has a real character,
nor a different count of U+FFFD where the bytes are invalid.

Each case runs greedy on the real tiny model behind the HTTP gateway, streamed (SSE read with
httpx, and the OpenAI client with stream=True) and whole, for /v1/completions and
/v1/chat/completions, and is checked to hold such byte sequences, so the comparison goes through
the hold-back path and not only through ASCII.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_helpers import serve_app, sse_events, tiny_config

from gateway.app import create_app
from gateway.local_backend import LocalEngineBackend
from gateway.settings import GatewaySettings

REPLACEMENT = "\ufffd"
# (prompt, max_tokens). The text prompt makes the tiny model emit lone bytes (invalid UTF-8); the
# token-id prompt (BOS + " cloenter") makes it emit a two-byte character as two tokens at its 20th
# token and end on unfinished bytes, so the final flush is exercised too.
COMPLETION_CASES: list[tuple[str | list[int], int]] = [
    ("naïve café 日本語 🙂", 48),
    ([0, 2280, 1688], 24),
]
# User messages whose answers hold runs of byte tokens that are not valid UTF-8.
CHAT_CASES = ["word ! русский write русский café", "straße über the русский 🙂"]
CHAT_MAX_TOKENS = 48


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
def hf_tokenizer(backend: LocalEngineBackend) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(backend.model_info().path)


def held_positions(tok: Any, ids: list[int]) -> list[tuple[int, str]]:
    """Where a detokenizer must hold back: each k < len(ids) whose first k tokens decode to text
    ending in an incomplete or invalid UTF-8 sequence (U+FFFD), with the character the whole
    output has at that place (a real one when the character's bytes span tokens)."""
    whole = tok.decode(ids, skip_special_tokens=True)
    out = []
    for k in range(1, len(ids)):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        if text.endswith(REPLACEMENT):
            out.append((k, whole[len(text) - 1]))
    return out


def completion_body(prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def chat_body(content: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": CHAT_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


def whole_completion(client: httpx.Client, body: dict[str, Any]) -> tuple[str, list[int], int]:
    """The non-streamed completion: its text, its token ids (through logprobs) and its token count."""
    r = client.post("/v1/completions", json={**body, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    res = r.json()
    choice = res["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    return choice["text"], ids, res["usage"]["completion_tokens"]


def chat_token_ids(client: httpx.Client, tok: Any, content: str) -> tuple[str, list[int]]:
    """The chat answer's token ids: the same greedy run through /v1/completions on the templated
    prompt, which reports ids (chat logprobs carry token text only)."""
    messages = [{"role": "user", "content": content}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = list(tok(text, add_special_tokens=False).input_ids)
    completion, ids, _ = whole_completion(client, completion_body(prompt_ids, CHAT_MAX_TOKENS))
    return completion, ids


def sse_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[list[str], int]:
    """Stream over SSE: the text pieces, one per chunk, and the completion tokens of the usage chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert len(usage) == 1, events
    if path == "/v1/completions":
        pieces = [c["choices"][0]["text"] for c in chunks]
    else:
        pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    return pieces, usage[0]["completion_tokens"]


def check_stream(
    tok: Any, pieces: list[str], stream_tokens: int, whole: str, whole_tokens: int, ids: list[int]
) -> None:
    streamed = "".join(pieces)
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert whole == decoded, "the whole response is not the tokenizer's decoding of its tokens"
    assert streamed == whole, (
        f"streamed {streamed!r} differs from the whole response {whole!r} (chunks: {pieces!r})"
    )
    assert stream_tokens == whole_tokens == len(ids)
    assert sum(1 for p in pieces if p) > 1, "one chunk: nothing was streamed piecewise"
    # The case really goes through the hold-back: some prefix of the output ends mid-character.
    assert held_positions(tok, ids), f"no incomplete UTF-8 in {decoded!r}: the case exercises nothing"


# --------------------------------------------------------------------------- SSE over httpx


@pytest.mark.parametrize("prompt,max_tokens", COMPLETION_CASES)
def test_sse_completion_stream_equals_whole_text(
    url: str, hf_tokenizer: Any, prompt: str | list[int], max_tokens: int
) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        body = completion_body(prompt, max_tokens)
        whole, ids, n = whole_completion(c, body)
        pieces, streamed_n = sse_stream(c, "/v1/completions", body)
    check_stream(hf_tokenizer, pieces, streamed_n, whole, n, ids)


@pytest.mark.parametrize("content", CHAT_CASES)
def test_sse_chat_stream_equals_whole_text(url: str, hf_tokenizer: Any, content: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat_body(content))
        assert r.status_code == 200, r.text
        whole = r.json()["choices"][0]["message"]["content"]
        n = r.json()["usage"]["completion_tokens"]
        same_run, ids = chat_token_ids(c, hf_tokenizer, content)
        pieces, streamed_n = sse_stream(c, "/v1/chat/completions", chat_body(content))
    assert same_run == whole, "the templated prompt through /v1/completions is not the same greedy run"
    check_stream(hf_tokenizer, pieces, streamed_n, whole, n, ids)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_held_back_tokens_still_stream_a_chunk(url: str, hf_tokenizer: Any, path: str) -> None:
    # A token whose bytes are not yet a whole character adds no text, but the stream still gets a chunk for it
    # (text ""), as each token does: a client sees its first token when it comes, not when the output first
    # decodes (a random-weight model's run of lone bytes used to stream nothing until its end).
    with httpx.Client(base_url=url, timeout=60) as c:
        if path == "/v1/completions":
            body = completion_body(*COMPLETION_CASES[0])
            _, ids, _ = whole_completion(c, body)
        else:
            body = chat_body(CHAT_CASES[0])
            _, ids = chat_token_ids(c, hf_tokenizer, CHAT_CASES[0])
        held = held_positions(hf_tokenizer, ids)
        assert held, "the case holds nothing back"
        body = {**body, "stream": True}
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r.iter_lines())
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    if path == "/v1/completions":
        pieces = [(ch["text"], ch["finish_reason"]) for ch in chunks]
    else:
        chunks = chunks[1:]  # the opening chunk carries the role
        pieces = [(ch["delta"].get("content"), ch["finish_reason"]) for ch in chunks]
    empty = [p for p in pieces if p == ("", None)]
    assert empty, f"no chunk for a held-back token: {pieces!r}"
    # One chunk per token here (the local engine hands over each step's token on its own), plus at most a
    # closing one.
    assert len(ids) <= len(pieces) <= len(ids) + 1, (len(ids), pieces)


# --------------------------------------------------------------------------- the OpenAI client


@pytest.fixture(scope="module")
def openai_client(url: str) -> Any:
    import openai  # a dev extra: missing means a broken set-up, not a skip

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("prompt,max_tokens", COMPLETION_CASES)
def test_openai_client_completion_stream_equals_whole_text(
    url: str, openai_client: Any, hf_tokenizer: Any, prompt: str | list[int], max_tokens: int
) -> None:
    kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    extra = {"ignore_eos": True}
    whole = openai_client.completions.create(**kwargs, extra_body=extra)
    stream = openai_client.completions.create(
        **kwargs, extra_body=extra, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces += [ch.text for ch in chunk.choices]
    with httpx.Client(base_url=url, timeout=60) as c:
        _, ids, _ = whole_completion(c, completion_body(prompt, max_tokens))
    assert usage is not None
    check_stream(
        hf_tokenizer,
        pieces,
        usage.completion_tokens,
        whole.choices[0].text,
        whole.usage.completion_tokens,
        ids,
    )


@pytest.mark.parametrize("content", CHAT_CASES)
def test_openai_client_chat_stream_equals_whole_text(
    url: str, openai_client: Any, hf_tokenizer: Any, content: str
) -> None:
    body = chat_body(content)
    kwargs = {k: body[k] for k in ("model", "messages", "max_tokens", "temperature")}
    extra = {"ignore_eos": True}
    whole = openai_client.chat.completions.create(**kwargs, extra_body=extra)
    stream = openai_client.chat.completions.create(
        **kwargs, extra_body=extra, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces += [ch.delta.content or "" for ch in chunk.choices]
    with httpx.Client(base_url=url, timeout=60) as c:
        _, ids = chat_token_ids(c, hf_tokenizer, content)
    assert usage is not None
    check_stream(
        hf_tokenizer,
        pieces,
        usage.completion_tokens,
        whole.choices[0].message.content,
        whole.usage.completion_tokens,
        ids,
    )


# --------------------------------------------------------------------------- the cases themselves


def test_a_character_is_split_over_tokens(url: str, hf_tokenizer: Any) -> None:
    """At least one case has a real multi-byte character whose bytes come in separate tokens (where a
    detokenizer that emits each token's text at once would send U+FFFD instead), and it arrives whole
    in the stream."""
    split: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for prompt, max_tokens in COMPLETION_CASES:
            body = completion_body(prompt, max_tokens)
            _, ids, _ = whole_completion(c, body)
            chars = [ch for _, ch in held_positions(hf_tokenizer, ids) if ch != REPLACEMENT]
            if chars:
                pieces, _ = sse_stream(c, "/v1/completions", body)
                for ch in chars:
                    assert any(ch in p for p in pieces), (ch, pieces)
                split += chars
    assert split, "no case makes the model emit a character over several tokens: choose another prompt"
    assert all(len(ch.encode()) > 1 for ch in split), split


@pytest.mark.parametrize("content", CHAT_CASES)
def test_chat_logprob_bytes_are_the_tokens_raw_bytes(url: str, content: str) -> None:
    """OpenAI's logprob ``bytes`` are each token's own bytes: together the UTF-8 of the answer, even where a
    token holds only part of a character (its ``token`` text then shows U+FFFD)."""
    body = {**chat_body(content), "logprobs": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    items = choice["logprobs"]["content"]
    raw = b"".join(bytes(item["bytes"]) for item in items)
    assert raw.decode("utf-8", errors="replace") == choice["message"]["content"]
    partial = [item for item in items if REPLACEMENT in item["token"]]
    assert partial, "no token held part of a character: the case does not exercise raw bytes"
    assert all(bytes(item["bytes"]) != REPLACEMENT.encode() for item in partial)
