"""``bucketserve bench kv``: KV transfer throughput on this machine.

For the KV of a 2K-token and a 16K-token prompt on the ``small`` model geometry (8 layers, 4 KV
heads, head dim 64, fp32: 16 KiB per token), it times, in one run and against one receiving process:
the ``grpc`` backend on loopback, the same-node fast path (``shm``), and a raw TCP socket moving the
same number of bytes (the practical limit for a socket here). Each transfer is timed from the first
byte sent to the receiver's acknowledgement, after the data is in the receiver's paged cache. It
also times a 2K-token prefill to give the transfer's share of prefill time.
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

from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import TransferConfig, create_transport
from kv_transfer.endpoint import EndpointProcess

SMALL_SPEC = KVCacheSpec(
    architecture="LlamaForCausalLM", num_layers=8, num_kv_heads=4, head_dim=64, block_size=16
)
DEFAULT_OUT = Path("bench/results/kv.json")


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "kv", help="KV transfer throughput: gRPC, same-node fast path, raw socket"
    )
    p.add_argument(
        "--tokens", type=int, nargs="+", default=[2048, 16384], help="prompt lengths whose KV is moved"
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed transfers per size and path (median reported)"
    )
    p.add_argument("--chunk-mb", type=float, default=4.0, help="chunk size of the transports")
    p.add_argument("--streams", type=int, default=2, help="parallel gRPC streams per transfer")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length of the prefill timing")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill timing")
    p.add_argument("--json", action="store_true", help="print the summary JSON as the last line")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report path (.json; a .md goes beside it)")
    p.set_defaults(func=run)


# -- raw socket baseline -------------------------------------------------------------------------


def _socket_sink(port_q, nbytes: int, count: int) -> None:  # pragma: no cover - child process
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(count):
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if n == 0:
                return
            got += n
        conn.sendall(b"k")
    conn.close()
    srv.close()


def time_socket(payload: memoryview, repeats: int) -> list[float]:
    """Seconds per transfer of ``payload`` over a loopback TCP socket to another process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_socket_sink, args=(q, payload.nbytes, repeats + 1), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for i in range(repeats + 1):  # the first one warms the connection up
        t0 = time.perf_counter()
        sock.sendall(payload)
        if sock.recv(1) != b"k":
            raise RuntimeError("socket sink closed early")
        if i:
            times.append(time.perf_counter() - t0)
    sock.close()
    proc.join(timeout=10)
    return times


# -- transports ----------------------------------------------------------------------------------


def time_transport(
    backend: str,
    cache: KVCache,
    alloc: BlockAllocator,
    endpoint: EndpointProcess,
    cfg: TransferConfig,
    tokens: int,
    repeats: int,
) -> tuple[list[float], str]:
    sender = create_transport(backend, cache, alloc, cfg)
    times: list[float] = []
    path = backend
    try:
        for i in range(repeats + 1):
            ids = alloc.allocate(cache.spec.blocks_for_tokens(tokens))
            m = sender.send(endpoint.wait_ready(), f"{backend}-{tokens}-{i}", ids, tokens, first_token=1)
            got = endpoint.receive(60, with_data=False)  # frees the receiver's blocks
            if got is None or got["bytes_received"] != m.bytes:
                raise RuntimeError(f"{backend}: transfer {i} not received intact")
            path = m.backend
            if i:  # the first transfer warms up connections and the shared-memory ring
                times.append(m.latency_s)
    finally:
        sender.close()
    return times, path


# -- prefill -------------------------------------------------------------------------------------


def time_prefill(num_tokens: int, repeats: int = 2) -> float:
    """Seconds for one forward pass of a random-weight Llama with the ``small`` geometry over
    ``num_tokens`` tokens (Hugging Face transformers, eager, fp32, no grad)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=max(4096, num_tokens),
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, num_tokens))  # [1, T]
    times = []
    with torch.no_grad():
        model(ids)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- report --------------------------------------------------------------------------------------


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run(args: argparse.Namespace) -> int:
    spec = SMALL_SPEC
    chunk = int(args.chunk_mb * (1 << 20))
    max_tokens = max(args.tokens)
    num_blocks = spec.blocks_for_tokens(max_tokens) + 8
    cache = KVCache(spec, num_blocks)
    cache.data.normal_()
    alloc = BlockAllocator(num_blocks)
    base = dict(chunk_bytes=chunk, max_message_bytes=chunk + (8 << 20), rpc_timeout_s=120.0)
    grpc_cfg = TransferConfig(**base, num_streams=args.streams, same_node_fast_path=False)
    shm_cfg = TransferConfig(**base, shm_ring_bytes=max(64 << 20, 4 * chunk))
    endpoint = EndpointProcess("grpc", spec, num_blocks, TransferConfig(**base))
    rows = []
    try:
        endpoint.wait_ready()
        for tokens in sorted(args.tokens):
            nbytes = spec.blocks_for_tokens(tokens) * spec.bytes_per_block
            g, _ = time_transport("grpc", cache, alloc, endpoint, grpc_cfg, tokens, args.repeats)
            s, path = time_transport("shm", cache, alloc, endpoint, shm_cfg, tokens, args.repeats)
            # The socket moves the same bytes, from the same cache memory.
            payload = memoryview(cache.data.view(-1).view(torch.uint8).numpy())[:nbytes]
            k = time_socket(payload, args.repeats)
            rows.append(
                {
                    "tokens": tokens,
                    "bytes": nbytes,
                    "grpc_s": statistics.median(g),
                    "local_s": statistics.median(s),
                    "socket_s": statistics.median(k),
                    "grpc_gbps": _gbps(nbytes, statistics.median(g)),
                    "local_gbps": _gbps(nbytes, statistics.median(s)),
                    "socket_gbps": _gbps(nbytes, statistics.median(k)),
                    "local_backend": path,
                }
            )
            print(
                f"{tokens:>6} tokens {nbytes / 2**20:7.1f} MiB: grpc {rows[-1]['grpc_gbps']:.2f} GB/s, "
                f"{path} {rows[-1]['local_gbps']:.2f} GB/s, socket {rows[-1]['socket_gbps']:.2f} GB/s",
                flush=True,
            )
    finally:
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
    }
    prefill_s = None
    if not args.no_prefill:
        prefill_s = time_prefill(args.prefill_tokens)
        ref = min(rows, key=lambda r: abs(r["tokens"] - args.prefill_tokens))
        summary["transfer_share_of_prefill"] = round(ref["grpc_s"] / prefill_s, 4)
        summary["local_transfer_share_of_prefill"] = round(ref["local_s"] / prefill_s, 4)
        summary["prefill_s"] = round(prefill_s, 4)
        summary["prefill_tokens"] = args.prefill_tokens
    command = "bucketserve bench kv " + " ".join(
        shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:])[2:]
    )
    report = {
        "command": command,
        "summary": summary,
        "rows": rows,
        "grpc_streams": args.streams,
        "chunk_bytes": chunk,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(report, prefill_s))
    print(f"report: {args.out} and {args.out.with_suffix('.md')}")
    if args.json:
        print(json.dumps(summary))
    return 0


def _markdown(report: dict, prefill_s: float | None) -> str:
    s = report["summary"]
    lines = [
        "# KV transfer benchmark",
        "",
        f"Command: `{report['command']}`",
        "",
        "Model geometry `small` (8 layers, 4 KV heads, head dim 64, fp32, block 16); receiver in a separate "
        "process on 127.0.0.1; median of the timed transfers; time = first byte to acknowledgement.",
        "",
        "| tokens | MiB | gRPC GB/s | same-node GB/s | raw socket GB/s | gRPC / socket | same-node / socket |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['grpc_gbps']:.2f} | {r['local_gbps']:.2f} ({r['local_backend']}) "
            f"| {r['socket_gbps']:.2f} | {r['grpc_gbps'] / r['socket_gbps']:.2f} | {r['local_gbps'] / r['socket_gbps']:.2f} |"
        )
    if prefill_s is not None:
        lines += [
            "",
            f"Prefill of {s['prefill_tokens']} tokens (transformers LlamaForCausalLM forward, small geometry, random "
            f"weights, eager fp32): {prefill_s * 1000:.0f} ms. Transfer of its KV, not overlapped: gRPC "
            f"{s['transfer_share_of_prefill']:.1%}, same-node {s['local_transfer_share_of_prefill']:.1%} of prefill time.",
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
