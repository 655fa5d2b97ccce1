"""The seam between the HTTP gateway and whatever executes requests.

The gateway (``gateway/app.py``) speaks only to a :class:`ServingBackend`. Backends:

- ``RayClusterBackend`` (``gateway/ray_backend.py``): the disaggregated or colocated Ray cluster
  (controller, prefill and decode actors, monitor);
- ``LocalEngineBackend`` (``gateway/local_backend.py``): one in-process engine driven by a thread,
  for development and for testing the HTTP layer on a real model without Ray.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.request import Request, RequestOutput
from monitor.records import RequestRecord


class BackendError(Exception):
    """Base class; ``status`` is the HTTP status the gateway answers with."""

    status = 500
    code = "internal_error"


class Rejected(BackendError):
    """The request can never be served as asked (too long, ...): 400, message names the limit."""

    status = 400
    code = "invalid_request"


class Overloaded(BackendError):
    """Admission queue full: 429 with Retry-After."""

    status = 429
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(BackendError):
    """Workers not up or not warmed: 503."""

    status = 503
    code = "unavailable"


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients send as "model"
    path: str  # folder of the checkpoint (for the tokenizer and chat template)
    max_model_len: int
    eos_token_ids: tuple[int, ...]


class ServingBackend(abc.ABC):
    @abc.abstractmethod
    def model_info(self) -> ModelInfo: ...

    @abc.abstractmethod
    def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Yield outputs (new tokens, batched per engine step) until one has ``finished=True``.

        Raises Rejected / Overloaded / Unavailable before the first yield when it cannot accept.
        Cancelling the iterator (client gone) must abort the request and free its KV everywhere.
        The gateway also calls :meth:`abort` then, so ``abort`` of a finished or unknown id is a no-op.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def health(self) -> dict:
        """{"ready": bool, "workers": [{"id", "role", "up", "warmed", ...}], ...}"""

    async def metrics_text(self) -> str:
        """Prometheus exposition of the monitor, '' where there is none."""
        return ""

    async def dashboard_data(self, window_s: float) -> dict:
        return {}

    async def record(self, rec: RequestRecord) -> None:  # noqa: B027 - optional
        """One finished request as the gateway measured it (TTFT, TPOT, end-to-end, SLO met).

        Called once per request after its last byte is sent; a backend with a monitor stores it.
        Failures here are logged by the gateway and never reach the client.
        """

    async def shutdown(self) -> None:  # noqa: B027 - optional
        pass


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
    # Priority class of a request that names none.
    default_priority: str = "online"
    # Largest `logprobs` a completion request may ask for (as in OpenAI's API).
    max_logprobs: int = 20
    dashboard_refresh_ms: int = 2000

    def __post_init__(self) -> None:
        for name in ("default_slo_ttft_ms", "default_slo_tpot_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"GatewaySettings.{name} must be a positive number, got {value!r}")
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
        if not isinstance(self.dashboard_refresh_ms, int) or self.dashboard_refresh_ms < 250:
            raise ValueError(
                f"GatewaySettings.dashboard_refresh_ms must be an int >= 250, got {self.dashboard_refresh_ms!r}"
            )

    def build_backend(self) -> ServingBackend:
        if self.backend_factory is None:
            raise ValueError("GatewaySettings.backend_factory is not set: nothing to build the backend from")
        return self.backend_factory()
