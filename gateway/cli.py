"""The ``bucketserve`` command line. Each subcommand lives in its own module under ``gateway/commands`` and
exposes ``register(subparsers)``; modules are imported lazily so ``bucketserve --help`` stays fast and a
subcommand's heavy imports load only when it runs. ``bench`` and ``simulate`` live in ``bench/``, on top of the
product: they are reached by module name at call time, never imported by the product."""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys

# subcommand name -> module exposing register(subparsers)
_COMMANDS = {
    "generate": "gateway.commands.generate",
    "model-path": "gateway.commands.model_path",
    "buckets": "gateway.commands.buckets",
    "serve": "gateway.commands.serve",
    "bench": "bench.cli",
    "simulate": "bench.simulator.cli",
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
                if not _is_missing(module, e):
                    raise
                if name == wanted:
                    _unavailable(sub, name, module)
    return parser


def _is_missing(module: str, error: ModuleNotFoundError) -> bool:
    """Whether ``module`` itself (or a package above it) is what could not be found, not one of its imports."""
    return error.name is not None and (module == error.name or module.startswith(error.name + "."))


def _unavailable(sub, name: str, module: str) -> None:
    message = (
        f"`bucketserve {name}` needs the {module.split('.')[0]} package, which is not importable here: "
        "use a source checkout of BucketServe (pip install -e '.[bench]')"
    )
    add_unavailable(sub, name, f"(unavailable: {module} is not importable)", message)


def add_unavailable(sub, name: str, help_text: str, message: str) -> None:
    """A subcommand that cannot run here: whatever its arguments, it prints ``message`` in one line and fails."""
    p = sub.add_parser(name, help=help_text, description=message)
    # Its arguments are not known here: main() accepts any (see ``unavailable``).
    p.set_defaults(func=functools.partial(_fail, message), unavailable=True)


def _fail(message: str, args: argparse.Namespace) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
