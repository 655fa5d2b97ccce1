"""The OpenAI API as pydantic models: completions, chat completions, their responses and SSE chunks,
and the error shape ``{"error": {"message", "type", "param", "code"}}``.

Requests are validated strictly (a string where a number belongs is an error, not a guess), and
every validation failure becomes an :class:`APIError` whose ``param`` names the field, so the
client never sees FastAPI's default 422 body.

Fields this server does not implement are of two kinds:

- Fields that would change the answer are refused with a 400 naming them unless they hold the value that
  means "off" (``_OFF``): ``n``, ``best_of``, ``suffix``, ``presence_penalty`` and ``frequency_penalty``
  (checked by their own validators), and ``logit_bias``, ``response_format``, ``tools``, ``tool_choice``,
  ``functions``, ``function_call``, ``modalities``, ``audio``, ``prediction``, ``web_search_options``,
  and vLLM's ``min_tokens``, ``min_p``, ``repetition_penalty``, ``use_beam_search``, ``length_penalty``,
  ``include_stop_str_in_output``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
  ``truncate_prompt_tokens``, ``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``,
  ``logits_processors``, ``structured_outputs``, ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``, ``add_special_tokens``; for chat also ``echo``, ``chat_template``,
  ``chat_template_kwargs``, ``continue_final_message`` and ``documents``.
- Every other field is ignored, as OpenAI's API does with fields that do not apply: ``user``, ``metadata``,
  ``store``, ``service_tier``, ``parallel_tool_calls``, ``reasoning_effort`` and any unknown name.

How many prompts, stop strings, stop token ids and messages a request may hold is the gateway's setting
(``gateway/settings.py``), checked in ``gateway/admission.py``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

PriorityName = Literal["online", "offline"]


class APIError(Exception):
    """An error answered in OpenAI's shape; ``param`` names the offending field (or header)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Pydantic names the member of a union (`str`, `list[str]`, `function-after[...]`) in the error
# location; the client only needs the field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*)$")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))]
    return ".".join(parts) or None


def validation_error(exc: ValidationError) -> APIError:
    """The first problem of a pydantic error, as a 400 naming the field."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    param = _loc_to_param(tuple(err.get("loc", ())))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json")
    if kind == "model_type" and not param:
        return APIError(400, "the request body must be a JSON object", code="invalid_type")
    if kind == "missing":
        return APIError(400, f"{param}: field required", param=param, code="missing_field")
    # Custom validators raise ValueError; pydantic prefixes those with "Value error, ".
    # A union gives one error per member: say what each would have accepted.
    msgs = [
        str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        for e in errors
        if _loc_to_param(tuple(e.get("loc", ()))) == param
    ]
    msg = " or ".join(dict.fromkeys(msgs))
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise validation_error(e) from None


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# Fields we do not implement, each with the values that mean "off" (None always does): any other value would
# make the answer differ from what the client asked for, so it is a 400 naming the field, never silently ignored.
_OFF: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, "auto" calls none
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    # vLLM's extensions
    "min_tokens": (0,),
    "min_p": (0.0,),
    "repetition_penalty": (1.0,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "logits_processors": (),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
# Chat only: completions implement `echo`, and add the tokenizer's special tokens (BOS) by default.
_CHAT_OFF: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "add_special_tokens": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "continue_final_message": (False,),
    "documents": (),
}
_COMPLETION_OFF: dict[str, tuple[Any, ...]] = {"add_special_tokens": (True,)}


def unsupported_fields(model: type[BaseModel]) -> dict[str, tuple[Any, ...]]:
    """The fields of a request model this server does not implement, each with the values it accepts for them."""
    own = _CHAT_OFF if issubclass(model, ChatCompletionRequest) else _COMPLETION_OFF
    return {**_OFF, **own}


def _is(v: Any, off: Any) -> bool:
    if isinstance(v, bool) or isinstance(off, bool):
        return type(v) is type(off) and v == off  # True is not 1.0, nor 0 False
    return v == off  # 1 and 1.0 alike


def _off(table: dict[str, tuple[Any, ...]], v: Any, info: ValidationInfo) -> Any:
    offs = table[info.field_name or ""]
    if v is not None and not any(_is(v, off) for off in offs):
        allowed = " or ".join(json.dumps(off) for off in offs)
        raise ValueError(
            "not supported by this server; leave it out" + (f" or send {allowed}" if allowed else "")
        )
    return v


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    # Clients send fields we do not model (user, metadata, ...): ignore them, as OpenAI does.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 or 0 = off (vLLM uses -1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Extensions: scheduling class and urgency inside it. An integer ``priority`` is vLLM's (smaller is handled
    # first): it sets the urgency inside the online class, as ``priority_level`` (larger first) does.
    priority: PriorityName | StrictInt | None = None
    priority_level: int | None = None
    # Not implemented: None or their value in `_OFF`, else a 400 naming the field.
    logit_bias: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    min_tokens: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    logits_processors: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported; send 0 or leave it out")
        return v

    @field_validator(*_OFF)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        return _off(_OFF, v, info)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# What a completion's `prompt` may be, for the API's schema (the validator below checks it).
_PROMPT_SCHEMAS = [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "integer"}},
    {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}}},
]


class CompletionRequest(_Common):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["prompt"]})
    # str | list[str] | list[int] | list[list[int]]; checked by hand for a clear message.
    prompt: Any = Field(default=None, validate_default=True, json_schema_extra={"anyOf": _PROMPT_SCHEMAS})
    max_tokens: int | None = Field(default=16)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # Extension (as in vLLM): logprob tokens as "token_id:<id>" instead of their text.
    return_tokens_as_token_ids: bool = False
    add_special_tokens: Any = None  # not implemented: see `_COMPLETION_OFF`

    @field_validator(*_COMPLETION_OFF)
    @classmethod
    def _unsupported_here(cls, v: Any, info: ValidationInfo) -> Any:
        return _off(_COMPLETION_OFF, v, info)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("field required")
        if isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError(
                "must be a non-empty string, list of strings, list of token ids, or list of token-id lists"
            )
        if all(isinstance(p, str) for p in v):
            if any(not p for p in v):
                raise ValueError("a prompt in the list is empty")
            return v
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if all(isinstance(p, list) for p in v):
            for p in v:
                if not p:
                    raise ValueError("a token-id prompt in the list is empty")
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise ValueError("token-id prompts must hold integers only")
            return v
        raise ValueError(
            "must be a string, list of strings, list of token ids, or list of token-id lists (not mixed)"
        )

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def num_prompts(self) -> int:
        """How many prompts (engine requests) the request holds, without copying them."""
        p = self.prompt
        if isinstance(p, str) or all(isinstance(x, int) for x in p):
            return 1
        return len(p)

    def prompts(self) -> list[str] | list[list[int]]:
        """One entry per prompt: strings to tokenize, or token ids as given."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return [list(x) for x in p]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Not implemented: None or their value in `_CHAT_OFF`, else a 400 naming the field.
    echo: Any = None
    add_special_tokens: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    continue_final_message: Any = None
    documents: Any = None

    @field_validator(*_CHAT_OFF)
    @classmethod
    def _unsupported_here(cls, v: Any, info: ValidationInfo) -> Any:
        return _off(_CHAT_OFF, v, info)

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("at least one message is required")
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError("top_logprobs must be >= 0")
            if self.top_logprobs and not self.logprobs:
                raise ValueError("top_logprobs requires logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    # Only the chosen token is known to the engine: each entry maps it to its logprob.
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "bucketserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Characters that Python's str.splitlines (and clients built on it, httpx's iter_lines among them) take for line
# breaks although SSE does not; pydantic writes them raw inside JSON strings, where their escapes mean the same.
_LINE_BREAKS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object, on one line for every line splitter."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKS_IN_JSON)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
