"""Typed messages that carry a request between processes (gateway -> prefill worker -> decode worker).

A :class:`RequestMessage` is frozen and made of plain values, so it pickles cheaply through Ray; each
worker turns it into an engine :class:`~engine.request.Request` at its edge with :meth:`to_request`.
Times are Unix seconds (``time.time()``): monotonic clocks do not agree across processes.

From the gateway to the worker that runs it, a request goes with the controller's calls (:func:`payload_of`): a
short prompt's message rides inline, through the controller unread (cheaper than the object store's put and get,
which cost milliseconds on the way to the first token); a long prompt's waits in Ray's object store and the
controller passes a :class:`MessageRef` along. From the prefill worker to the decode worker the message is the
commit of the KV transfer (:meth:`PrefilledMessage.encode`), not through Ray: plain JSON, so the decode worker's
KV port never unpickles what reaches it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bucket_manager.request import RequestSummary
from engine.request import PriorityClass, Request, SamplingParams


@dataclass(frozen=True)
class RequestMessage:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # Which gateway drains this request's outputs: workers keep one output buffer per consumer.
    consumer_id: str
    priority_class: str = PriorityClass.ONLINE.value
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    arrival_unix: float = 0.0
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("RequestMessage.request_id must be non-empty")
        if not self.prompt_token_ids:
            raise ValueError(f"RequestMessage.prompt_token_ids of {self.request_id!r} must be non-empty")
        if not self.consumer_id:
            raise ValueError("RequestMessage.consumer_id must be non-empty")
        if self.priority_class not in (PriorityClass.ONLINE.value, PriorityClass.OFFLINE.value):
            raise ValueError(
                f"RequestMessage.priority_class must be 'online' or 'offline', got {self.priority_class!r}"
            )

    @classmethod
    def from_request(cls, req: Request, consumer_id: str) -> RequestMessage:
        # The engine's arrival_time is monotonic (this process only); carry its wall-clock equivalent.
        arrival = time.time() - (time.monotonic() - req.arrival_time)
        return cls(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            sampling=req.sampling,
            consumer_id=consumer_id,
            priority_class=PriorityClass(req.priority_class).value,
            priority=req.priority,
            slo_ttft_ms=req.slo_ttft_ms,
            slo_tpot_ms=req.slo_tpot_ms,
            arrival_unix=arrival,
            eos_token_id=req.eos_token_id,
        )

    def to_request(self) -> Request:
        return Request(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            sampling=self.sampling,
            priority_class=PriorityClass(self.priority_class),
            priority=self.priority,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            arrival_time=time.monotonic() - max(0.0, time.time() - self.arrival_unix),
            eos_token_id=self.eos_token_id,
        )

    def summary(self) -> RequestSummary:
        """What the controller plans with (it passes the prompt on unread)."""
        return RequestSummary(
            request_id=self.request_id,
            prompt_len=self.num_prompt_tokens,
            max_tokens=self.sampling.max_tokens,
            priority_class=PriorityClass(self.priority_class),
            priority=self.priority,
            arrival=self.arrival_unix,
            ttft_slo_ms=self.slo_ttft_ms,
            tpot_slo_ms=self.slo_tpot_ms,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reserve_tokens(self) -> int:
        """Tokens the request may grow to on its decode worker (prompt + max_tokens): what that worker reserves."""
        return self.num_prompt_tokens + self.sampling.max_tokens


# Largest prompt whose message rides inline with the controller's calls (3.5 KB pickled at the limit: well under
# Ray's 100 KB limit for inlined call arguments). Short prompts are where the object store's few
# milliseconds show in the time to first token; a longer one's prefill dwarfs them, and it waits in the store
# rather than in the controller's memory while it is queued (some 30 bytes a token as Python ints).
INLINE_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class MessageRef:
    """A request's :class:`RequestMessage` left in Ray's object store by the gateway that admitted it (its owner:
    the object goes when the gateway does). The controller plans with the request's summary and hands this on;
    only the worker that runs the prompt fetches the message (:func:`resolve_messages`)."""

    request_id: str
    ref: Any  # ray.ObjectRef of the RequestMessage

    @classmethod
    def put(cls, msg: RequestMessage) -> MessageRef:
        import ray

        return cls(msg.request_id, ray.put(msg))


def payload_of(msg: RequestMessage) -> RequestMessage | MessageRef:
    """What the gateway hands the controller to pass on: the message itself for a prompt of up to
    :data:`INLINE_PROMPT_TOKENS` tokens, else a reference to it in the object store.

    Measured on a 2-core host, unloaded, 128-token prompts: the object store's put (gateway) and get (worker)
    cost 1.0-1.3 ms and 0.4-2.3 ms on the way to the first token, while pickling and unpickling the message
    (788 bytes) takes 22-37 us a hop, two hops through the controller; at the limit (1,024 tokens, 3.5 KB) about
    60 us a hop. A longer prompt waits in the store instead of in the controller's queue.
    """
    return msg if msg.num_prompt_tokens <= INLINE_PROMPT_TOKENS else MessageRef.put(msg)


def resolve_messages(
    payloads: Sequence[RequestMessage | MessageRef], timeout: float
) -> list[RequestMessage | None]:
    """The messages behind what the controller handed on, fetched in one call: a :class:`MessageRef` becomes its
    message (None when it cannot be had: its gateway went away with it); a message stays as it is (a batch
    adopted by a restarted controller carries the messages themselves)."""
    import ray

    refs = [p.ref for p in payloads if isinstance(p, MessageRef)]
    got: list[Any] = []
    if refs:
        try:
            got = ray.get(refs, timeout=timeout)
        except Exception:  # one is lost: fetch each, so only that one is missing
            got = []
            for ref in refs:
                try:
                    got.append(ray.get(ref, timeout=timeout))
                except Exception:
                    got.append(None)
    fetched = iter(got)
    return [next(fetched) if isinstance(p, MessageRef) else p for p in payloads]


@dataclass(frozen=True)
class PrefilledMessage:
    """What a decode worker needs besides the KV blocks: the request and its first sampled token."""

    request: RequestMessage
    first_token: int
    first_logprob: float | None = None

    def encode(self) -> bytes:
        """The transfer's commit: this message as JSON."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> PrefilledMessage:
        """The message :meth:`encode` made; ValueError names what is missing or wrong."""
        try:
            d = json.loads(data)
            r = dict(d["request"])
            sp = dict(r.pop("sampling"))
            for key in ("stop", "stop_token_ids"):
                sp[key] = tuple(sp.get(key, ()))
            request = RequestMessage(
                **{**r, "prompt_token_ids": tuple(r["prompt_token_ids"]), "sampling": SamplingParams(**sp)}
            )
            return cls(request, int(d["first_token"]), d.get("first_logprob"))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"not a prefilled request: {type(e).__name__}: {e}") from None

    def to_request(self, block_ids: list[int], num_computed_tokens: int) -> Request:
        req = self.request.to_request()
        req.output_token_ids = [self.first_token]
        if self.first_logprob is not None:
            req.output_logprobs = [self.first_logprob]
        req.block_ids = list(block_ids)
        req.num_computed_tokens = num_computed_tokens
        req.first_token_time = time.monotonic()
        return req
