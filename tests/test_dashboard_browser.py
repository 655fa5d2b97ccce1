"""The operator dashboard in a real headless Chromium, after real traffic through the gateway.

A burst of completions of both priority classes goes through the HTTP gateway to the in-process
engine on the tiny model; then Debian's Chromium, driven by Playwright, opens `/dashboard` with no
key: the page must ask for the API key in a login form, say so when a wrong key is typed, and with
the right one draw non-empty charts and the worker table from the live data, sending the key as a
Bearer header on every poll (never in the URL or a cookie), without fetching anything from anywhere
but the gateway. A screenshot is kept in `artifacts/dashboard.png` for people to look at.

The browser is part of the test set-up (`make install` installs it): a missing browser is a
failure that says how to install it, never a skip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_helpers import serve_app, tiny_config

from gateway.app import create_app
from gateway.local_backend import LocalEngineBackend
from gateway.settings import GatewaySettings
from monitor import Monitor

API_KEY = "dash-key"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# A common laptop viewport: the page must read well at this size.
VIEWPORT = {"width": 1440, "height": 900}
# Without the background-networking flags Chromium keeps trying to reach Google services.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Charts drawn from request records and worker heartbeats; every one must have points after a burst.
CHARTS = ("slo-chart", "goodput-chart", "rate-chart", "ttft-chart", "tpot-chart", "tokens-chart", "kv-chart")
# 12 online and 8 offline completions of 2 to 6 tokens, so the two classes' counts differ.
BURST = [("online" if i % 5 < 3 else "offline", 2 + i % 5) for i in range(20)]


def chromium_path() -> str:
    path = os.environ.get("BUCKETSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file() or not os.access(path, os.X_OK):
        pytest.fail(
            f"Chromium not found at {path}: the dashboard test needs Debian's chromium. "
            "Run `make install` (installs it as root), or `apt-get install -y chromium`, "
            "or point BUCKETSERVE_CHROMIUM at a Chromium binary."
        )
    return path


def playwright_api() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: run `make install` (it is a dev extra)")
    return sync_playwright


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    backend = LocalEngineBackend(tiny_config(), monitor=Monitor(), stats_interval_s=0.5)
    app = create_app(backend, GatewaySettings(api_key=API_KEY, dashboard_refresh_ms=1000))
    try:
        with serve_app(app) as u:
            yield u
    finally:
        backend.close()


async def send_burst(url: str) -> list[int]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:

        async def one(i: int, priority: str, max_tokens: int) -> int:
            body = {"prompt": f"request {i}: " + "tell me a story " * (1 + i % 4), "max_tokens": max_tokens}
            r = await c.post("/v1/completions", json={**body, "priority": priority})
            return r.status_code

        return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(BURST)))


def test_dashboard_draws_the_burst_in_chromium(url: str) -> None:
    executable = chromium_path()
    sync_playwright = playwright_api()
    codes = asyncio.run(send_burst(url))
    assert codes == [200] * len(BURST)
    per_class = {c: sum(1 for p, _ in BURST if p == c) for c in ("online", "offline")}
    # A request is recorded once its response is done, which may trail the client's last byte.
    recorded: dict[str, int] = {}
    deadline = time.monotonic() + 10
    while recorded != per_class and time.monotonic() < deadline:
        data = httpx.get(
            f"{url}/dashboard/data", params={"window_s": 300}, headers={"Authorization": f"Bearer {API_KEY}"}
        ).json()
        recorded = {c: data["window_totals"][c]["requests"] for c in per_class}
        time.sleep(0.1)
    assert recorded == per_class

    ARTIFACTS.mkdir(exist_ok=True)
    foreign: list[str] = []
    errors: list[str] = []
    # Every poll of the data: its status, its Authorization header and its URL.
    polls: list[tuple[int, str | None, str]] = []
    data_url = f"{url}/dashboard/data"

    def on_response(r: Any) -> None:
        if r.url.startswith(data_url):
            polls.append((r.status, r.request.headers.get("authorization"), r.url))
        elif r.status >= 400:
            errors.append(f"HTTP {r.status} {r.url}")

    def on_console(m: Any) -> None:
        # Chromium logs each refused poll as a console error; those are counted through `polls`.
        if m.type == "error" and "status of 401" not in m.text:
            errors.append(m.text)

    def wait_for_polls(done: int) -> None:
        deadline = time.monotonic() + 30
        while sum(1 for status, _, _ in polls if status == 200) < done:
            assert time.monotonic() < deadline, f"fewer than {done} successful polls: {polls}"
            page.wait_for_timeout(100)

    with tempfile.TemporaryDirectory(prefix="bucketserve-chromium-") as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport=VIEWPORT,
        )
        try:
            page = ctx.new_page()
            page.on("request", lambda r: None if r.url.startswith(url) else foreign.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", on_console)
            page.on("response", on_response)

            # (1) No key: the page itself loads, the data answers 401, and the login form shows.
            page.goto(f"{url}/dashboard")
            page.select_option("#window-select", "300")
            page.wait_for_selector("#login-key", state="visible", timeout=30_000)
            assert page.evaluate("document.body.dataset.loaded") is None
            assert page.inner_text("#login-error") == ""
            assert polls and all(status == 401 and auth is None for status, auth, _ in polls), polls

            # (2) A wrong key: refused, said so in the page, not kept.
            page.fill("#login-key", "not-the-key")
            page.click("#login-submit")
            page.wait_for_function(
                "document.getElementById('login-error').textContent.includes('did not accept')",
                timeout=30_000,
            )
            assert page.is_visible("#login-key")
            assert page.evaluate("document.body.dataset.loaded") is None
            assert (401, "Bearer not-the-key") in [(s, a) for s, a, _ in polls]
            assert page.evaluate("window.sessionStorage.length") == 0
            refused = len(polls)

            # (3) The right key: the charts fill with the burst's data, polled with the key every time.
            page.fill("#login-key", API_KEY)
            page.click("#login-submit")
            page.wait_for_function(
                "document.body.dataset.loaded === 'true' && "
                "document.querySelectorAll('#workers-table tr[data-worker]').length > 0",
                timeout=30_000,
            )
            assert page.is_hidden("#login")
            # A few more polls after the first: the key is sent on each, not just once.
            wait_for_polls(3)
            points = {
                chart: int(page.get_attribute(f"#{chart} svg.chart", "data-points") or 0) for chart in CHARTS
            }
            workers = page.locator("#workers-table tr[data-worker]")
            worker_ids = [workers.nth(i).get_attribute("data-worker") for i in range(workers.count())]
            health = page.inner_text("#workers-table tr[data-worker] .up")
            headline = page.inner_text("#slo-headline")
            status = page.inner_text("#status")
            stored = page.evaluate("window.sessionStorage.getItem('bucketserve_api_key')")
            local = page.evaluate("window.localStorage.length")
            cookies = ctx.cookies()
            page_url = page.url
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            ctx.close()

    assert not errors, f"the page reported errors: {errors}"
    assert not foreign, f"the page fetched from outside the gateway: {foreign}"
    after_login = polls[refused:]
    assert after_login and all(a == f"Bearer {API_KEY}" for _, a, _ in after_login), after_login
    assert all(s == 200 for s, _, _ in after_login), after_login
    # The key lives in this tab's session storage only: not in any URL, cookie or local storage.
    assert stored == API_KEY and local == 0 and cookies == []
    assert all(API_KEY not in u for _, _, u in polls) and API_KEY not in page_url
    empty = [chart for chart, n in points.items() if n <= 0]
    assert not empty, f"charts drawn without points after the burst: {empty} (all: {points})"
    assert worker_ids == ["local-0"] and health == "up"
    # The headline counts what the burst sent, per class.
    for cls, n in per_class.items():
        assert f"{n} requests" in headline, (cls, headline)
    assert status.startswith("updated") and "10 s resolution" in status
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
