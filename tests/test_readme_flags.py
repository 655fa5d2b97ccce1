"""The README's `bucketserve serve` flag table matches the command line: the same flags, the same defaults."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.commands.serve import _serve_parser

README = Path(__file__).parent.parent / "README.md"


def table_rows() -> dict[str, str]:
    """flag -> default cell of the table under "`bucketserve serve` configuration"."""
    text = README.read_text()
    section = text.split("## `bucketserve serve` configuration", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`--"):
            for flag in re.findall(r"`(--[a-z-]+)`", cells[0]):
                rows[flag] = cells[1]
    return rows


def test_every_serve_flag_is_in_the_readme_table_with_its_default():
    rows = table_rows()
    parser = _serve_parser()
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert flags - set(rows) == set(), "flags missing from the README table"
    assert set(rows) - flags == set(), "README rows for flags that do not exist"
    for action in parser._actions:
        if not action.option_strings or action.option_strings == ["-h", "--help"]:
            continue
        cell = rows[max(action.option_strings, key=len)]
        default = action.default
        if default is None or isinstance(default, bool) or default == "==SUPPRESS==":
            continue  # "none", "off", or a sentence for what is resolved at start-up
        assert f"`{default}`" in cell, (action.option_strings, default, cell)
