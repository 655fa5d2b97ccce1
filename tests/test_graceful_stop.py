"""Graceful stop: a draining gateway answers 503 to new requests and to ``/health`` while its open streams run to
their end, or, once the drain period is over, end with an error chunk and ``data: [DONE]`` (their KV freed);
``bucketserve serve`` drains on SIGTERM, then stops its cluster and exits 0 with nothing of it left running, and a
SIGTERM during start-up stops it cleanly with exit code 143."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from gateway_helpers import tiny_config

from bench.server_process import ServerProcess, free_port, wait_healthy
from gateway.app import create_app
from gateway.drain import Drain, DrainReport
from gateway.local_backend import LocalEngineBackend


class Stream:
    """One streamed completion read in a thread: its SSE payloads and when each came."""

    def __init__(self, base: str, max_tokens: int, prompt: str = "Once upon a time") -> None:
        self.max_tokens = max_tokens
        self.status: int | None = None
        self.events: list[tuple[float, object]] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self._thread.start()

    def _read(self, base: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=180) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line:
                        continue
                    data = line.removeprefix("data: ")
                    self.events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
                    self.first.set()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.first.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)

    @property
    def payloads(self) -> list[object]:
        return [e for _, e in self.events]

    def ended_with_error(self) -> dict | None:
        """The error chunk just before [DONE], if the stream ended with one."""
        p = self.payloads
        if len(p) >= 2 and isinstance(p[-2], dict) and "error" in p[-2]:
            return p[-2]["error"]  # type: ignore[return-value]
        return None

    def completion_tokens(self) -> int | None:
        usage = [p["usage"] for p in self.payloads if isinstance(p, dict) and p.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None

    def check_ended_properly(self) -> None:
        """[DONE] last, right after either all the tokens asked for or an error chunk: never cut off."""
        assert self.status == 200
        assert self.payloads and self.payloads[-1] == "[DONE]", self.payloads[-3:]
        error = self.ended_with_error()
        if error is None:
            assert self.completion_tokens() == self.max_tokens, self.payloads[-3:]
        else:
            assert error["type"] == "server_error" and "shutting down" in error["message"], error


def check_refused_while_draining(base: str) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after") == "1"
    error = r.json()["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error", error
    r = httpx.post(
        f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text


# --------------------------------------------------------------------------- the gateway app's drain


@pytest.fixture(scope="module")
def backend() -> Iterator[LocalEngineBackend]:
    b = LocalEngineBackend(tiny_config())
    yield b
    b.close()


@pytest.fixture(autouse=True)
def no_leaks(backend: LocalEngineBackend) -> Iterator[None]:
    """Every test leaves the engine idle with no KV block held: the cut requests were aborted."""
    yield
    assert backend.wait_idle(30), "requests still in flight after the test"
    backend.inspect(lambda e: e.check_integrity())
    assert backend.inspect(lambda e: e.allocator.num_used) == 0


@contextmanager
def served(backend: LocalEngineBackend) -> Iterator[tuple[str, Drain, asyncio.AbstractEventLoop]]:
    """A fresh app on a real uvicorn server: its URL, its drain and the event loop it runs on."""
    app = create_app(backend)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.drain, loop
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        loop.close()
        sock.close()


def in_flight(drain: Drain, loop: asyncio.AbstractEventLoop) -> int:
    """The drain's count of open requests, read on the server's event loop."""

    async def count() -> int:
        return drain.in_flight()

    return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=30)


def test_open_streams_finish_during_the_drain_while_new_requests_get_503(backend: LocalEngineBackend) -> None:
    with served(backend) as (base, drain, loop):
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        streams = [Stream(base, 300) for _ in range(4)]
        for s in streams:
            assert s.first.wait(60)
        began = time.monotonic()
        report = asyncio.run_coroutine_threadsafe(drain.run(30.0), loop)
        deadline = time.monotonic() + 10
        while (h := httpx.get(f"{base}/health", timeout=30)).status_code != 503:
            assert time.monotonic() < deadline, "/health never turned 503"
        assert h.json()["draining"] is True and h.json()["ready"] is False
        check_refused_while_draining(base)
        result: DrainReport = report.result(timeout=60)
        for s in streams:
            s.join(30)
            s.check_ended_properly()
            assert s.ended_with_error() is None  # 300 tokens take far less than the 30 s period
        assert any(s.events[-1][0] > began for s in streams)  # they ran on while draining
        assert result.cut == 0 and result.finished == result.open_at_start >= 1, result
        assert result.seconds < 30
        # Still draining: the server is on its way out.
        assert httpx.get(f"{base}/health", timeout=30).status_code == 503


def test_requests_still_open_when_the_period_ends_are_cut_and_their_kv_freed(
    backend: LocalEngineBackend,
) -> None:
    with served(backend) as (base, drain, loop):
        streams = [Stream(base, 480) for _ in range(3)]
        for s in streams:
            assert s.first.wait(60)
        whole: dict = {}

        def not_streamed() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            whole.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=not_streamed)
        t.start()
        deadline = time.monotonic() + 30
        while in_flight(drain, loop) < 4:  # the JSON request is admitted too
            assert time.monotonic() < deadline, in_flight(drain, loop)
            time.sleep(0.02)
        # A period of 0 s: every open request is cut at once.
        result: DrainReport = asyncio.run_coroutine_threadsafe(drain.run(0.0), loop).result(timeout=60)
        t.join(60)
        for s in streams:
            s.join(30)
            s.check_ended_properly()
            assert s.ended_with_error() is not None, s.payloads[-3:]
        assert whole["status"] == 503, whole
        assert "shutting down" in whole["body"]["error"]["message"]
        assert result.cut == 4 and result.finished == 0, result


# --------------------------------------------------------------------------- bucketserve serve


def serve_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "tiny", "--port", str(port), *extra]


@pytest.mark.slow
def test_sigterm_drains_open_streams_then_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    drain_s = 10.0
    cmd = serve_cmd(port, "--max-model-len", "4096", "--drain-timeout-s", str(drain_s))
    server = ServerProcess(cmd, {}, tmp_path / "serve.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server, timeout_s=300)
        # Four short streams that finish within the drain period, four that could not finish in it.
        short = [Stream(base, 200) for _ in range(4)]
        long = [Stream(base, 4000) for _ in range(4)]
        for s in short + long:
            assert s.first.wait(120), server.log_tail()
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        deadline = sent + drain_s
        while (h := httpx.get(f"{base}/health", timeout=30)).status_code != 503:
            assert time.monotonic() < deadline, "/health never turned 503"
        assert h.json()["draining"] is True, h.text
        check_refused_while_draining(base)
        for s in short + long:
            s.join(drain_s + 60)
            s.check_ended_properly()
        # The short ones ran on after the SIGTERM to their last token; the long ones were cut at the period's end.
        assert all(s.ended_with_error() is None for s in short)
        assert any(s.events[-1][0] > sent for s in short)
        assert all(s.ended_with_error() is not None for s in long)
        assert all(s.events[-1][0] >= sent + drain_s - 1.0 for s in long)
        rc = server.proc.wait(timeout=60)
        stopped_after = time.monotonic() - sent
    finally:
        left = server.stop()
    log = server.log_path.read_text(errors="replace")
    assert rc == 0, log[-3000:]
    assert stopped_after < drain_s + 60, stopped_after
    assert left == [], f"processes left behind: {left}"
    assert "draining: new requests get 503" in log
    assert "drained in" in log and "4 ended with an error" in log, log[-2000:]
    # Ray relays its actors' lines (a replica's access log) late, even after ours: the server's own end last.
    own = [line for line in log.splitlines() if not RELAYED.match(line)]
    assert own[-2:] == ["stopping...", "stopped."], log[-2000:]
    assert "Traceback" not in log, log[-3000:]


# A line Ray relays from one of its actors: "(ServeReplica:... pid=123) ...", coloured or not.
RELAYED = re.compile(r"^(\x1b\[[0-9;]*m)?\([^)]* pid=\d+\)")


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its start-up has reached ``bucketserve serve``'s own)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["soon after launch", "while the workers warm up"])
def test_sigterm_during_start_up_stops_cleanly(tmp_path: Path, moment: str) -> None:
    server = ServerProcess(serve_cmd(free_port()), {}, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 120
        if moment == "soon after launch":
            while not _catches_sigterm(server.proc.pid):
                assert time.monotonic() < deadline and server.alive(), server.log_tail()
                time.sleep(0.01)
            time.sleep(2.0)  # checking the flags, or starting Ray
        else:
            while "warming up" not in server.log_tail(100_000):
                assert time.monotonic() < deadline and server.alive(), server.log_tail()
                time.sleep(0.05)
        assert server.alive(), server.log_tail()
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        rc = server.proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        left = server.stop()
    log = server.log_path.read_text(errors="replace")
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    assert took < 60
    assert left == [], f"processes left behind: {left}"
    assert "interrupted during start-up (SIGTERM)" in log, log[-3000:]
    assert "Traceback" not in log and "Ctrl-C to stop." not in log, log[-3000:]


def test_a_signal_whose_interrupt_was_swallowed_still_interrupts_start_up() -> None:
    """An interrupt raised inside a finaliser is printed as "ignored" and lost; start-up's next check between
    phases must still see the signal (the server would otherwise start anyway and serve)."""
    from gateway.commands.serve import _StartUpSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    start_up = _StartUpSignals()
    try:
        start_up.install()
        start_up.check()  # nothing came yet

        class SignalledWhileFinalised:
            def __del__(self) -> None:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)  # the handler runs here, inside the finaliser, and its interrupt is ignored

        SignalledWhileFinalised()  # finalised at once: the interrupt does not reach this frame
        assert start_up.pending and start_up.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            start_up.check()
        # Handing over to the serving handler does not forget it either.
        with pytest.raises(KeyboardInterrupt):
            start_up.hand_over(lambda *_: None)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
