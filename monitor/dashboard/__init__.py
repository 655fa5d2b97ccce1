"""The operator dashboard: one self-contained HTML page (CSS and JS inlined, no network).

The gateway serves `page_html()` at `GET /dashboard` and `Monitor.dashboard_data(window_s)`
as JSON at `GET /dashboard/data?window_s=...`. When the data answers 401 (the server has an API
key), the page shows a login form; the key typed there is kept in the tab's session storage and sent
as `Authorization: Bearer <key>` with every poll.
"""

from __future__ import annotations

import html
from importlib import resources

ASSETS = ("index.html", "dashboard.js", "dashboard.css")


def asset(name: str) -> str:
    """The text of one shipped file (index.html, dashboard.js or dashboard.css)."""
    if name not in ASSETS:
        raise ValueError(f"unknown dashboard asset {name!r}; known: {ASSETS}")
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def page_html(data_url: str = "/dashboard/data", refresh_ms: int = 2000) -> str:
    """index.html with its stylesheet and script inlined, polling data_url every refresh_ms."""
    if refresh_ms < 250:
        raise ValueError(f"refresh_ms must be >= 250, got {refresh_ms!r}")
    page = asset("index.html")
    # The shipped page links its files for development; served, it must stand alone.
    replacements = {
        '<link rel="stylesheet" href="dashboard.css">': f"<style>\n{asset('dashboard.css')}</style>",
        '<script src="dashboard.js"></script>': f"<script>\n{asset('dashboard.js')}</script>",
        'data-url="/dashboard/data" data-refresh-ms="2000"': (
            f'data-url="{html.escape(data_url, quote=True)}" data-refresh-ms="{int(refresh_ms)}"'
        ),
    }
    for old, new in replacements.items():
        if old not in page:
            raise RuntimeError(f"dashboard index.html lost its placeholder {old!r}")
        page = page.replace(old, new)
    return page
