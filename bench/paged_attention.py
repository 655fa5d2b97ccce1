"""Paged attention micro-benchmark: one layer's attention call on the ``small`` model geometry.

Times the C++ kernel (``engine.kernels``), its pure-torch fallback and the engine's current attention
(``_decode_attention`` on the flat block layout for decodes, SDPA on fresh K/V for prefills) with 8
query heads, 4 KV heads, head dim 64, fp32: decodes of batch 1, 8, 32, 128 at context 512 and prefills of
1x1024 and 8x256, block sizes 16 and 128, at 1 and 2 threads. Each time is the median ms of one call;
its memory floor is the K+V bytes the call must read divided by the copy bandwidth measured in the same
run with ``Tensor.copy_`` (read + write bytes per second), and ``x floor`` is the ratio of the two
(decodes are memory-bound; prefills are compute-bound, so their GFLOP/s is the figure to read).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import _MASKED, AttentionMetadata, _decode_attention
from engine.kernels import build
from engine.kernels.paged_attention_ref import paged_attention_ref

H, KVH, D = 8, 4, 64
DEFAULT_OUT = Path("bench/results/paged_attention")
# (name, [(q_len, seq_len)] per sequence)
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    *[(f"decode-b{b}-ctx512", [(1, 512)] * b) for b in (1, 8, 32, 128)],
    ("prefill-1x1024", [(1024, 1024)]),
    ("prefill-8x256", [(256, 256)] * 8),
]


def _median_ms(fn: Callable[[], object], min_s: float, max_reps: int) -> float:
    fn()  # warm-up
    times: list[float] = []
    gc.collect()
    gc.disable()  # as timeit does: a collection of the interpreter's heap is no part of the call
    try:
        start = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < min_s and len(times) < max_reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return statistics.median(times) * 1e3


def copy_bandwidth(mib: int = 256) -> float:
    """Bytes per second that ``copy_`` moves (read + write) between two tensors far larger than the caches."""
    src = torch.ones(mib << 18)  # fp32: mib MiB
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), 0.5, 10)
    return 2 * src.numel() * 4 / (ms / 1e3)


class Inputs:
    """One layer's cache with shuffled block ids, and the metadata of both layouts for the same batch."""

    def __init__(self, seqs: list[tuple[int, int]], bs: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        need = [-(-s // bs) for _, s in seqs]
        nb = sum(need)
        ids = list(range(nb))
        random.Random(seed).shuffle(ids)
        self.seqs = seqs
        self.null_block = nb
        self.kv_data = torch.randn(1, 2, nb + 1, bs, KVH, D, generator=g)  # [L=1, 2, NB + 1, BS, KVH, D]
        table = torch.full((len(seqs), max(need)), nb, dtype=torch.int32)  # [B, W]
        per_seq: list[list[int]] = []
        at = 0
        for i, n in enumerate(need):
            per_seq.append(ids[at : at + n])
            table[i, :n] = torch.tensor(per_seq[-1], dtype=torch.int32)
            at += n
        self.block_table = table
        self.per_seq_blocks = per_seq
        self.seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32)  # [B]
        starts = [0]
        for q, _ in seqs:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)  # [B + 1]
        self.q = torch.randn(starts[-1], H, D, generator=g)  # [T, H, D]
        self.out = torch.empty_like(self.q)
        self.scale = 1.0 / math.sqrt(D)
        self.bs = bs

    @property
    def kv_bytes(self) -> int:
        """K and V of every cached token, read once: the least any implementation must touch."""
        return 2 * int(self.seq_lens.sum()) * KVH * D * self.kv_data.element_size()

    @property
    def flops(self) -> int:
        """2 FLOPs per multiply-add of QK^T and of PV, over the keys each query sees (causal)."""
        seen = sum(q * (s - q) + q * (q + 1) // 2 for q, s in self.seqs)
        return 4 * H * D * seen

    def flat(self, fn: Callable[..., None]) -> Callable[[], None]:
        args = (self.out, self.q, self.kv_data[0, 0], self.kv_data[0, 1], self.block_table)
        return lambda: fn(*args, self.seq_lens, self.query_start_loc, self.scale)

    def engine_decode(self) -> Callable[[], torch.Tensor]:
        """The engine's flat block layout, as ModelRunner.prepare_decode builds it (no bucket padding)."""
        block_list: list[int] = []
        groups: list[int] = []
        valid: list[int] = []
        for i, ((_, seq_len), blocks) in enumerate(zip(self.seqs, self.per_seq_blocks, strict=True)):
            n = len(blocks)
            block_list += blocks
            groups += [i] * n
            valid += [self.bs] * (n - 1) + [seq_len - (n - 1) * self.bs]
        valid_t = torch.tensor(valid)  # [NB]
        bias = torch.zeros(len(block_list), 1, 1, self.bs)  # [NB, 1, 1, BS]
        bias.masked_fill_((torch.arange(self.bs)[None, :] >= valid_t[:, None])[:, None, None, :], _MASKED)
        meta = AttentionMetadata(
            is_prompt=False,
            kv_data=self.kv_data,
            slot_mapping=torch.zeros(len(self.seqs), dtype=torch.long),
            block_list=torch.tensor(block_list),
            block_groups=torch.tensor(groups),
            block_bias=bias,
        )
        query = self.q.view(len(self.seqs), 1, H, D).transpose(1, 2)  # [B, H, 1, D]
        return lambda: _decode_attention(meta, 0, query, self.scale)

    def engine_prefill(self) -> Callable[[], torch.Tensor]:
        """The engine's prompt path without context: SDPA over the batch's fresh K/V, right-padded rows."""
        b, q = len(self.seqs), self.seqs[0][0]
        query = self.q.view(b, q, H, D).transpose(1, 2)  # [B, H, Q, D]
        key = torch.randn(b, KVH, q, D)
        value = torch.randn(b, KVH, q, D)
        return lambda: F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.scale, enable_gqa=True
        )


def run(
    cases: list[str], block_sizes: list[int], threads: list[int], min_s: float, max_reps: int, copy_mib: int
) -> dict:
    kernel = build.load()
    rows: list[dict] = []
    bandwidth: dict[int, float] = {}
    saved = torch.get_num_threads()
    try:
        for nt in threads:
            torch.set_num_threads(nt)
            bandwidth[nt] = copy_bandwidth(copy_mib)
            for name, seqs in (c for c in CASES if c[0] in cases):
                for bs in block_sizes:
                    x = Inputs(seqs, bs)
                    impls: dict[str, Callable[[], object]] = {"fallback": x.flat(paged_attention_ref)}
                    if kernel is not None:
                        impls = {"kernel": x.flat(kernel), **impls}
                    impls["engine"] = x.engine_decode() if name.startswith("decode") else x.engine_prefill()
                    floor_ms = x.kv_bytes / bandwidth[nt] * 1e3
                    for impl, fn in impls.items():
                        ms = _median_ms(fn, min_s, max_reps)
                        rows.append(
                            {
                                "case": name,
                                "block_size": bs,
                                "threads": nt,
                                "impl": impl,
                                "ms": round(ms, 4),
                                "kv_bytes": x.kv_bytes,
                                "floor_ms": round(floor_ms, 4),
                                "x_floor": round(ms / floor_ms, 2),
                                "gflops": round(x.flops / (ms / 1e3) / 1e9, 2),
                            }
                        )
                        print(f"{name:18s} bs={bs:<4d} t={nt} {impl:9s} {ms:9.3f} ms  x{ms / floor_ms:6.1f}")
    finally:
        torch.set_num_threads(saved)
    return {
        "geometry": {"heads": H, "kv_heads": KVH, "head_dim": D, "dtype": "float32"},
        "copy_bandwidth_gbps": {str(k): round(v / 1e9, 2) for k, v in bandwidth.items()},
        "kernel_built": kernel is not None,
        "torch": torch.__version__,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    bw = ", ".join(f"{t} thread(s) {g} GB/s" for t, g in result["copy_bandwidth_gbps"].items())
    lines = [
        "# Paged attention, one layer call (`small`: 8 heads, 4 KV heads, D 64, fp32)",
        "",
        f"Copy bandwidth (read + write): {bw}. `x floor` = time / (K+V bytes read / copy bandwidth); "
        "GFLOP/s counts QK^T and PV over the keys each query sees.",
        "",
        "| case | block | threads | impl | ms | KV MB | x floor | GFLOP/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['case']} | {r['block_size']} | {r['threads']} | {r['impl']} | {r['ms']:.3f} "
            f"| {r['kv_bytes'] / 1e6:.1f} | {r['x_floor']:.1f} | {r['gflops']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench paged_attention", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes OUT.json and OUT.md")
    p.add_argument("--cases", nargs="+", default=[c[0] for c in CASES], choices=[c[0] for c in CASES])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--min-seconds", type=float, default=0.3, help="time each call for at least this long")
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--copy-mib", type=int, default=256, help="size of the copy that measures bandwidth")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args.cases, args.block_sizes, args.threads, args.min_seconds, args.max_reps, args.copy_mib)
    out = args.out.with_suffix("") if args.out.suffix in (".json", ".md") else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
