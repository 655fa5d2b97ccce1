"""``bucketserve buckets``: print the shape buckets the engine would warm up for the given serving flags.

It takes the same cache flags as ``bucketserve serve``; shape-bucket environment overrides
(``BUCKETSERVE_<DIM>_BUCKET_<FIELD>``) apply here as they do when serving. Without ``--num-blocks`` the KV cache
is taken as ``max_num_seqs * ceil(max_model_len / block_size)`` blocks, since no device is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bucket_manager.bucket_range import BucketRange
from bucket_manager.shape_buckets import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    ShapeBucketConfig,
    ShapeBuckets,
    default_num_blocks,
    describe,
)
from engine.args import add_cache_args

EXAMPLES = """examples:
  bucketserve buckets                                   # the defaults (max model len 2048, block 16)
  bucketserve buckets --model /path/to/checkpoint        # max model len from that model (capped at 2048)
  bucketserve buckets --block-size 128 --max-num-seqs 64 --json
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "buckets",
        help="print the shape buckets the engine would warm up",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
    )
    parser.add_argument(
        "--model",
        default=None,
        help="take --max-model-len's default from this model's config (as serve does); none: "
        f"{DEFAULT_MAX_MODEL_LEN}",
    )
    add_cache_args(parser)
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the prompt and decode buckets"
    )
    parser.set_defaults(func=run)


def _range_text(name: str, r: BucketRange | None) -> str:
    if r is None:
        return f"{name}:off"
    return f"{name}:[{r.min}, {r.step}, {r.max}, {r.limit}]"


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        from engine.model_loader import ModelNotFoundError, read_model_facts

        try:
            model_len = read_model_facts(args.model).max_position_embeddings
        except ModelNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.max_model_len is None:
            args.max_model_len = min(DEFAULT_MAX_MODEL_LEN, model_len)
        elif args.max_model_len > model_len:
            print(
                f"error: --max-model-len ({args.max_model_len}) exceeds the model's max_position_embeddings "
                f"({model_len})",
                file=sys.stderr,
            )
            return 2
    num_blocks = args.num_blocks
    if num_blocks is None:
        num_blocks = default_num_blocks(
            args.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            args.max_model_len or DEFAULT_MAX_MODEL_LEN,
            args.block_size or DEFAULT_BLOCK_SIZE,
        )
    try:
        config = ShapeBucketConfig.from_serving(
            strategy=args.strategy,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_prefill_seqs=args.max_num_prefill_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_blocks=num_blocks,
            prefix_caching=args.prefix_caching,
            env=os.environ,
        )
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    buckets = ShapeBuckets(config)
    print(
        f"Prompt bucket config (min, step, max, limit) {_range_text('bs', config.prompt_bs)}, "
        f"{_range_text('seq', config.prompt_seq)}, {_range_text('ctx', config.prompt_ctx)}"
    )
    print(
        f"Decode bucket config (min, step, max, limit) {_range_text('bs', config.decode_bs)}, "
        f"{_range_text('block', config.decode_block)}"
    )
    for phase, shapes in (("Prompt", buckets.prompt), ("Decode", buckets.decode)):
        for i, bucket in enumerate(shapes, start=1):
            print(describe(phase, i, len(shapes), bucket))
    print(
        f"{len(buckets.prompt)} prompt buckets and {len(buckets.decode)} decode buckets "
        f"({config.strategy}, block_size {config.block_size}, max_model_len {config.max_model_len}, "
        f"num_blocks {num_blocks}, prefix caching {'on' if config.prompt_ctx else 'off'})"
    )
    if args.json:
        print(
            json.dumps(
                {"prompt": [list(b) for b in buckets.prompt], "decode": [list(b) for b in buckets.decode]}
            )
        )
    return 0
