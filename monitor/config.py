"""Monitor configuration: one frozen record, validated when built, errors naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

StoreKind = Literal["memory", "redis"]

# Rolled-up series resolutions in seconds: fine for live charts, coarse for the day view.
RESOLUTIONS_S: tuple[int, ...] = (10, 60)


@dataclass(frozen=True)
class MonitorConfig:
    store: StoreKind = "memory"
    redis_url: str | None = None
    # A worker whose last heartbeat is older than this shows as down.
    heartbeat_ttl_s: float = 10.0
    # How long per-request records and rolled-up series are kept (default one day).
    retention_s: float = 24 * 3600.0
    # Per-request records kept at most (the newest win); bounds memory under any load.
    max_requests: int = 10_000
    # Window for the live rates and ratios the controller and /metrics read.
    rate_window_s: float = 60.0
    # Namespace for every Redis key, so several clusters can share one Redis.
    key_prefix: str = "bucketserve"
    # Redis client bounds, so that an unreachable or hung Redis costs a caller about a second, not
    # redis-py's 5 s per socket operation: per-operation and connect timeouts, and retries of an operation
    # whose connection failed (exponential backoff with jitter) before the store counts Redis as down.
    redis_socket_timeout_s: float = 1.0
    redis_connect_timeout_s: float = 1.0
    redis_retries: int = 1
    # While Redis is down the monitor answers from memory and tries Redis again this often.
    redis_reconnect_s: float = 1.0

    def __post_init__(self) -> None:
        if self.store not in ("memory", "redis"):
            raise ValueError(f"MonitorConfig.store must be 'memory' or 'redis', got {self.store!r}")
        if self.store == "redis":
            url = self.redis_url
            if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(
                    "MonitorConfig.redis_url must be a redis://, rediss:// or unix:// URL "
                    f"when store is 'redis', got {url!r}"
                )
        elif self.redis_url is not None:
            raise ValueError(
                f"MonitorConfig.redis_url is only used with store='redis', got {self.redis_url!r}"
            )
        _positive("heartbeat_ttl_s", self.heartbeat_ttl_s)
        _positive("rate_window_s", self.rate_window_s)
        _positive("retention_s", self.retention_s)
        for name in ("redis_socket_timeout_s", "redis_connect_timeout_s", "redis_reconnect_s"):
            _positive(name, getattr(self, name))
        if (
            isinstance(self.redis_retries, bool)
            or not isinstance(self.redis_retries, int)
            or self.redis_retries < 0
        ):
            raise ValueError(f"MonitorConfig.redis_retries must be an int >= 0, got {self.redis_retries!r}")
        if self.retention_s < max(RESOLUTIONS_S):
            raise ValueError(
                f"MonitorConfig.retention_s must be >= {max(RESOLUTIONS_S)} (one coarse slot), "
                f"got {self.retention_s!r}"
            )
        if (
            isinstance(self.max_requests, bool)
            or not isinstance(self.max_requests, int)
            or self.max_requests < 1
        ):
            raise ValueError(f"MonitorConfig.max_requests must be an int >= 1, got {self.max_requests!r}")
        if (
            not isinstance(self.key_prefix, str)
            or not self.key_prefix
            or any(c.isspace() for c in self.key_prefix)
        ):
            raise ValueError(
                f"MonitorConfig.key_prefix must be a non-empty string without spaces, got {self.key_prefix!r}"
            )

    @classmethod
    def for_url(cls, redis_url: str | None, **overrides: object) -> MonitorConfig:
        """The config a `--redis-url` flag implies: Redis when given, memory otherwise."""
        if redis_url:
            return cls(store="redis", redis_url=redis_url, **overrides)  # type: ignore[arg-type]
        return cls(**overrides)  # type: ignore[arg-type]


def _positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or math.isinf(value)
        or value <= 0
    ):
        raise ValueError(f"MonitorConfig.{name} must be a finite number > 0, got {value!r}")
