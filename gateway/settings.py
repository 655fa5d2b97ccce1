"""How the HTTP gateway behaves: the settings an app (or a Ray Serve replica) is built from."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.backend import ServingBackend

# The per-request bounds among the settings below (each a positive int).
LIMITS = (
    "max_body_bytes",
    "max_prompts",
    "max_stop_strings",
    "max_stop_chars",
    "max_stop_token_ids",
    "max_messages",
)


@dataclass(frozen=True)
class GatewaySettings:
    """How the HTTP gateway behaves; picklable, so a Ray Serve replica can be built from it.

    ``backend_factory`` is called once inside the gateway replica (``gateway.app.build_app``) to
    build or connect to the backend there; ``gateway.app.create_app`` takes a backend directly and
    ignores it. It must be picklable: a module-level function, a ``functools.partial`` of one, or an
    object with ``__call__``.
    """

    backend_factory: Callable[[], ServingBackend] | None = None
    # When set, `Authorization: Bearer <api_key>` is required on /v1/* and the dashboard.
    api_key: str | None = None
    # SLOs of a request that sends no x-slo-ttft-ms / x-slo-tpot-ms header.
    default_slo_ttft_ms: float = 450.0
    default_slo_tpot_ms: float = 50.0
    # Seconds a request may take, from its headers to its last byte: past it, a JSON request gets a 408, a stream
    # ends with a timeout error, and the request is aborted everywhere (`gateway/deadline.py`). A client may ask
    # for less with the x-request-timeout-ms header, never for more.
    request_timeout_s: float = 600.0
    # Priority class of a request that names none.
    default_priority: str = "online"
    # Largest `logprobs` a completion request may ask for (as in OpenAI's API).
    max_logprobs: int = 20
    dashboard_refresh_ms: int = 2000
    # Access-log the routes that are polled (health probes, metric scrapes, the dashboard's refresh) too.
    log_polling: bool = False
    # The model (a built-in name or a checkpoint folder) whose tokenizer a replica loads while its backend
    # connects to a cluster still warming up: transformers' first load imports seconds of modules, which then
    # overlap the wait. The app still uses the tokenizer its backend names. None: no preload.
    preload_tokenizer: str | None = None
    # (Ray namespace, actor name) of the drain signal each Ray Serve replica follows (``gateway/drain_signal.py``):
    # set by ``bucketserve serve``, which drains its replicas on SIGTERM or Ctrl-C; None: no such process.
    drain_signal: tuple[str, str] | None = None

    # Bounds on one request, so that no client can hold the gateway's memory or event loop, or the shared
    # decode loop, with one oversized request. Going over one is a 413 (the body) or a 400 naming the field.
    #
    # Request bodies above this many bytes get a 413 before they are read whole. The largest legitimate body is
    # a full batch of `max_prompts` prompts of max_model_len token ids each, about 8 bytes an id in JSON
    # ("123456, "): 256 x 2048 x 8 = 4 MiB at the default context of 2048. Raise it for longer contexts.
    max_body_bytes: int = 8 * 1024 * 1024
    # Prompts in one completion request (a list of strings or of token-id lists); each becomes an engine request.
    max_prompts: int = 256
    # Stop strings in one request, and characters in each. The engine looks for them in the decoded tail of the
    # output on every step, decoding 4 tokens per character of the longest (`engine/llm_engine.py`), on the loop
    # thread that runs the whole batch; the gateway holds back that many characters of a stream as well.
    max_stop_strings: int = 16
    max_stop_chars: int = 128
    # stop_token_ids in one request: each is compared with every sampled token, and the list travels with the
    # request to every worker.
    max_stop_token_ids: int = 256
    # Messages in one chat request (the chat template renders each of them in Python).
    max_messages: int = 2048

    def __post_init__(self) -> None:
        for name in ("default_slo_ttft_ms", "default_slo_tpot_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"GatewaySettings.{name} must be a positive number, got {value!r}")
        timeout = self.request_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(f"GatewaySettings.request_timeout_s must be a positive number, got {timeout!r}")
        if self.default_priority not in ("online", "offline"):
            raise ValueError(
                f"GatewaySettings.default_priority must be 'online' or 'offline', got {self.default_priority!r}"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("GatewaySettings.api_key must be a non-empty string or None")
        if (
            isinstance(self.max_logprobs, bool)
            or not isinstance(self.max_logprobs, int)
            or self.max_logprobs < 0
        ):
            raise ValueError(f"GatewaySettings.max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        for name in LIMITS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GatewaySettings.{name} must be an int >= 1, got {value!r}")
        if self.drain_signal is not None and not (
            isinstance(self.drain_signal, tuple)
            and len(self.drain_signal) == 2
            and all(isinstance(x, str) and x for x in self.drain_signal)
        ):
            raise ValueError(
                f"GatewaySettings.drain_signal must be (namespace, actor name) or None, got {self.drain_signal!r}"
            )
        if not isinstance(self.dashboard_refresh_ms, int) or self.dashboard_refresh_ms < 250:
            raise ValueError(
                f"GatewaySettings.dashboard_refresh_ms must be an int >= 250, got {self.dashboard_refresh_ms!r}"
            )

    def build_backend(self) -> ServingBackend:
        if self.backend_factory is None:
            raise ValueError("GatewaySettings.backend_factory is not set: nothing to build the backend from")
        return self.backend_factory()
