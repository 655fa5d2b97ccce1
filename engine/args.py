"""Command-line flags shared by every command that builds an engine (serve, generate, buckets, bench).
One definition, so ``bucketserve buckets`` and ``bucketserve serve`` accept the same names."""

from __future__ import annotations

import argparse


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="default",
        help="'default'/'tiny' or 'small' (built-in random-weight models), a local HF checkpoint folder, or an HF id",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "hpu"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling when a request gives none")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-size", type=int, default=None, help="KV block size (default 128 on HPU, 16 elsewhere)"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output (default: model's, capped)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="largest decode batch")
    parser.add_argument("--max-num-prefill-seqs", type=int, default=None, help="largest prefill batch")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="most tokens in one prefill batch"
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: sized from free memory)"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="fraction of device memory to use"
    )
    parser.add_argument(
        "--strategy", default="exponential", choices=["exponential", "linear"], help="shape buckets"
    )
    parser.add_argument(
        "--prefix-caching", action="store_true", help="warm prompt buckets with prefix context"
    )
    parser.add_argument("--skip-warmup", action="store_true", help="development only: no warm-up, no graphs")
    parser.add_argument("--compile", action="store_true", help="CPU: torch.compile(dynamic=False) per bucket")
    parser.add_argument(
        "--shape-policy",
        default="auto",
        choices=["auto", "flat", "buckets"],
        help="flat: no padding, decodes and prefill chunks in one step (CPU, CUDA default); buckets: padded "
        "warmed shapes (HPU default)",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_cache_args(parser)
