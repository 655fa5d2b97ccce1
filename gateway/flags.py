"""One parser for command-line flags and config files.

A config file (``--config FILE.yaml``, or the ``args`` of ``serve run``) is read through the very parser
that reads the command line: each key is turned back into its flag and parsed with the flag's own type
and choices, so ``port: "abc"`` fails exactly as ``--port abc`` does, before anything starts. Values
then stack as defaults < file < flags given on the command line (a flag given explicitly wins even when
it equals its default). Errors are one line that names the flag or the file and key, never an internal
config field.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import re
import socket
from importlib import metadata
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class FlagError(ValueError):
    """A bad flag or config value; the message is one line naming it."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help with each option's default (when it has a meaningful one) and epilogs printed as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # Identity checks: 0 is a default worth showing, though 0 == False.
        if "%(default)" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        if not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The command line's parser: an error is one line (with where to look), not the whole usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class RaisingParser(argparse.ArgumentParser):
    """A parser that raises :class:`FlagError` instead of printing usage and exiting (config files)."""

    def error(self, message: str):  # type: ignore[override]
        raise FlagError(message)


def version() -> str:
    try:
        return metadata.version("bucketserve")
    except metadata.PackageNotFoundError:  # a source tree without an install
        return "unknown"


def log_level(value: str) -> str:
    """argparse type: a logging level name, any case."""
    upper = value.upper()
    if upper not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(LOG_LEVELS)})")
    return upper


def port_number(value: str) -> int:
    """argparse type: a TCP port a server can listen on."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: {value!r} (an integer from 1 to 65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port: {port} (must be from 1 to 65535)")
    return port


def resource_map(value: str) -> dict[str, float]:
    """argparse type: Ray resources as a JSON object of name -> amount, e.g. ``{"GPU": 1}`` or ``{"prefill": 1}``."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {e.msg}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of resource -> amount, got {value!r}")
    out: dict[str, float] = {}
    for name, amount in data.items():
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
            raise argparse.ArgumentTypeError(
                f"resource {name!r}: the amount must be a number > 0, got {amount!r}"
            )
        out[str(name)] = float(amount)
    return out


def add_log_level(parser: argparse.ArgumentParser, top_level: bool) -> None:
    """``--log-level`` before or after the subcommand. The subcommand's copy has no default, so it only
    overrides the top-level value when given."""
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="INFO" if top_level else argparse.SUPPRESS,
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="log level; DEBUG also prints full tracebacks of start-up failures"
        + ("" if top_level else " (default: INFO)"),
    )


# ------------------------------------------------------------------ config values through the parser


def _settings(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options that hold a setting (not --help or --version)."""
    return [
        a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]


def _actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _settings(parser)}


def _actions_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every spelling a config key may take: each option string of an action (aliases included), with
    underscores for dashes."""
    return {o.lstrip("-").replace("-", "_"): a for a in _settings(parser) for o in a.option_strings}


def flag_of(parser: argparse.ArgumentParser, dest: str) -> str | None:
    """The long option string of ``dest`` (``max_model_len`` -> ``--max-model-len``)."""
    action = _actions_by_dest(parser).get(dest)
    if action is None:
        return None
    return max(action.option_strings, key=len)


def _suppressed(
    parser: argparse.ArgumentParser, cls: type[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """A copy of ``parser`` whose arguments have no defaults: parsing gives only what was given."""
    copy = cls(prog=parser.prog, add_help=False)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        clone = copy._add_action(_clone(action))
        clone.default = argparse.SUPPRESS
    return copy


def _clone(action: argparse.Action) -> argparse.Action:
    kwargs = dict(vars(action))
    kwargs.pop("container", None)
    kwargs.pop("deprecated", None)
    cls = type(action)
    # Each action class takes its own constructor arguments; keep the ones it accepts.
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


def given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    """The values of the arguments that ``argv`` sets explicitly (whatever their value)."""
    namespace, _ = _suppressed(parser, argparse.ArgumentParser).parse_known_args(argv)
    return vars(namespace)


def values_from_mapping(
    parser: argparse.ArgumentParser, data: dict[str, Any], source: str, skip: set[str] = frozenset()
) -> dict[str, Any]:
    """Config keys (flag names, dashes or underscores) parsed by the flags' own types and choices.

    ``skip``: destinations that are not settings (``config`` itself, the CLI's own keys).
    """
    actions = {k: a for k, a in _actions_by_key(parser).items() if a.dest not in skip}
    strict = _suppressed(parser, RaisingParser)
    out: dict[str, Any] = {}
    for key, value in (data or {}).items():
        name = str(key).replace("-", "_")
        if name not in actions:
            close = difflib.get_close_matches(name, list(actions), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(actions))}"
            raise FlagError(f"{source}: unknown key {key!r}{hint}")
        if value is None:  # an empty YAML value: keep the default
            continue
        action = actions[name]
        dest = action.dest
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # a switch (store_true): true sets it, false leaves it off
            if not isinstance(value, bool):
                raise FlagError(f"{source}: {key}: expected true or false, got {value!r}")
            out[dest] = value
            continue
        if isinstance(value, dict) and action.type is resource_map:
            value = json.dumps(value)  # a YAML mapping, read as the flag's JSON
        if isinstance(value, list | dict):
            raise FlagError(f"{source}: {key}: expected a single value, got {type(value).__name__}")
        if isinstance(value, bool) and action.type is not None:
            raise FlagError(f"{source}: {key}: expected a value for {flag}, got {value!r}")
        argv = [flag, str(value)]
        try:
            parsed = vars(strict.parse_args(argv))
        except FlagError as e:
            raise FlagError(f"{source}: {key}: {_strip_argument(str(e))}") from None
        out.update(parsed)
    return out


def _strip_argument(message: str) -> str:
    # "argument --port: invalid int value: 'abc'" -> "invalid int value: 'abc'"
    return re.sub(r"^argument [^:]+: ", "", message)


def load_yaml_file(path: str) -> dict[str, Any]:
    """A YAML mapping, or a one-line error naming the file (and line, for a syntax error)."""
    import yaml

    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise FlagError(f"--config {path}: no such file") from None
    except OSError as e:
        raise FlagError(f"--config {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise FlagError(f"{path}{where}: {e.problem or e.context or 'invalid YAML'}") from None
    except yaml.YAMLError as e:
        raise FlagError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FlagError(f"{path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


# ------------------------------------------------------------------ messages in the user's terms

_FIELD = re.compile(r"\b[A-Z]\w*(?:Config|Settings)\.([a-z_]+)\b")


def in_flag_terms(parser: argparse.ArgumentParser, message: str) -> str:
    """Rewrite internal config field names (``SchedulerConfig.max_model_len``, ``GatewaySettings.api_key``) as the
    flags that set them."""

    def flag(m: re.Match[str]) -> str:
        return flag_of(parser, m.group(1)) or m.group(0)

    return _FIELD.sub(flag, message)


def check_port_free(host: str, port: int) -> None:
    """Fail now, not after minutes of warm-up, when ``host:port`` cannot be listened on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise FlagError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the HTTP server will: a port left in TIME_WAIT by an earlier run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
                raise FlagError(f"--port {port}: {host}:{port} is already in use") from None
            raise FlagError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
