"""From an HTTP request's headers and parsed body to engine ``Request``\\ s: priority and SLOs, the bounds on
what one request may hold, prompt tokens, the context-length check and the sampling parameters. Every refusal
is a 400 naming the field.

The bounds are checked before any prompt is tokenized, and long text is tokenized off the event loop."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.request import PriorityClass, Request, SamplingParams
from gateway.backend import ModelInfo
from gateway.protocol import APIError, ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.tokenization import Tokenizer

Body = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class Scheduling:
    """What a request asks of the scheduler: its class, its level within the class and its latency SLOs."""

    priority_class: PriorityClass
    priority: int  # smaller runs first inside its class (the API's priority_level, negated)
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None


def _slo_header(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise APIError(
            400, f"{name} header must be a positive number of milliseconds, got {raw!r}", param=name
        )
    return value


class Admission:
    """Turns one API call into the engine requests it makes, for one served model."""

    def __init__(self, settings: GatewaySettings, info: ModelInfo, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.info = info
        self.tokenizer = tokenizer

    def scheduling(self, headers: Mapping[str, str], body: Body) -> Scheduling:
        pclass: str = self.settings.default_priority
        level = 0
        header = headers.get("x-priority")
        if header is not None:
            h = header.strip().lower()
            if h in ("online", "offline"):
                pclass = h
            else:
                try:
                    level = int(h)
                except ValueError:
                    raise APIError(
                        400,
                        f"x-priority header must be 'online', 'offline' or an integer, got {header!r}",
                        param="x-priority",
                    ) from None
        if isinstance(body.priority, int):  # vLLM's integer priority: smaller first
            level = -body.priority
        elif body.priority is not None:
            pclass = body.priority
        if body.priority_level is not None:
            level = body.priority_level
        ttft = _slo_header(headers, "x-slo-ttft-ms")
        tpot = _slo_header(headers, "x-slo-tpot-ms")
        if pclass == "online":
            ttft = ttft if ttft is not None else self.settings.default_slo_ttft_ms
            tpot = tpot if tpot is not None else self.settings.default_slo_tpot_ms
        # Offline work is judged on throughput: it gets latency SLOs only when it asks for them.
        # The API says "higher level = more urgent"; every layer below says "smaller priority first".
        return Scheduling(PriorityClass(pclass), -level, ttft, tpot)

    def check_logprobs(self, body: Body) -> None:
        """At most ``max_logprobs`` alternatives per token (``logprobs`` / ``top_logprobs``)."""
        limit = self.settings.max_logprobs
        if isinstance(body, CompletionRequest):
            if body.logprobs is not None and body.logprobs > limit:
                raise APIError(400, f"logprobs must be <= {limit}, got {body.logprobs}", param="logprobs")
        elif body.top_logprobs and body.top_logprobs > limit:
            raise APIError(400, f"top_logprobs must be <= {limit}", param="top_logprobs")

    def check_bounds(self, body: Body, max_in_flight: int | None) -> None:
        """What one request may hold (``GatewaySettings``' limits), before anything is tokenized.

        ``max_in_flight`` is the most requests the backend admits at once: a batch of more prompts could never
        be admitted, so it is a 400 rather than a 429 the client would retry for ever.
        """
        s = self.settings
        stops = body.stop_list()
        if len(stops) > s.max_stop_strings:
            raise APIError(
                400, f"stop: at most {s.max_stop_strings} stop strings, got {len(stops)}", param="stop"
            )
        longest = max((len(x) for x in stops), default=0)
        if longest > s.max_stop_chars:
            raise APIError(
                400,
                f"stop: a stop string may have at most {s.max_stop_chars} characters, got one of {longest}",
                param="stop",
            )
        n_ids = len(body.stop_token_ids or ())
        if n_ids > s.max_stop_token_ids:
            raise APIError(
                400,
                f"stop_token_ids: at most {s.max_stop_token_ids} token ids, got {n_ids}",
                param="stop_token_ids",
            )
        if isinstance(body, ChatCompletionRequest):
            if len(body.messages) > s.max_messages:
                raise APIError(
                    400,
                    f"messages: at most {s.max_messages} messages, got {len(body.messages)}",
                    param="messages",
                )
            return
        n = body.num_prompts()
        if n > s.max_prompts:
            raise APIError(
                400, f"prompt: at most {s.max_prompts} prompts in one request, got {n}", param="prompt"
            )
        if max_in_flight is not None and n > max_in_flight:
            raise APIError(
                400,
                f"prompt: the request holds {n} prompts but this server admits at most {max_in_flight} requests "
                "at once, so it could never be admitted; send the prompts in smaller batches",
                param="prompt",
                code="batch_too_large",
            )

    async def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids: text is tokenized, ids are checked against the vocabulary."""
        given = body.prompts()
        encoded = iter(await self.tokenizer.encode_all([p for p in given if isinstance(p, str)]))
        prompts: list[list[int]] = []
        for p in given:
            if isinstance(p, str):
                ids = next(encoded)
                if not ids:
                    raise APIError(400, "prompt: the prompt is empty after tokenization", param="prompt")
            else:
                ids = p
                bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
                if bad:
                    raise APIError(
                        400,
                        f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.tokenizer.vocab_size})",
                        param="prompt",
                    )
            prompts.append(ids)
        return prompts

    async def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation's token ids through the model's chat template."""
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = await self.tokenizer.chat_ids(messages, body.add_generation_prompt)
        except Exception as e:  # template errors (role order, ...) are the client's to fix
            raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        if not ids:
            raise APIError(400, "messages: empty after applying the chat template", param="messages")
        return ids

    def check_length(self, ids: list[int], max_tokens: int | None, prompt_param: str, max_param: str) -> int:
        """The max_tokens to use; 400 naming max_model_len when the prompt or prompt + output does not fit."""
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but max_model_len is {limit} "
                "(prompt + output must fit, with at least one output token)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"{max_param} is too large: the prompt has {len(ids)} tokens and {max_param} is {max_tokens}, "
                f"{len(ids) + max_tokens} in all, beyond max_model_len {limit}",
                param=max_param,
                code="context_length_exceeded",
            )
        return max_tokens

    @staticmethod
    def sampling(body: Body, max_tokens: int, logprobs: bool) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=tuple(body.stop_list()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )

    def requests(
        self,
        base_id: str,
        prompts: list[list[int]],
        max_tokens: list[int],
        body: Body,
        sched: Scheduling,
        logprobs: bool,
    ) -> list[Request]:
        """One engine request per prompt; several prompts get ids ``<base_id>-<index>``."""
        return [
            Request(
                request_id=base_id if len(prompts) == 1 else f"{base_id}-{i}",
                prompt_token_ids=ids,
                sampling=self.sampling(body, mt, logprobs),
                priority_class=sched.priority_class,
                priority=sched.priority,
                slo_ttft_ms=sched.slo_ttft_ms,
                slo_tpot_ms=sched.slo_tpot_ms,
                eos_token_id=self.info.eos_token_ids[0] if self.info.eos_token_ids else None,
            )
            for i, (ids, mt) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
