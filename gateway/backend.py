"""The seam between the HTTP gateway and whatever executes requests.

The gateway (``gateway/app.py``) speaks only to a :class:`ServingBackend`. Backends:

- ``RayClusterBackend`` (``gateway/cluster_backend.py``): the disaggregated or colocated Ray cluster
  (controller, prefill and decode actors, monitor);
- ``LocalEngineBackend`` (``gateway/local_backend.py``): one in-process engine driven by a thread,
  for exercising the HTTP layer on a real model without Ray (built from Python, not by ``serve``).

How the app itself behaves (auth, default SLOs, ...) is ``gateway/settings.py``'s ``GatewaySettings``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
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


class TimedOut(BackendError):
    """The request passed its deadline (``gateway/deadline.py``): 408, and it is aborted everywhere."""

    status = 408
    code = "request_timeout"


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
    async def abort(self, request_id: str) -> None:
        """Stop the request and free its KV. Its iterator, if still open, should end with a finished ABORT output:
        that is how the gateway's drain ends the streams it cuts (``gateway/drain.py``)."""

    def max_in_flight(self) -> int | None:
        """The most requests this backend holds at once before it answers Overloaded (None: no such bound).

        The gateway refuses a batch of more prompts than this with a 400, since it could never be admitted.
        """
        return None

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

    async def stale_actors(self) -> list[str]:
        """Names of the cluster's actors that this backend holds and that are no longer the ones running under those
        names (the cluster was stopped and launched again): a gateway replica with any must be replaced, and the
        new one connects to the running actors. None for a backend that owns what it serves."""
        return []

    async def shutdown(self) -> None:  # noqa: B027 - optional
        pass
