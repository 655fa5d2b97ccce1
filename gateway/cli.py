"""The ``bucketserve`` command line. Each subcommand lives in its own module under ``gateway/commands`` and
exposes ``register(subparsers)``; modules are imported lazily so ``bucketserve --help`` stays fast and a
subcommand's heavy imports load only when it runs. ``bench`` and ``simulate`` live in ``bench/``, on top of the
product: they are reached by module name at call time, never imported by the product."""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import logging
import sys

from gateway.flags import HelpFormatter, Parser, add_log_level, version

# subcommand name -> module exposing register(subparsers)
_COMMANDS = {
    "generate": "gateway.commands.generate",
    "model-path": "gateway.commands.model_path",
    "buckets": "gateway.commands.buckets",
    "serve": "gateway.commands.serve",
    "bench": "bench.cli",
    "simulate": "bench.simulator.cli",
}


EXAMPLES = """examples:
  bucketserve serve                          # a local cluster with the built-in model on http://127.0.0.1:8000
  bucketserve serve /path/to/hf-checkpoint   # a real model (a local Hugging Face folder)
  bucketserve generate --prompt "Hello" --max-tokens 16
  bucketserve COMMAND --help                 # each command's options, with their defaults
"""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = Parser(
        prog="bucketserve",
        description="BucketServe: disaggregated prefill/decode LLM serving on Ray",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"bucketserve {version()}")
    add_log_level(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
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
    for subparser in sub.choices.values():
        # --log-level after the subcommand too; the formatter shows defaults.
        if not any("--log-level" in a.option_strings for a in subparser._actions):
            add_log_level(subparser, top_level=False)
        if subparser.formatter_class is argparse.HelpFormatter:
            subparser.formatter_class = HelpFormatter
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


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> None:
    """The error of the subcommand's own parser (its usage, not the top level's), with a suggestion."""
    target = parser
    if command is not None:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        target = sub.choices[command]
    options = [o for a in target._actions for o in a.option_strings]
    hints = []
    for word in unknown:
        close = difflib.get_close_matches(word.split("=")[0], options, n=1) if word.startswith("-") else []
        if close:
            hints.append(f"{word} (did you mean {close[0]}?)")
        else:
            hints.append(word)
    target.error(f"unrecognized arguments: {' '.join(hints)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):
        _unrecognized(parser, args.command, unknown)
    logging.basicConfig(
        level=getattr(logging, args.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # What followed the subcommand: commands that merge a config file need to know which flags were given.
    args.command_argv = argv[argv.index(args.command) + 1 :]
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # One line, not a page of traceback; the traceback is there under --log-level DEBUG.
        logging.getLogger("bucketserve").debug("unhandled error", exc_info=True)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(
            f"error: {type(e).__name__}: {first}" if first else f"error: {type(e).__name__}", file=sys.stderr
        )
        if args.log_level != "DEBUG":
            print("  (--log-level DEBUG shows the full traceback)", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
