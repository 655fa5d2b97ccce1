"""The monitor store registry: backends by `MonitorConfig.store` name, and `create_store`.

The Redis backend is imported on use, so the memory store works where the redis client is absent. It comes
wrapped in a FallbackStore, which answers from memory through a Redis outage."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from monitor.config import MonitorConfig
from monitor.memory_store import MemoryStore
from monitor.store import Clock, MonitorStore

StoreFactory = Callable[[MonitorConfig, Clock], MonitorStore]
_BACKENDS: dict[str, StoreFactory] = {}


def register_store(kind: str, factory: StoreFactory) -> None:
    _BACKENDS[kind] = factory


def store_kinds() -> Iterable[str]:
    return tuple(_BACKENDS)


def create_store(config: MonitorConfig | None = None, clock: Clock = time.time) -> MonitorStore:
    config = config or MonitorConfig()
    try:
        factory = _BACKENDS[config.store]
    except KeyError:
        raise ValueError(
            f"MonitorConfig.store {config.store!r} has no backend; known: {sorted(_BACKENDS)}"
        ) from None
    return factory(config, clock)


def _redis_factory(config: MonitorConfig, clock: Clock) -> MonitorStore:
    from monitor.fallback_store import FallbackStore
    from monitor.redis_store import RedisStore

    # Redis must answer at start-up (RedisStore raises, naming the URL); an outage later costs figures, not
    # service: the monitor answers from memory until Redis is back.
    return FallbackStore(RedisStore(config, clock), config.redis_reconnect_s)


register_store("memory", MemoryStore)
register_store("redis", _redis_factory)
