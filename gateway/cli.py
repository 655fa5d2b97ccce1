"""The ``bucketserve`` command line. Each subcommand lives in its own module under ``gateway/commands``
(or ``bench/`` for benchmarks) and exposes ``register(subparsers)``; modules are imported lazily so
``bucketserve --help`` stays fast and a subcommand's heavy imports load only when it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand name -> module exposing register(subparsers)
_COMMANDS = {
    "generate": "gateway.commands.generate",
    "model-path": "gateway.commands.model_path",
    "buckets": "gateway.commands.buckets",
    "serve": "gateway.commands.serve",
    "bench": "gateway.commands.bench",
    "simulate": "gateway.commands.simulate",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bucketserve", description="BucketServe: disaggregated LLM serving")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in _COMMANDS), None)
    for name, module in _COMMANDS.items():
        # Only import the module of the chosen command; the others get a placeholder for --help.
        if wanted is None or name == wanted:
            try:
                importlib.import_module(module).register(sub)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
