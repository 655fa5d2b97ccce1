"""Writing benchmark reports: one JSON and one Markdown file, each naming the command that made it."""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def command_line() -> str:
    return "bucketserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else ""


def write_report(
    out: str | Path,
    title: str,
    result: dict,
    table: list[tuple[str, ...]] | None = None,
    command: str | None = None,
) -> Path:
    """Write ``<out>.json`` and ``<out>.md`` (``out`` without extension); returns the JSON path. ``command``: how
    the run was started, when not through ``bucketserve``."""
    base = Path(out)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "title": title,
        "command": command or command_line(),
        "environment": environment(),
        "result": result,
    }
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# {title}", "", f"Command: `{doc['command']}`", ""]
    if table:
        lines += ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table[1:]]
        lines.append("")
    lines += ["```json", json.dumps(result, indent=2), "```", ""]
    env = doc["environment"]
    lines.append(
        f"Environment: Python {env['python']}, torch {env['torch']}, {env['cpus']} threads, {env['time']}."
    )
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return base.with_suffix(".json")


def publish(
    out: str | Path,
    title: str,
    result: dict,
    table: list[tuple[str, ...]],
    header: str,
    as_json: bool,
    command: str | None = None,
) -> Path:
    """Write the report, then print ``header``, the table (columns aligned), the report's path and, with
    ``as_json``, the result as the last line."""
    path = write_report(out, title, result, table, command)
    print(header)
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        cells = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells))
    print(f"report: {path}")
    if as_json:
        print(json.dumps(result))
    return path
