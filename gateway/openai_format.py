"""Generations in OpenAI's shapes: whole completion / chat responses, their SSE chunks, and logprobs.

The engine samples one token at a time and keeps only the chosen token's logprob, so each position's
``top_logprobs`` lists that token alone, and echoed prompt tokens carry ``null``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.generation import Generation, merged
from gateway.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    now_s,
    sse,
)
from gateway.tokenization import Tokenizer


def _usage(gens: list[Generation]) -> Usage:
    return Usage.of(sum(g.req.num_prompt_tokens for g in gens), sum(len(g.token_ids) for g in gens))


class OpenAIFormat:
    """Shapes the outputs of one served model; ``model`` is the id the responses carry."""

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def token_label(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.token_text(token_id)

    # ---------------------------------------------------------------- completions

    def completion_logprobs(
        self,
        g: Generation,
        body: CompletionRequest,
        token_ids: list[int],
        logprobs: list[float],
        echo: bool,
        offset: int = 0,
    ) -> CompletionLogprobs:
        as_ids = body.return_tokens_as_token_ids
        tokens: list[str] = []
        lps: list[float | None] = []
        if echo:
            # The engine computes no prompt logprobs: the prompt's tokens are listed with null.
            tokens += [self.token_label(t, as_ids) for t in g.req.prompt_token_ids]
            lps += [None] * len(g.req.prompt_token_ids)
        tokens += [self.token_label(t, as_ids) for t in token_ids]
        lps += list(logprobs) + [None] * (len(token_ids) - len(logprobs))
        offsets = []
        pos = offset if not echo else 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = (
            [({t: lp} if lp is not None else None) for t, lp in zip(tokens, lps, strict=True)]
            if body.logprobs
            else None
        )
        return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=top, text_offset=offsets)

    def completion_response(
        self, body: CompletionRequest, gens: list[Generation], base_id: str
    ) -> CompletionResponse:
        want_lp = body.logprobs is not None
        choices = []
        for i, g in enumerate(gens):
            prefix = self.tokenizer.decode(g.req.prompt_token_ids) if body.echo else ""
            choices.append(
                CompletionChoice(
                    index=i,
                    text=prefix + g.detok.output_text,
                    logprobs=self.completion_logprobs(g, body, g.token_ids, g.logprobs, echo=body.echo)
                    if want_lp
                    else None,
                    finish_reason=g.finish_reason,
                )
            )
        return CompletionResponse(
            id=base_id, created=now_s(), model=self.model, choices=choices, usage=_usage(gens)
        )

    async def completion_chunks(
        self, body: CompletionRequest, gens: list[Generation], rid: str
    ) -> AsyncIterator[str]:
        created = now_s()
        model = self.model
        want_lp = body.logprobs is not None
        offsets = [0] * len(gens)

        def chunk(i: int, text: str, lp: CompletionLogprobs | None, finish: str | None) -> str:
            c = CompletionResponse(
                id=rid,
                created=created,
                model=model,
                choices=[CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish)],
            )
            return sse(c)

        if body.echo:
            for i, g in enumerate(gens):
                prefix = self.tokenizer.decode(g.req.prompt_token_ids)
                lp = self.completion_logprobs(g, body, [], [], echo=True) if want_lp else None
                yield chunk(i, prefix, lp, None)
        async for i, ev in merged(gens):
            if not ev.streams:
                continue
            lp = None
            if want_lp:
                lp = self.completion_logprobs(
                    gens[i], body, ev.token_ids, ev.logprobs, echo=False, offset=offsets[i]
                )
            offsets[i] += len(ev.text)
            yield chunk(i, ev.text, lp, ev.finish_reason)
        if body.include_usage():
            yield sse(
                CompletionResponse(id=rid, created=created, model=model, choices=[], usage=_usage(gens))
            )

    # ---------------------------------------------------------------- chat

    def chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> ChatLogprobs:
        items = []
        for t, lp in zip(token_ids, logprobs, strict=False):
            text = self.tokenizer.token_text(t)
            raw = list(self.tokenizer.token_bytes(t))
            items.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=lp,
                    bytes=raw,
                    top_logprobs=[{"token": text, "logprob": lp, "bytes": raw}],
                )
            )
        return ChatLogprobs(content=items)

    def chat_response(self, body: ChatCompletionRequest, g: Generation, rid: str) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=rid,
            created=now_s(),
            model=self.model,
            choices=[
                ChatChoice(
                    index=0,
                    message=ChatResponseMessage(content=g.detok.output_text),
                    logprobs=self.chat_logprobs(g.token_ids, g.logprobs) if body.logprobs else None,
                    finish_reason=g.finish_reason,
                )
            ],
            usage=_usage([g]),
        )

    async def chat_chunks(self, body: ChatCompletionRequest, g: Generation, rid: str) -> AsyncIterator[str]:
        created = now_s()
        model = self.model

        def chunk(delta: ChatDelta, finish: str | None, lp: ChatLogprobs | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=model,
                    choices=[ChatChunkChoice(index=0, delta=delta, logprobs=lp, finish_reason=finish)],
                )
            )

        yield chunk(ChatDelta(role="assistant", content=""), None)
        async for _, ev in merged([g]):
            if not ev.streams:
                continue
            lp = self.chat_logprobs(ev.token_ids, ev.logprobs) if body.logprobs else None
            delta = ChatDelta(content=ev.text) if ev.text or ev.token_ids else ChatDelta()
            yield chunk(delta, ev.finish_reason, lp)
        if body.include_usage():
            yield sse(
                ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=_usage([g]))
            )
