"""A receiving KV endpoint in its own process, driven over a pipe: the decode side of a transfer
for benchmarks and cross-process tests (a real separate process, as a decode actor would be).
:class:`LocalEndpoint` offers the same calls in-process."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import torch

from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.base import KVTransport, create_transport
from kv_transfer.config import TransferConfig


def gather_tokens(cache: KVCache, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """A request's KV in token order: [L, 2, num_tokens, KVH, D] (independent of block size)."""
    spec = cache.spec
    blocks = cache.read_blocks(block_ids)  # [L, 2, n, block_size, KVH, D]
    return blocks.reshape(spec.num_layers, 2, -1, spec.num_kv_heads, spec.head_dim)[:, :, :num_tokens]


class _Core:
    """The commands an endpoint answers; the same code runs in-process and in the child."""

    def __init__(self, transport: KVTransport) -> None:
        self.t = transport

    def receive(self, timeout: float, keep: bool = False, with_data: bool = True) -> dict | None:
        got = self.t.receive(timeout)
        if got is None:
            return None
        out: dict[str, Any] = dict(got.__dict__)
        if with_data:
            # On the host, whatever the cache's device: the result crosses a process pipe.
            out["data"] = gather_tokens(self.t.cache, got.block_ids, got.num_tokens).cpu().clone()
        if not keep:  # the decode worker is done with the request
            with self.t.lock:
                self.t.allocator.free(got.block_ids)
        return out

    def stats(self) -> dict:
        with self.t.lock:
            self.t.allocator.check_integrity()
        return self.t.stats()

    def abort(self, request_id: str, final: bool = False) -> bool:
        return self.t.abort(request_id, "aborted by receiver", final)

    def free(self, block_ids: list[int]) -> None:
        with self.t.lock:
            self.t.allocator.free(block_ids)

    def admit_up_to(self, max_reserve_tokens: int | None) -> None:
        """As a decode worker judges its room: refuse a handshake whose reservation is over this many tokens
        (None: take whatever fits)."""
        limit = max_reserve_tokens
        self.t.receiver.admission = None if limit is None else (lambda hs, _need: hs.reserve_tokens <= limit)


def _child(
    conn,
    transport_name: str,
    spec: KVCacheSpec,
    num_blocks: int,
    config: TransferConfig,
    kwargs: dict,
    cache_device: str = "cpu",
) -> None:  # pragma: no cover - runs in the child process
    try:
        cache = KVCache(spec, num_blocks, device=cache_device)
        t = create_transport(transport_name, cache, BlockAllocator(num_blocks), config, **kwargs)
        conn.send(("ok", t.serve()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    core = _Core(t)
    while True:
        cmd, args = conn.recv()
        if cmd == "close":
            t.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(core, cmd)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class EndpointProcess:
    """Starts the ``transport_name`` backend receiving in a spawned process; ``address`` is what senders pass as peer.
    ``cache_device``: where the receiving KV cache lives (a decode worker's accelerator, or the host)."""

    def __init__(
        self,
        transport_name: str,
        spec: KVCacheSpec,
        num_blocks: int,
        config: TransferConfig | None = None,
        cache_device: str = "cpu",
        **transport_kwargs: Any,
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child,
            args=(
                child_conn,
                transport_name,
                spec,
                num_blocks,
                config or TransferConfig(),
                transport_kwargs,
                cache_device,
            ),
            daemon=True,
        )
        self.proc.start()
        self.address: str | None = None

    def wait_ready(self, timeout: float = 120.0) -> str:
        if self.address is None:
            self.address = self._reply(timeout)
        return self.address

    def _reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError("kv endpoint process did not answer")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"kv endpoint process failed:\n{value}")
        return value

    def _call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self.wait_ready()
        self._conn.send((cmd, args))
        return self._reply(timeout)

    def receive(self, timeout: float = 10.0, keep: bool = False, with_data: bool = True) -> dict | None:
        return self._call("receive", timeout, keep, with_data, timeout=timeout + 60)

    def stats(self) -> dict:
        return self._call("stats")

    def abort(self, request_id: str, final: bool = False) -> bool:
        return self._call("abort", request_id, final)

    def free(self, block_ids: list[int]) -> None:
        self._call("free", block_ids)

    def admit_up_to(self, max_reserve_tokens: int | None) -> None:
        self._call("admit_up_to", max_reserve_tokens)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("close", ()))
                self._conn.poll(10)
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()


class LocalEndpoint(_Core):
    """In-process twin of :class:`EndpointProcess` (same calls)."""

    def __init__(
        self,
        transport_name: str,
        spec: KVCacheSpec,
        num_blocks: int,
        config: TransferConfig | None = None,
        cache_device: str = "cpu",
        **transport_kwargs: Any,
    ) -> None:
        super().__init__(
            create_transport(
                transport_name,
                KVCache(spec, num_blocks, device=cache_device),
                BlockAllocator(num_blocks),
                config,
                **transport_kwargs,
            )
        )
        self.address = self.t.serve()

    def wait_ready(self, timeout: float = 0) -> str:
        return self.address

    def close(self) -> None:
        self.t.close()
