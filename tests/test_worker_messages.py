"""The messages that carry a request between processes: the prefilled request as a KV transfer's commit (plain
JSON, read back exactly, refused by name when it is not one), and the gateway's messages fetched from Ray's object
store by the worker that runs them (a message that cannot be had comes back as None, the others intact); a short
prompt's message rides with the calls itself."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams
from worker.messages import (
    INLINE_PROMPT_TOKENS,
    MessageRef,
    PrefilledMessage,
    RequestMessage,
    payload_of,
    resolve_messages,
)


def _message(rid: str = "r1", prompt: tuple[int, ...] = (5, 6, 7)) -> RequestMessage:
    sampling = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=4, seed=11, stop=("\n\n", "END"), stop_token_ids=(3,)
    )
    return RequestMessage(
        rid,
        prompt,
        sampling,
        "gateway-1",
        priority_class="offline",
        priority=2,
        slo_ttft_ms=250.0,
        slo_tpot_ms=40.0,
        arrival_unix=1_700_000_000.25,
        eos_token_id=2,
    )


def test_a_prefilled_request_survives_its_commit_bytes() -> None:
    for logprob in (None, -0.125):
        m = PrefilledMessage(_message(prompt=tuple(range(2000))), 42, logprob)
        assert PrefilledMessage.decode(m.encode()) == m


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b"{}",
        b'{"request": {}, "first_token": 1}',
        b'{"request": 3, "first_token": 1}',
    ],
)
def test_a_commit_that_is_not_a_prefilled_request_is_refused_by_name(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a prefilled request"):
        PrefilledMessage.decode(data)


def test_an_invalid_request_in_a_commit_is_refused() -> None:
    good = PrefilledMessage(_message(), 1).encode()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        PrefilledMessage.decode(good.replace(b'"prompt_token_ids":[5,6,7]', b'"prompt_token_ids":[]'))


def test_messages_are_fetched_from_the_object_store_and_a_missing_one_is_none(ray_session) -> None:
    ray = ray_session

    @ray.remote
    class Owner:
        """A gateway: it owns the objects it puts."""

        def put(self, msg: RequestMessage) -> MessageRef:
            return MessageRef.put(msg)

    owner = Owner.remote()
    mine = MessageRef.put(_message("mine"))
    theirs = ray.get(owner.put.remote(_message("theirs")))
    plain = _message("plain")  # a restarted controller hands on the messages themselves
    # An object that is nowhere (its gateway went away with it, on another node): not had within the timeout.
    missing = MessageRef("missing", ray.ObjectRef(bytes(28)))
    got = resolve_messages([mine, missing, theirs, plain], timeout=1)
    assert got == [_message("mine"), None, _message("theirs"), plain]
    ray.kill(owner)


def test_a_short_prompt_rides_inline_and_a_long_one_waits_in_the_object_store(ray_session) -> None:
    short = _message("short", tuple(range(INLINE_PROMPT_TOKENS)))
    long = _message("long", tuple(range(INLINE_PROMPT_TOKENS + 1)))
    assert payload_of(short) is short
    ref = payload_of(long)
    assert isinstance(ref, MessageRef) and ref.request_id == "long"
    assert resolve_messages([ref, short], timeout=5) == [long, short]
