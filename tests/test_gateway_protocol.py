"""Gateway pieces without a server: request models and their errors, incremental detokenization
with stop strings, and the Ray Serve wiring (picklable settings, the ingress class)."""

from __future__ import annotations

import functools
import json
import pickle
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from engine.model_loader import load_tokenizer, resolve_model_path
from gateway.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from gateway.settings import GatewaySettings
from gateway.tokenization import IncrementalDetokenizer, Tokenizer
from gateway.tokenization import load_tokenizer as gateway_tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(load_tokenizer("tiny"))


def test_prompt_shapes_normalise_to_one_entry_per_prompt() -> None:
    def prompts(raw: str) -> list:
        return parse_body(CompletionRequest, raw.encode()).prompts()

    assert prompts('{"prompt": "a b"}') == ["a b"]
    assert prompts('{"prompt": ["a", "b"]}') == ["a", "b"]
    assert prompts('{"prompt": [1, 2, 3]}') == [[1, 2, 3]]
    assert prompts('{"prompt": [[1], [2, 3]]}') == [[1], [2, 3]]


def test_unknown_fields_are_ignored_but_known_ones_are_strict() -> None:
    req = parse_body(CompletionRequest, b'{"prompt": "x", "user": "me", "temperature": 0}')
    assert req.temperature == 0.0 and req.max_tokens == 16
    with pytest.raises(APIError) as e:
        parse_body(CompletionRequest, b'{"prompt": "x", "seed": "7"}')
    assert e.value.status == 400 and e.value.param == "seed"


def test_chat_limits_and_logprob_options() -> None:
    req = parse_body(
        ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4}'
    )
    assert req.requested_max_tokens() == 4
    with pytest.raises(APIError) as e:
        parse_body(
            ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}'
        )
    assert "logprobs" in e.value.message


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    out = "".join(detok.add([t]) for t in ids[:-1])
    return out + detok.add(ids[-1:], final=True)


def test_incremental_text_equals_a_whole_decode(tok: Tokenizer) -> None:
    text = "Héllo wörld — ünïcode ✓ and 日本語 text, 🙂 emoji too."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.add([], final=True))
    assert "".join(pieces) == tok.decode(ids)
    # Never half a character: a piece never holds the replacement character.
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_over_tokens_is_never_emitted(tok: Tokenizer) -> None:
    text = "alpha beta gamma delta epsilon"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["gamma del"])
    emitted = []
    for t in ids:
        emitted.append(detok.add([t]))
        # No prefix of the stop string leaks before it is known whether the stop completes.
        assert "gam" not in "".join(emitted)
        if detok.stopped:
            break
    assert detok.stopped
    assert "".join(emitted) == tok.decode(ids)[: tok.decode(ids).find("gamma del")]


def test_held_back_tail_is_released_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("one two three")
    detok = IncrementalDetokenizer(tok, stop=["xyzzy-never"])
    assert _stream(detok, ids) == tok.decode(ids)
    assert not detok.stopped


def _factory() -> None:
    raise AssertionError("not called in this test")


def test_settings_pickle_with_their_backend_factory() -> None:
    s = GatewaySettings(backend_factory=functools.partial(_factory), api_key="k", default_slo_ttft_ms=300)
    back = pickle.loads(pickle.dumps(s))
    assert back.api_key == "k" and back.default_slo_ttft_ms == 300
    assert isinstance(back.backend_factory, functools.partial)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"default_slo_ttft_ms": 0}, "default_slo_ttft_ms"),
        ({"default_priority": "batch"}, "default_priority"),
        ({"api_key": " "}, "api_key"),
        ({"dashboard_refresh_ms": 10}, "dashboard_refresh_ms"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_prompts": -1}, "max_prompts"),
        ({"max_stop_strings": 2.5}, "max_stop_strings"),
        ({"max_stop_chars": True}, "max_stop_chars"),
        ({"max_stop_token_ids": "64"}, "max_stop_token_ids"),
        ({"max_messages": 0}, "max_messages"),
    ],
)
def test_settings_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GatewaySettings(**kwargs)


def test_build_app_needs_a_factory_and_binds_the_ingress() -> None:
    from gateway.app import GatewayDeployment, build_app

    with pytest.raises(ValueError, match="backend_factory"):
        build_app(GatewaySettings())
    app = build_app(GatewaySettings(backend_factory=_factory), num_replicas=2)
    deployment = app._bound_deployment
    assert deployment.name == "gateway"
    assert deployment.num_replicas == 2
    assert deployment.max_ongoing_requests == 1024
    assert hasattr(GatewayDeployment, "__serve_build_asgi_app__")


def test_the_gateway_tokenizer_equals_autotokenizers_and_loads_without_torch(tmp_path, monkeypatch) -> None:
    path = str(resolve_model_path("tiny"))
    ours, auto = gateway_tokenizer(path), AutoTokenizer.from_pretrained(path)
    texts = ["Hello, world!", "  spaces\tand\nlines ", "ünïcödé ✓ 東京", "<|begin_of_text|>x<|pad|>"]
    for text in texts:
        assert ours(text).input_ids == auto(text).input_ids
        assert ours.decode(ours(text).input_ids) == auto.decode(auto(text).input_ids)
    assert len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    # The replica's start-up saves torch's import with it (the point of the direct load).
    probe = f"import sys; from gateway.tokenization import load_tokenizer; load_tokenizer({path!r}); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False", out.stderr
    # Another tokenizer class goes through AutoTokenizer (which knows what that class needs); ours does not.
    other = tmp_path / "ckpt"
    shutil.copytree(path, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizerFast"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    through_auto: list[str] = []
    load = AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", lambda p, **k: through_auto.append(str(p)) or load(p, **k)
    )
    gateway_tokenizer(path)
    assert through_auto == []
    assert gateway_tokenizer(str(other))("Hello").input_ids == auto("Hello").input_ids
    assert through_auto == [str(other)]


def test_an_event_stays_one_line_for_clients_that_split_on_unicode_line_breaks() -> None:
    from pydantic import BaseModel

    from gateway.protocol import sse

    text = "a\u2028b\x85c\u2029d é"
    event = sse({"text": text})

    # json.dumps escapes them already; the pydantic path writes them raw unless sse escapes them.
    class Chunk(BaseModel):
        text: str

    for e in (event, sse(Chunk(text=text))):
        line, *rest = e.splitlines()
        assert rest == [""], f"split at a Unicode line break: {e!r}"
        assert json.loads(line.removeprefix("data: "))["text"] == text
