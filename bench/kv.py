"""``bucketserve bench kv``: KV transfer throughput on this machine.

For the KV of a 2K-token and a 16K-token prompt on the ``small`` model geometry (8 layers, 4 KV
heads, head dim 64, fp32: 16 KiB per token), it times, in one run and against one receiving process:
the ``grpc`` backend on loopback, the same-node fast path (``shm``), and a raw TCP socket moving the
same number of bytes (the practical limit for a socket here). Each transfer is timed from the first
byte sent to the receiver's acknowledgement, after the data is in the receiver's paged cache. The
paths take turns in rounds (the host is shared), and medians with their spread are reported. It
also runs a 2K-token prefill through the engine and gives the transfer's share of its time, both
sent after the prefill and streamed layer by layer while it runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.kv_endpoint import EndpointProcess
from bench.kv_prefill_share import time_prefill_share
from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import TransferConfig, create_transport

SMALL_SPEC = KVCacheSpec(
    architecture="LlamaForCausalLM", num_layers=8, num_kv_heads=4, head_dim=64, block_size=16
)
DEFAULT_OUT = Path("bench/results/kv.json")
# The transport's own defaults (TransferConfig), which `--grid` runs picked.
DEFAULT_CHUNK_MB = TransferConfig.chunk_bytes / (1 << 20)
DEFAULT_STREAMS = TransferConfig.num_streams
DEFAULT_SHM_CHUNK_MB = TransferConfig.shm_chunk_bytes / (1 << 20)


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "kv", help="KV transfer throughput: gRPC, same-node fast path, raw socket; share of prefill"
    )
    p.add_argument(
        "--tokens", type=int, nargs="+", default=[2048, 16384], help="prompt lengths whose KV is moved"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="timed rounds per size; a round moves the payload once over every path, in rotating order",
    )
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB, help="chunk size of gRPC")
    p.add_argument(
        "--shm-chunk-mb", type=float, default=DEFAULT_SHM_CHUNK_MB, help="chunk size of the same-node path"
    )
    p.add_argument("--streams", type=int, default=DEFAULT_STREAMS, help="parallel gRPC streams per transfer")
    p.add_argument(
        "--grid",
        action="store_true",
        help="also time gRPC at chunk sizes {1,2,4,8} MiB x streams {1,2,4} and the same-node path at "
        "{2,8,16} MiB chunks (interleaved in the rounds)",
    )
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length of the prefill timing")
    p.add_argument(
        "--prefill-repeats", type=int, default=3, help="rounds of (prefill, prefill+send, streamed prefill)"
    )
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill timing")
    p.add_argument("--json", action="store_true", help="print the summary JSON as the last line")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report path (.json; a .md goes beside it)")
    p.set_defaults(func=run)


# -- raw socket baseline -------------------------------------------------------------------------


def _socket_sink(port_q) -> None:  # pragma: no cover - child process
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(0)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            break
        nbytes = int.from_bytes(head, "little")
        if len(buf) < nbytes:
            buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if n == 0:
                return
            got += n
        conn.sendall(b"k")
    conn.close()
    srv.close()


class SocketPath:
    """A loopback TCP connection to a sink process that reads each payload into one buffer and acks."""

    name = "socket"

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_socket_sink, args=(q,), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once(self, payload: memoryview) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(payload.nbytes.to_bytes(8, "little"))
        self.sock.sendall(payload)
        if self.sock.recv(1) != b"k":
            raise RuntimeError("socket sink closed early")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.join(timeout=10)


# -- transports ----------------------------------------------------------------------------------


class TransportPath:
    """One sending transport to the receiving endpoint; each ``once`` moves one request's KV."""

    def __init__(
        self,
        name: str,
        backend: str,
        cache: KVCache,
        alloc: BlockAllocator,
        endpoint: EndpointProcess,
        cfg: TransferConfig,
    ) -> None:
        self.name = name
        self.cache = cache
        self.alloc = alloc
        self.endpoint = endpoint
        self.sender = create_transport(backend, cache, alloc, cfg)
        self.path = backend
        self._n = 0

    def once(self, tokens: int) -> float:
        self._n += 1
        ids = self.alloc.allocate(self.cache.spec.blocks_for_tokens(tokens))
        rid = f"{self.name}-{tokens}-{self._n}"
        m = self.sender.send(self.endpoint.wait_ready(), rid, ids, tokens, first_token=1)
        got = self.endpoint.receive(60, with_data=False)  # frees the receiver's blocks
        if got is None or got["bytes_received"] != m.bytes:
            raise RuntimeError(f"{self.name}: transfer {rid} not received intact")
        self.path = m.backend
        return m.latency_s

    def close(self) -> None:
        self.sender.close()


def _stats(times: list[float], nbytes: int) -> dict:
    """Median and spread (min, max) of the timed transfers, as seconds and GB/s."""
    med = statistics.median(times)
    return {
        "s": med,
        "gbps": nbytes / med / 1e9,
        "gbps_min": nbytes / max(times) / 1e9,
        "gbps_max": nbytes / min(times) / 1e9,
        "n": len(times),
    }


def time_paths(paths: list, tokens: int, payload: memoryview, repeats: int) -> dict[str, list[float]]:
    """Rounds over every path, the order rotating each round, so load from other processes on
    the host hits every path alike; the first round warms connections and pages up, untimed."""
    times: dict[str, list[float]] = {p.name: [] for p in paths}
    for r in range(repeats + 1):
        k = r % len(paths)
        for p in paths[k:] + paths[:k]:
            t = p.once(payload) if isinstance(p, SocketPath) else p.once(tokens)
            if r:
                times[p.name].append(t)
    return times


# -- report --------------------------------------------------------------------------------------


def _grpc_cfg(chunk: int, streams: int) -> TransferConfig:
    return TransferConfig(
        chunk_bytes=chunk,
        max_message_bytes=chunk + (8 << 20),
        rpc_timeout_s=120.0,
        num_streams=streams,
        same_node_fast_path=False,
    )


def run(args: argparse.Namespace) -> int:
    spec = SMALL_SPEC
    chunk = int(args.chunk_mb * (1 << 20))
    max_tokens = max(args.tokens)
    num_blocks = spec.blocks_for_tokens(max_tokens) + 8
    # The sending cache lives in shared memory, as a prefill worker's does when it may use the
    # zero-copy same-node path; gRPC and the socket read the same memory.
    cache = KVCache(spec, num_blocks, shared_memory=True)
    cache.data.normal_()
    alloc = BlockAllocator(num_blocks)
    shm_chunk = int(args.shm_chunk_mb * (1 << 20))
    big_chunk = max(chunk, 8 << 20)

    def shm_cfg(c: int) -> TransferConfig:
        return TransferConfig(
            chunk_bytes=chunk,
            shm_chunk_bytes=c,
            max_message_bytes=big_chunk + (8 << 20),
            rpc_timeout_s=120.0,
            shm_ring_bytes=max(64 << 20, 4 * c),
        )

    endpoint = EndpointProcess(
        "grpc", spec, num_blocks, TransferConfig(max_message_bytes=big_chunk + (8 << 20), rpc_timeout_s=120.0)
    )
    grid = [(c << 20, s) for c in (1, 2, 4, 8) for s in (1, 2, 4)] if args.grid else []
    rows = []
    paths: list = []
    try:
        endpoint.wait_ready()
        paths = [
            TransportPath("grpc", "grpc", cache, alloc, endpoint, _grpc_cfg(chunk, args.streams)),
            TransportPath("local", "shm", cache, alloc, endpoint, shm_cfg(shm_chunk)),
            SocketPath(),
        ]
        paths += [
            TransportPath(f"grpc-{c >> 20}MiB-x{s}", "grpc", cache, alloc, endpoint, _grpc_cfg(c, s))
            for c, s in grid
            if (c, s) != (chunk, args.streams)
        ]
        paths += [
            TransportPath(f"shm-{c}MiB", "shm", cache, alloc, endpoint, shm_cfg(c << 20))
            for c in ((2, 4, 8, 16) if args.grid else ())
            if c << 20 != shm_chunk
        ]
        for tokens in sorted(args.tokens):
            nbytes = spec.blocks_for_tokens(tokens) * spec.bytes_per_block
            # The socket moves the same bytes, from the same cache memory.
            payload = memoryview(cache.data.view(-1).view(torch.uint8).numpy())[:nbytes]
            times = time_paths(paths, tokens, payload, args.repeats)
            st = {name: _stats(t, nbytes) for name, t in times.items()}
            sock = st["socket"]
            row = {
                "tokens": tokens,
                "bytes": nbytes,
                "grpc_s": st["grpc"]["s"],
                "local_s": st["local"]["s"],
                "socket_s": sock["s"],
                "grpc_gbps": st["grpc"]["gbps"],
                "local_gbps": st["local"]["gbps"],
                "socket_gbps": sock["gbps"],
                "local_backend": paths[1].path,
                "spread_gbps": {k: [round(v["gbps_min"], 3), round(v["gbps_max"], 3)] for k, v in st.items()},
                # Per round ratio against the socket of the same round, then the median.
                "grpc_ratio_median": _round_ratio(times["grpc"], times["socket"]),
                "local_ratio_median": _round_ratio(times["local"], times["socket"]),
                "grid": {
                    k: {"gbps": round(v["gbps"], 3), "ratio": _round_ratio(times[k], times["socket"])}
                    for k, v in st.items()
                    if k != "socket"
                },
                "repeats": args.repeats,
            }
            rows.append(row)
            print(
                f"{tokens:>6} tokens {nbytes / 2**20:7.1f} MiB: grpc {row['grpc_gbps']:.2f} GB/s, "
                f"{row['local_backend']} {row['local_gbps']:.2f} GB/s, socket {row['socket_gbps']:.2f} GB/s "
                f"(medians of {args.repeats}; spread {row['spread_gbps']})",
                flush=True,
            )
            if grid:
                print(f"  grid: {row['grid']}", flush=True)
    finally:
        for p in paths:
            p.close()
        endpoint.close()
    big = max(rows, key=lambda r: r["tokens"])
    summary = {
        "grpc_gbps": round(big["grpc_gbps"], 3),
        "socket_gbps": round(big["socket_gbps"], 3),
        "local_gbps": round(big["local_gbps"], 3),
        "local_backend": big["local_backend"],
        "ratio": round(big["grpc_gbps"] / big["socket_gbps"], 3),
        "local_ratio": round(big["local_gbps"] / big["socket_gbps"], 3),
        "transfer_share_of_prefill": None,
        "repeats": args.repeats,
        "grpc_chunk_mib": args.chunk_mb,
        "grpc_streams": args.streams,
        "shm_chunk_mib": args.shm_chunk_mb,
    }
    share = None
    if not args.no_prefill:
        share = time_prefill_share(args.prefill_tokens, args.prefill_repeats, _grpc_cfg(chunk, args.streams))
        print(f"prefill share ({args.prefill_tokens} tokens, gRPC): {share}", flush=True)
        summary["transfer_share_of_prefill"] = round(share["share_overlapped"], 4)
        summary["transfer_share_not_overlapped"] = round(share["share_not_overlapped"], 4)
        summary["transfer_share_max"] = round(share["share_overlapped_max"], 4)
        summary["transfer_share_not_overlapped_max"] = round(share["share_not_overlapped_max"], 4)
        summary["prefill_s"] = round(share["prefill_s"], 3)
        summary["prefill_tokens"] = args.prefill_tokens
    command = "bucketserve bench kv " + " ".join(
        shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:])[2:]
    )
    report = {
        "command": command,
        "summary": summary,
        "rows": rows,
        "prefill": share,
        "grpc_streams": args.streams,
        "chunk_bytes": chunk,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(report))
    print(f"report: {args.out} and {args.out.with_suffix('.md')}")
    if args.json:
        print(json.dumps(summary))
    return 0


def _round_ratio(times: list[float], socket_times: list[float]) -> float:
    return round(statistics.median(s / t for t, s in zip(times, socket_times, strict=True)), 3)


def _markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "# KV transfer benchmark",
        "",
        f"Command: `{report['command']}`",
        "",
        "Model geometry `small` (8 layers, 4 KV heads, head dim 64, fp32, block 16); receiver in a separate "
        "process on 127.0.0.1; each round moves the payload once over every path (rotating order); median "
        "of the timed rounds, [min, max] in brackets; ratios are of the medians, with the median of the "
        "per-round ratios in parentheses; time = first byte to acknowledgement.",
        "",
        "| tokens | MiB | gRPC GB/s | same-node GB/s | raw socket GB/s | gRPC / socket | same-node / socket |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        sp = r["spread_gbps"]
        lines.append(
            f"| {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['grpc_gbps']:.2f} {sp['grpc']} "
            f"| {r['local_gbps']:.2f} {sp['local']} ({r['local_backend']}) | {r['socket_gbps']:.2f} {sp['socket']} "
            f"| {r['grpc_gbps'] / r['socket_gbps']:.2f} ({r['grpc_ratio_median']:.2f}) "
            f"| {r['local_gbps'] / r['socket_gbps']:.2f} ({r['local_ratio_median']:.2f}) |"
        )
    grid = report["rows"][-1]["grid"]
    if len(grid) > 1:
        lines += [
            "",
            "gRPC grid (largest payload): " + ", ".join(f"{k} {v['gbps']} GB/s" for k, v in grid.items()),
        ]
    p = report.get("prefill")
    if p:
        lines += [
            "",
            f"Prefill of {s['prefill_tokens']} tokens through the engine (`small`, CPU, eager, fp32): "
            f"{p['prefill_s'] * 1000:.0f} ms (median of {p['rounds']}). gRPC transfer of its KV after the "
            f"prefill: {p['sequential_transfer_s'] * 1000:.1f} ms = {p['share_not_overlapped']:.2%}; streamed layer "
            f"by layer during the prefill, exposed (end of prefill to ack): {p['streamed_exposed_s'] * 1000:.1f} ms "
            f"= {p['share_overlapped']:.2%} (slowest transfer over fastest prefill: {p['share_overlapped_max']:.2%} "
            f"streamed, {p['share_not_overlapped_max']:.2%} after). Prefill alone ranged "
            f"{p['prefill_s_min']:.1f}-{p['prefill_s_max']:.1f} s; the streamed run's start-to-ack minus the "
            f"median prefill alone: {p['share_added']:.1%}.",
        ]
    lines += ["", "```json", json.dumps(s), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bucketserve bench")
    register(parser.add_subparsers(dest="bench"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = ["bench", *argv]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
