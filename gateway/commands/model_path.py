"""``bucketserve model-path``: print the folder of a model, building a built-in one on first use."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("model-path", help="print the folder of the (built, if needed) model")
    p.add_argument(
        "--model", default="default", help="a built-in name (default, tiny, small), a folder or an HF id"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.model_loader import ModelNotFoundError, resolve_model_path

    try:
        print(resolve_model_path(args.model))
    except ModelNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
