"""Command-line flags shared by every command that builds an engine (serve, generate, buckets, bench).
One definition, so ``bucketserve buckets`` and ``bucketserve serve`` accept the same names."""

from __future__ import annotations

import argparse

from engine.config import (
    COLOCATED_CPU_STEP_TOKENS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_PREFILL_SEQS,
    DEFAULT_MAX_NUM_SEQS,
)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="default",
        help="a local Hugging Face checkpoint folder, an HF id already in the local HF cache, or a built-in "
        "random-weight model for trying things out: default (= tiny), tiny, small (their text is meaningless)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda", "hpu"],
        help="auto: HPU if habana_frameworks is present, else CUDA if available, else CPU",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache; auto: the checkpoint's own dtype (its config's torch_dtype)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling when a request gives none")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size (default 128 on HPU, 64 on CPU, 16 on CUDA)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"longest prompt + output in tokens (default: the model's max_position_embeddings, at most "
        f"{DEFAULT_MAX_MODEL_LEN})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"largest decode batch (default: {DEFAULT_MAX_NUM_SEQS})",
    )
    parser.add_argument(
        "--max-num-prefill-seqs",
        type=int,
        default=None,
        help=f"largest prefill batch (default: {DEFAULT_MAX_NUM_PREFILL_SEQS})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"most tokens in one step or prefill batch (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}; a colocated "
        f"worker on a CPU: {COLOCATED_CPU_STEP_TOKENS})",
    )
    parser.add_argument(
        "--tpot-guard",
        default="off",
        choices=["on", "off"],
        help="flat policy, on: cap each step's prompt tokens so that the requests decoding in it keep their "
        "TPOT SLOs, at the cost of the prompts' TTFT (engine/tpot_guard.py); off: --max-num-batched-tokens "
        "alone bounds a step",
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: sized from free memory)"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of the accelerator's memory a worker may use, weights and KV included (default: 0.9; "
        "on CPU the KV cache is capped at 1 GiB instead)",
    )
    parser.add_argument(
        "--strategy", default="exponential", choices=["exponential", "linear"], help="shape buckets"
    )
    parser.add_argument(
        "--enable-prefix-caching",
        "--prefix-caching",
        dest="prefix_caching",
        action="store_true",
        help="warm prompt shape buckets with prefix context (shape-bucket policy)",
    )


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """How the engine runs its model (not what ``bucketserve buckets`` needs to print shapes)."""
    parser.add_argument(
        "--skip-warmup",
        action="store_true",
        help="development only: no warm-up and no compiled graphs (faster start, slower serving)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (flat policy: one graph dynamic in the token count, cached on disk; "
        "buckets policy: one graph per warmed shape)",
    )
    parser.add_argument(
        "--shape-policy",
        default="auto",
        choices=["auto", "flat", "buckets"],
        help="flat: no padding, decodes and prefill chunks in one step (CPU, CUDA default); buckets: padded "
        "warmed shapes (HPU default)",
    )
    parser.add_argument(
        "--overlap-decode",
        default="auto",
        choices=["auto", "on", "off"],
        help="launch each decode step before the previous step's tokens reach the host (flat policy; auto: on "
        "CUDA, off on CPU)",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_cache_args(parser)
    add_runtime_args(parser)
