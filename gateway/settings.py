"""How the HTTP gateway behaves: the settings an app (or a Ray Serve replica) is built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.backend import ServingBackend


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
    # Access-log the routes that are polled (health probes, metric scrapes, the dashboard's refresh) too.
    log_polling: bool = False

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
