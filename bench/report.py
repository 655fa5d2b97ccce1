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
    out: str | Path, title: str, result: dict, table: list[tuple[str, ...]] | None = None
) -> Path:
    """Write ``<out>.json`` and ``<out>.md`` (``out`` without extension); returns the JSON path."""
    base = Path(out)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    doc = {"title": title, "command": command_line(), "environment": environment(), "result": result}
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
