"""Redis backend: every gateway replica, the monitor and the dashboard share one view.

Layout under `<key_prefix>:` (all writes are commutative increments or last-value sets,
so concurrent writers need no locks or transactions):
- `totals`           hash of cumulative counters (no expiry)
- `ts:<res>:<start>` hash per series slot, expiring retention + res after its last write
- `workers`          hash worker_id -> JSON {stats, last_seen}
- `req:<id>`         JSON record, written with NX (a repeat is ignored) and EX retention
- `reqs`             list of request ids, newest first, trimmed to max_requests
- `doc:<name>`       small JSON documents (the bucket state)

The client is bounded (`MonitorConfig.redis_*`): each operation times out after about a second, a failed
connection is retried a set number of times with jittered exponential backoff, then the operation raises
one of `outage_errors`. The
registry wraps this store in a `FallbackStore`, so the monitor answers from memory while Redis is down and
returns to it when it is back; what is written during an outage is not copied to Redis afterwards.
"""

from __future__ import annotations

import math
import time

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from monitor.config import MonitorConfig
from monitor.store import Clock, HashOp, MonitorStore

# Backoff between retries of a failed operation: 50 ms doubling, capped at 0.5 s, jittered so that many
# clients losing Redis at once do not come back in lockstep.
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 0.5


class RedisStore(MonitorStore):
    # Connection-level failures (refused, reset, timed out, Redis still loading); a reply error is a bug.
    outage_errors = (redis.ConnectionError, redis.TimeoutError, OSError)

    def __init__(self, config: MonitorConfig, clock: Clock = time.time) -> None:
        super().__init__(config, clock)
        assert config.redis_url is not None  # guaranteed by MonitorConfig validation
        self._redis = redis.Redis.from_url(
            config.redis_url,
            decode_responses=True,
            socket_timeout=config.redis_socket_timeout_s,
            socket_connect_timeout=config.redis_connect_timeout_s,
            # Retries cover a pooled connection that died with a restarted server (the retry reconnects) and a
            # refused connect. A timed-out operation is not retried: Redis may yet apply it (our increments are
            # not idempotent), and the caller would wait once more for a server that is hung.
            retry=Retry(
                ExponentialWithJitterBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S),
                config.redis_retries,
                supported_errors=(redis.ConnectionError,),
            ),
        )
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            # Fail at start-up with the URL rather than on the first report.
            raise ConnectionError(f"monitor store: cannot reach Redis at {config.redis_url}: {exc}") from exc
        self._p = config.key_prefix + ":"

    def close(self) -> None:
        self._redis.close()

    def ping(self) -> None:
        self._redis.ping()

    def _apply(self, ops: list[HashOp]) -> None:
        if not ops:
            return
        pipe = self._redis.pipeline(transaction=False)
        for op in ops:
            key = self._p + op.key
            for name, value in op.incr.items():
                if value:
                    pipe.hincrbyfloat(key, name, value)
            if op.set:
                pipe.hset(key, mapping=op.set)
            if op.ttl_s is not None:
                pipe.pexpire(key, math.ceil(op.ttl_s * 1000))
        pipe.execute()

    def _read(self, keys: list[str]) -> list[dict[str, float]]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(self._p + key)
        return [{k: float(v) for k, v in raw.items()} for raw in pipe.execute()]

    def _put_worker(self, worker_id: str, doc: str) -> None:
        self._redis.hset(self._p + "workers", worker_id, doc)

    def _get_workers(self) -> dict[str, str]:
        return self._redis.hgetall(self._p + "workers")  # type: ignore[return-value]

    def _del_worker(self, worker_id: str) -> None:
        self._redis.hdel(self._p + "workers", worker_id)

    def _put_request(self, request_id: str, doc: str, ttl_s: float) -> bool:
        if not self._redis.set(self._p + "req:" + request_id, doc, nx=True, px=math.ceil(ttl_s * 1000)):
            return False
        pipe = self._redis.pipeline(transaction=False)
        pipe.lpush(self._p + "reqs", request_id)
        pipe.lrange(self._p + "reqs", self.config.max_requests, -1)
        pipe.ltrim(self._p + "reqs", 0, self.config.max_requests - 1)
        _, dropped, _ = pipe.execute()
        # Records pushed off the list go too, so max_requests bounds Redis memory as well.
        if dropped:
            self._redis.delete(*[self._p + "req:" + i for i in dropped])
        return True

    def _get_request(self, request_id: str) -> str | None:
        return self._redis.get(self._p + "req:" + request_id)  # type: ignore[return-value]

    def _recent_requests(self, limit: int) -> list[str]:
        if limit <= 0:
            return []
        ids = self._redis.lrange(self._p + "reqs", 0, limit - 1)
        if not ids:
            return []
        docs = self._redis.mget([self._p + "req:" + i for i in ids])  # type: ignore[union-attr]
        return [d for d in docs if d is not None]  # type: ignore[union-attr]

    def _put_doc(self, name: str, doc: str) -> None:
        self._redis.set(self._p + "doc:" + name, doc)

    def _get_doc(self, name: str) -> str | None:
        return self._redis.get(self._p + "doc:" + name)  # type: ignore[return-value]
