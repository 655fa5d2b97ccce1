"""The OpenAI-compatible HTTP gateway: a FastAPI app over a :class:`ServingBackend`.

``create_app(backend, settings)`` builds the app around a live backend (tests, local serving);
``build_app(settings)`` wraps it as a Ray Serve ingress deployment whose replica builds its own
backend from ``settings.backend_factory``.

Per request: set its deadline (``gateway/deadline.py``: past it a 408, or a timeout error ending the stream,
and an abort everywhere); refuse a body over the size cap (413, ``gateway/body_limit.py``); validate (400 naming
the field), check the bounds on what one request holds, tokenize (long text off the event loop), check the
context limit and build one engine ``Request`` per prompt (``gateway/admission.py``); hand them to the
backend and follow them until they end or the client goes away, recording TTFT / TPOT / end-to-end
latency (``gateway/generation.py``); answer in OpenAI's shapes, streamed (SSE) or whole (JSON)
(``gateway/openai_format.py``). This module keeps the routes, the mapping of errors to HTTP answers, and
the Ray Serve deployment.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.admission import Admission
from gateway.backend import BackendError, Overloaded, ServingBackend
from gateway.body_limit import BodyLimitMiddleware
from gateway.deadline import Deadline, request_deadline
from gateway.drain import Drain
from gateway.generation import (
    ClientGone,
    Generation,
    StreamResponse,
    each,
    finish_shielded,
    start_generations,
    until_disconnect,
)
from gateway.openai_format import OpenAIFormat
from gateway.openapi import OPENAPI_PATH, install_openapi
from gateway.protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    error_body,
    new_id,
    now_s,
    parse_body,
    sse,
)
from gateway.ray_network import keep_serve_replica_on_loopback
from gateway.settings import GatewaySettings
from gateway.tokenization import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Ray CPUs a gateway replica asks for. It awaits the workers and streams (tokenizing is its only compute), as
# Serve's own proxy does at 0 CPUs; asking for a whole CPU left it unschedulable on a node whose CPUs the engine
# workers hold (2 workers x 1 CPU on a 2-CPU node).
GATEWAY_NUM_CPUS = 0.0
REQUEST_ID_HEADER = "x-request-id"


class _RequestIdMiddleware:
    """Echo the client's x-request-id (or a new one) on every response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope.get("headers", []):
            if k == b"x-request-id":
                rid = v.decode("latin-1")[:256]
                break
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class Gateway:
    """The request handling behind the routes; one per app."""

    def __init__(self, backend: ServingBackend, settings: GatewaySettings) -> None:
        self.backend = backend
        self.settings = settings
        self.info = backend.model_info()
        self.tokenizer = Tokenizer(load_tokenizer(self.info.path))
        self.admission = Admission(settings, self.info, self.tokenizer)
        self.format = OpenAIFormat(self.info.name, self.tokenizer)
        self.drain = Drain(backend)

    # ---------------------------------------------------------------- checks

    def check_auth(self, request: HTTPRequest) -> None:
        # The key travels only in the Authorization header: a key in a URL ends up in access logs and
        # browser history (the dashboard page asks for it in a form and sends the header itself).
        key = self.settings.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.info.name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.info.name!r}",
                param="model",
                code="model_not_found",
            )

    # ---------------------------------------------------------------- routes

    def deadline(self, request: HTTPRequest) -> Deadline:
        return request_deadline(request.headers, self.settings.request_timeout_s)

    async def completions(self, request: HTTPRequest) -> Response:
        received = time.monotonic()  # where the time to first token starts
        self.drain.check()
        self.check_auth(request)
        deadline = self.deadline(request)
        body: CompletionRequest = parse_body(CompletionRequest, await deadline.bound(request.body()))
        self.check_model(body.model)
        self.admission.check_bounds(body, self.backend.max_in_flight())
        self.admission.check_logprobs(body)
        sched = self.admission.scheduling(request.headers, body)
        prompts = await deadline.bound(self.admission.completion_prompts(body))
        max_tokens = [
            self.admission.check_length(ids, body.max_tokens, "prompt", "max_tokens") for ids in prompts
        ]
        reqs = self.admission.requests(
            new_id("cmpl"), prompts, max_tokens, body, sched, body.logprobs is not None
        )
        gens = start_generations(self.backend, reqs, self.tokenizer, body.stop_list(), deadline, received)
        self.drain.admit(gens)  # a drain that began while this request was read and tokenized refuses it
        base_id = gens[0].req.request_id
        if body.stream:
            return await self._stream(
                request, gens, deadline, lambda: self.format.completion_chunks(body, gens, base_id)
            )
        await self._collect(request, gens)
        return JSONResponse(self.format.completion_response(body, gens, base_id).model_dump())

    async def chat(self, request: HTTPRequest) -> Response:
        received = time.monotonic()  # where the time to first token starts
        self.drain.check()
        self.check_auth(request)
        deadline = self.deadline(request)
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await deadline.bound(request.body()))
        self.check_model(body.model)
        self.admission.check_bounds(body, self.backend.max_in_flight())
        self.admission.check_logprobs(body)
        sched = self.admission.scheduling(request.headers, body)
        ids = await deadline.bound(self.admission.chat_prompt(body))
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        mt = self.admission.check_length(ids, body.requested_max_tokens(), "messages", max_param)
        reqs = self.admission.requests(new_id("chatcmpl"), [ids], [mt], body, sched, body.logprobs)
        gens = start_generations(self.backend, reqs, self.tokenizer, body.stop_list(), deadline, received)
        self.drain.admit(gens)  # a drain that began while this request was read and tokenized refuses it
        g = gens[0]
        rid = g.req.request_id
        if body.stream:
            return await self._stream(request, gens, deadline, lambda: self.format.chat_chunks(body, g, rid))
        await self._collect(request, gens)
        return JSONResponse(self.format.chat_response(body, g, rid).model_dump())

    # ---------------------------------------------------------------- responses

    async def _collect(self, request: HTTPRequest, gens: list[Generation]) -> None:
        """Run every generation to its end (a JSON response), unless the client goes away first."""
        try:
            await until_disconnect(request, each(gens, Generation.collect))
        finally:
            await finish_shielded(self.backend, gens)

    async def _stream(
        self,
        request: HTTPRequest,
        gens: list[Generation],
        deadline: Deadline,
        make_chunks: Callable[[], AsyncIterator[str]],
    ) -> Response:
        # Wait for admission and the first token before answering 200, so that a full queue is a
        # real 429 and a refused request a real 4xx, not an error inside a 200 stream.
        try:
            await until_disconnect(request, each(gens, Generation.prime))
        except BaseException:
            await finish_shielded(self.backend, gens)
            raise

        async def body() -> AsyncIterator[str]:
            try:
                async for piece in make_chunks():
                    yield piece
            except BackendError as e:
                # Headers are gone already: report in the stream, as OpenAI-compatible servers do.
                yield sse(error_body(str(e), _error_type(e.status), code=e.code))
            yield SSE_DONE

        return StreamResponse(body(), self.backend, gens, deadline)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _error_type(status: int) -> str:
    """OpenAI's error ``type`` for a backend error's status."""
    special = {408: "timeout_error", 429: "rate_limit_error"}
    return special.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _backend_error(e: BackendError) -> APIError:
    headers = {}
    if isinstance(e, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    return APIError(e.status, str(e) or e.code, type=_error_type(e.status), code=e.code, headers=headers)


def create_app(
    backend: ServingBackend, settings: GatewaySettings | None = None, *, echo_request_id: bool = True
) -> FastAPI:
    """The gateway app over a live backend; the caller keeps ownership of the backend (shuts it down).

    ``echo_request_id=False`` leaves x-request-id to a proxy in front that already echoes it (Ray
    Serve's does, and generates one when absent), so responses do not carry it twice.
    """
    settings = settings or GatewaySettings()
    gw = Gateway(backend, settings)
    app = FastAPI(title="BucketServe", docs_url=None, redoc_url=None, openapi_url=OPENAPI_PATH)
    install_openapi(app)
    app.state.gateway = gw
    app.state.drain = gw.drain

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(BackendError)
    async def _backend_exc(_: HTTPRequest, exc: BackendError) -> JSONResponse:
        return _error_response(_backend_error(exc))

    @app.exception_handler(ClientGone)
    async def _gone(_: HTTPRequest, exc: ClientGone) -> Response:
        # Nobody is listening; 499 is the usual log marker for "client closed request".
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "header")]
        param = ".".join(loc) or None
        msg = (
            f"{param}: {err.get('msg', 'invalid value')}" if param else str(err.get("msg", "invalid request"))
        )
        return _error_response(APIError(400, msg, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(_: HTTPRequest, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the gateway")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        return await gw.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Response:
        return await gw.chat(request)

    @app.get("/v1/models")
    async def models(request: HTTPRequest) -> JSONResponse:
        gw.check_auth(request)
        card = ModelCard(id=gw.info.name, created=now_s(), max_model_len=gw.info.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if gw.drain.draining:
            return JSONResponse(gw.drain.health(), status_code=503)
        try:
            state = await backend.health()
        except Exception as e:
            return JSONResponse({"ready": False, "error": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse(state, status_code=200 if state.get("ready") else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await backend.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/")
    async def root() -> RedirectResponse:
        # A person who opens the server's address in a browser lands on the dashboard.
        return RedirectResponse("/dashboard", status_code=307)

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        # The page holds no data, so it is open: with an API key set it asks for the key in a form
        # and sends it with each poll of /dashboard/data, which is guarded like /v1/*.
        from monitor.dashboard import page_html

        return HTMLResponse(page_html("/dashboard/data", settings.dashboard_refresh_ms))

    @app.get("/dashboard/data")
    async def dashboard_data(request: HTTPRequest, window_s: float = 900.0) -> JSONResponse:
        gw.check_auth(request)
        if not math.isfinite(window_s) or window_s <= 0:
            raise APIError(400, f"window_s must be a positive number, got {window_s}", param="window_s")
        return JSONResponse(await backend.dashboard_data(window_s))

    # Starlette puts the middleware added last outermost: the x-request-id is echoed on a 413 too.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if echo_request_id:
        app.add_middleware(_RequestIdMiddleware)
    return app


# --------------------------------------------------------------------------- Ray Serve


# Routes that dashboards, probes and scrapers poll every few seconds: their access log lines drown the rest.
POLLED_ROUTES = frozenset({"/health", "/metrics", "/dashboard/data"})


def _drop_polling_access_log(record: logging.LogRecord) -> bool:
    return not (
        getattr(record, "serve_access_log", False) and getattr(record, "route", None) in POLLED_ROUTES
    )


def _preload_tokenizer(model: str) -> None:
    try:
        from engine.model_loader import resolve_model_path

        load_tokenizer(str(resolve_model_path(model)))
    except Exception:  # the app's own load reports it
        logger.debug("preloading the tokenizer of %s failed", model, exc_info=True)


@serve.ingress()
class GatewayDeployment:
    """Ray Serve ingress: each replica builds (or connects to) its backend, then its app."""

    def __init__(self, settings: GatewaySettings) -> None:
        keep_serve_replica_on_loopback()
        self._settings = settings
        if not settings.log_polling:
            # Serve's access log goes through its "ray.serve" logger, one record per request.
            logging.getLogger("ray.serve").addFilter(_drop_polling_access_log)
        self._preload: threading.Thread | None = None
        if settings.preload_tokenizer is not None:
            # The app's tokenizer needs transformers: a second or more of imports on a first load (and torch's
            # for a tokenizer class that only AutoTokenizer builds), done while the backend waits for the cluster
            # to finish warming up instead of after it (4 s of a 23 s start on two cores). The app is built after
            # the thread ends: transformers' lazy module does not take two threads importing it at once.
            self._preload = threading.Thread(
                target=_preload_tokenizer,
                args=(settings.preload_tokenizer,),
                name="gateway-preload",
                daemon=True,
            )
            self._preload.start()
        self._backend = settings.build_backend()
        self._drain_follower = None
        if settings.drain_signal is not None:
            from gateway.drain_signal import DrainFollower

            self._drain_follower = DrainFollower(settings.drain_signal)

    def __serve_build_asgi_app__(self) -> FastAPI:
        if self._preload is not None:
            self._preload.join()
        app = create_app(self._backend, self._settings, echo_request_id=False)
        if self._drain_follower is not None:
            self._drain_follower.follow(app.state.drain)
        return app

    async def check_health(self) -> None:
        """Ray Serve calls this every ``health_check_period_s``; a replica that fails it is replaced. It fails when
        the cluster's actors it talks to were replaced (the cluster was launched again under the same names):
        its successor connects to the running ones. An unready cluster (a worker down, warming up) does not fail
        it: a new replica would see the same, and ``/health`` already reports it."""
        stale = await self._backend.stale_actors()
        if stale:
            raise RuntimeError(f"the cluster's actors {stale} were replaced; this replica must reconnect")

    async def __del__(self) -> None:
        if self._drain_follower is not None:
            self._drain_follower.close()
        # The app does not own its backend (tests share one); the replica that built it does.
        await self._backend.shutdown()


def build_app(settings: GatewaySettings, **deployment_options: Any) -> serve.Application:
    """The gateway as a Ray Serve application: ``serve.run(build_app(settings), route_prefix="/")``.

    ``deployment_options`` go to ``serve.deployment`` (``num_replicas``, ``ray_actor_options``, ...).
    Streams are long-lived, so a replica takes many requests at once by default; a replica asks Ray for
    ``GATEWAY_NUM_CPUS`` unless ``ray_actor_options`` says otherwise.
    """
    if settings.backend_factory is None:
        raise ValueError(
            "build_app needs GatewaySettings.backend_factory: each replica builds its backend with it"
        )
    options = {
        "name": "gateway",
        "max_ongoing_requests": 1024,
        "ray_actor_options": {"num_cpus": GATEWAY_NUM_CPUS},
        **deployment_options,
    }
    return serve.deployment(GatewayDeployment, **options).bind(settings)
