"""The gateway's OpenAPI document, served at ``/openapi.json``.

The routes read their bodies themselves (strict pydantic, errors naming the field), so FastAPI cannot see the
request models: this module writes them in, with the headers each route reads, the bearer key the guarded
routes take, and the OpenAI error shape of every refusal.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    unsupported_fields,
)

OPENAPI_PATH = "/openapi.json"
# Routes answered without the API key: probes, scrapers, the dashboard page (it holds no data) and this document.
OPEN_ROUTES = frozenset({"/", "/health", "/metrics", "/dashboard", OPENAPI_PATH})
_REF = "#/components/schemas/{model}"
DESCRIPTION = (
    "OpenAI-compatible completions and chat completions. With an API key set, the routes marked with a lock "
    'take it as \'Authorization: Bearer <key>\'; every error is {"error": {"message", "type", "param", '
    '"code"}}.'
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer: OpenAI's error shape."""

    error: ErrorDetail


def _header(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": description,
    }


# The headers a generation request reads (``gateway/admission.py``, ``gateway/deadline.py``).
GENERATION_HEADERS = (
    _header("x-priority", "'online', 'offline' or an integer level (larger is more urgent)"),
    _header("x-slo-ttft-ms", "time-to-first-token SLO, a positive number of milliseconds"),
    _header("x-slo-tpot-ms", "time-per-output-token SLO, a positive number of milliseconds"),
    _header("x-request-timeout-ms", "abort the request after this many milliseconds (capped by the server)"),
    _header("x-request-id", "echoed on the response"),
)

# path -> (request model, 200 response model)
_GENERATION = {
    "/v1/completions": (CompletionRequest, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
}
_ERRORS = {
    "400": "invalid input; the message names the field",
    "401": "missing or invalid API key",
    "404": "unknown model or route",
    "408": "the request timed out",
    "413": "the request body is over the size limit",
    "429": "too many requests in flight; retry after Retry-After seconds",
    "503": "not ready, or shutting down",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(codes: tuple[str, ...]) -> dict[str, Any]:
    return {code: _json(_ref(ErrorResponse), _ERRORS[code]) for code in codes}


def _document_unsupported(schema: dict[str, Any], fields: dict[str, tuple[Any, ...]]) -> None:
    """A field this server does not implement takes null, or the value that means "off", and nothing else."""
    for name, offs in fields.items():
        accepted: list[dict[str, Any]] = [{"type": "null"}]
        if offs:
            accepted.insert(0, {"enum": list(offs)})
        schema["properties"][name] = {
            "anyOf": accepted,
            "default": None,
            "description": "not supported by this server: leave it out"
            + (" or send the value listed" if offs else ""),
        }


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The document for ``app``'s routes, with the request and response models of the API filled in."""
    doc = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes)
    models: list[type[BaseModel]] = [
        CompletionRequest,
        ChatCompletionRequest,
        CompletionResponse,
        ChatCompletionResponse,
        ModelList,
        ErrorResponse,
    ]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas = defs.get("$defs", {})
    for model in (CompletionRequest, ChatCompletionRequest):
        _document_unsupported(schemas[model.__name__], unsupported_fields(model))
    components = doc.setdefault("components", {})
    components["schemas"] = schemas
    components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            guarded = path not in OPEN_ROUTES
            if guarded:
                op["security"] = [{"apiKey": []}]
            if path in _GENERATION:
                request, response = _GENERATION[path]
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": _ref(request)}},
                }
                op["parameters"] = list(GENERATION_HEADERS)
                ok = _json(_ref(response), 'the completion (with "stream": true, server-sent events)')
                ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
                op["responses"] = {"200": ok, **_errors(("400", "401", "404", "408", "413", "429", "503"))}
            elif method == "get" and path == "/v1/models":
                op["responses"] = {"200": _json(_ref(ModelList), "the served model"), **_errors(("401",))}
            else:
                ok = op.get("responses", {}).get("200") or {"description": "OK"}
                codes = ("400", "401") if guarded else ()
                op["responses"] = {"200": ok, **_errors(codes)}
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve :func:`build_openapi`'s document for ``app`` (built once, on the first request for it)."""
    cached: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cached:
            cached.update(build_openapi(app))
        return cached

    app.openapi = openapi  # type: ignore[method-assign]
