"""The online benchmark client against a real streaming HTTP server with known delays.

The server below speaks the OpenAI completions stream (SSE ``data:`` lines, a usage chunk, ``[DONE]``)
over uvicorn on a free loopback port. The prompt picks its behaviour (``mode:<name>``): fast or slow
tokens, an HTTP 500, a connection dropped mid-stream, no usage chunk, several tokens per chunk, an
error event, a stream without ``[DONE]``. Workload prompts (no ``mode:``) are answered fast, and
their token count is reported in ``usage.prompt_tokens`` with the model's tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from gateway_helpers import serve_app

from bench.client import run_benchmark
from bench.metrics import percentile
from bench.server_process import free_port
from bench.workload_requests import BenchRequest
from gateway.cli import main as cli_main

# mode -> (seconds to the first token, seconds between tokens)
DELAYS = {
    "fast": (0.05, 0.010),
    "slow-ttft": (0.40, 0.010),
    "slow-tpot": (0.05, 0.060),
    "slow": (0.40, 0.060),
}
SLO_TTFT_MS = 200.0
SLO_TPOT_MS = 30.0


def _chunk(text: str, finish: str | None = None) -> str:
    doc = {
        "id": "cmpl-t",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    return f"data: {json.dumps(doc)}\n\n"


def make_app(tokenizer) -> FastAPI:
    app = FastAPI()
    app.state.seen = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.seen.append({"headers": dict(request.headers), "body": body})
        prompt = body["prompt"]
        n = int(body["max_tokens"])
        mode = (
            prompt.split()[0].removeprefix("mode:")
            if isinstance(prompt, str) and prompt.startswith("mode:")
            else "fast"
        )
        if mode == "fail500":
            return JSONResponse(
                {"error": {"message": "engine exploded", "type": "server_error"}}, status_code=500
            )
        if isinstance(prompt, list):
            prompt_tokens = len(prompt)
        elif prompt.startswith("mode:"):
            prompt_tokens = 1
        else:
            prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
        ttft, tpot = DELAYS.get(mode, DELAYS["fast"])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

        async def stream():
            await asyncio.sleep(ttft)
            if mode == "error-event":
                yield "data: " + json.dumps({"error": {"message": "out of KV blocks"}}) + "\n\n"
                return
            per_chunk = 2 if mode == "merged" else 1
            sent = 0
            while sent < n:
                if sent:
                    await asyncio.sleep(tpot * per_chunk)
                k = min(per_chunk, n - sent)
                sent += k
                if mode == "drop" and sent > 2:
                    raise RuntimeError("connection dropped on purpose")
                yield _chunk(" tok" * k, "length" if sent == n and mode != "nousage" else None)
            if mode == "nousage":
                yield _chunk("", "length")  # a closing chunk that carries no token
            elif body.get("stream_options", {}).get("include_usage"):
                yield "data: " + json.dumps({"id": "cmpl-t", "choices": [], "usage": usage}) + "\n\n"
            if mode != "nodone":
                yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def tokenizer():
    from engine.model_loader import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def server(tokenizer):
    app = make_app(tokenizer)
    with serve_app(app) as url:
        yield url, app


def _req(mode: str, n: int = 10, at: float = 0.0, priority: str | None = None) -> BenchRequest:
    return BenchRequest(prompt=f"mode:{mode} hello", input_len=2, output_len=n, send_at=at, priority=priority)


def _bench(url: str, reqs: list[BenchRequest], **kw):
    kw.setdefault("slo_ttft_ms", SLO_TTFT_MS)
    kw.setdefault("slo_tpot_ms", SLO_TPOT_MS)
    return asyncio.run(run_benchmark(url, reqs, progress=False, **kw))


def test_measured_latencies_match_the_server_delays(server):
    url, _ = server
    modes = ["fast", "slow-ttft", "slow-tpot", "slow"]
    result = _bench(url, [_req(m, n=10, at=0.01 * i) for i, m in enumerate(modes)])
    for mode, o in zip(modes, result.outcomes, strict=True):
        ttft, tpot = DELAYS[mode]
        assert o.success, o.error
        assert o.output_tokens == 10 and o.usage_reported
        # Never early; late by at most scheduling noise on a busy machine.
        assert ttft <= o.ttft_s < ttft + 0.12, (mode, o.ttft_s)
        assert 0.95 * tpot <= o.tpot_s < tpot + 0.015, (mode, o.tpot_s)
        assert len(o.itl_s) == 9
        assert abs(sum(o.itl_s) / 9 - o.tpot_s) < 1e-6
        assert o.e2e_s == pytest.approx(o.ttft_s + 9 * o.tpot_s)
    assert [o.meets_slo() for o in result.outcomes] == [True, False, False, False]


def test_attainment_and_goodput_over_a_mix_of_fast_slow_and_failed(server):
    url, _ = server
    modes = ["fast"] * 5 + ["slow"] * 2 + ["slow-tpot"] + ["fail500", "drop"]
    reqs = [_req(m, n=8, at=0.02 * i) for i, m in enumerate(modes)]
    result = _bench(url, reqs)
    s = result.summary()
    assert s["num_requests"] == 10
    assert s["completed"] == 8 and s["failed"] == 2
    seen = [(o.ttft_s, o.tpot_s, o.error) for o in result.outcomes]
    assert s["slo_attainment"] == pytest.approx(5 / 10), seen
    assert s["goodput_rps"] == pytest.approx(5 / result.duration_s, rel=1e-3)
    assert s["request_throughput_rps"] == pytest.approx(8 / result.duration_s, rel=1e-3)
    assert s["output_tok_per_s"] == pytest.approx(8 * 8 / result.duration_s, rel=1e-3)
    # The run lasts at least as long as the slowest request, which started 0.02 s * its index late.
    assert result.duration_s >= 0.40 + 7 * 0.06
    # The client's own CPU over the run: some, and no more than both cores for the whole run.
    assert 0 < s["client_cpu_s"] <= 2 * result.duration_s
    ttfts = sorted(o.ttft_s * 1e3 for o in result.outcomes if o.success)
    assert s["ttft_p50_ms"] == pytest.approx(percentile(ttfts, 50), abs=1e-3)
    assert s["ttft_p99_ms"] >= 400 and s["ttft_p50_ms"] < SLO_TTFT_MS
    assert s["tpot_p99_ms"] >= 60 and s["tpot_p50_ms"] < SLO_TPOT_MS
    errors = {e["error"]: e["count"] for e in s["errors"]}
    assert errors.get("HTTP 500: engine exploded") == 1
    assert any("RemoteProtocolError" in e or "peer closed" in e for e in errors), errors
    assert not result.outcomes[-1].meets_slo() and not result.outcomes[-2].meets_slo()


def test_per_class_attainment_priority_and_slo_headers(server):
    url, app = server
    app.state.seen.clear()
    reqs = [_req("fast", n=4, priority="online") for _ in range(3)]
    reqs += [_req("slow", n=4, priority="offline"), _req("fast", n=4, priority="offline")]
    s = _bench(url, reqs, slo_ttft_ms=250, slo_tpot_ms=40.5).summary()
    assert s["slo_attainment_online"] == 1.0
    assert s["slo_attainment_offline"] == 0.5
    assert s["classes"]["offline"]["requests"] == 2
    assert s["slo_attainment"] == pytest.approx(4 / 5)
    bodies = [x["body"] for x in app.state.seen]
    assert sorted(b["priority"] for b in bodies) == ["offline", "offline", "online", "online", "online"]
    for x in app.state.seen:
        assert x["headers"]["x-slo-ttft-ms"] == "250" and x["headers"]["x-slo-tpot-ms"] == "40.5"
        b = x["body"]
        assert b["stream"] is True and b["ignore_eos"] is True and b["max_tokens"] == 4
        assert b["stream_options"] == {"include_usage": True}
    app.state.seen.clear()
    _bench(url, [_req("fast", n=2, priority="offline")], priority_format="int")
    assert app.state.seen[0]["body"]["priority"] == 1


def test_streams_without_usage_merged_chunks_and_broken_streams(server):
    url, _ = server
    modes = ["nousage", "merged", "error-event", "nodone"]
    result = _bench(url, [_req(m, n=6) for m in modes])
    nousage, merged, err, nodone = result.outcomes
    # Without usage, tokens are the chunks that carry text; the closing empty chunk is not one.
    assert nousage.success and not nousage.usage_reported and nousage.output_tokens == 6
    # Two tokens per chunk: usage gives the count, TPOT spreads the time over the tokens.
    assert merged.success and merged.output_tokens == 6 and merged.token_chunks == 3
    assert merged.tpot_s == pytest.approx(2 * 0.010 * 2 / 5, abs=0.01)
    assert not err.success and "out of KV blocks" in err.error
    assert not nodone.success and "[DONE]" in nodone.error
    assert result.summary()["failed"] == 2


def test_unreachable_server_is_counted_not_raised():
    port = free_port()  # closed again: nothing listens there
    result = _bench(f"http://127.0.0.1:{port}/v1", [_req("fast"), _req("fast")], timeout_s=5)
    s = result.summary()
    assert s["completed"] == 0 and s["failed"] == 2 and s["slo_attainment"] == 0.0
    assert "ConnectError" in s["errors"][0]["error"]


def test_requests_go_out_on_their_schedule_with_a_bounded_pool(server):
    url, _ = server
    at = [0.0, 0.15, 0.3, 0.45]
    result = _bench(url, [_req("fast", n=2, at=t) for t in at])
    for t, o in zip(at, result.outcomes, strict=True):
        assert t <= o.start_s < t + 0.05
    # One connection: the second of two simultaneous requests waits for the first to finish.
    result = _bench(url, [_req("slow", n=2), _req("fast", n=2)], max_connections=1)
    slow, fast = result.outcomes
    assert fast.pool_wait_s >= 0.40 and fast.ttft_s >= 0.45 and slow.pool_wait_s < 0.05


def test_cli_prints_final_json_and_writes_the_report(server, tokenizer, tmp_path: Path, capsys):
    url, app = server
    app.state.seen.clear()
    out = tmp_path / "report"
    argv = ["bench", "serve", "--base-url", url, "--workload", "mixed", "--request-rate", "40"]
    argv += ["--num-prompts", "12", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--seed", "3"]
    argv += ["--priority-mix", "1:1", "--max-model-len", "2048", "--max-output-len", "6"]
    argv += ["--out", str(out), "--no-progress"]
    assert cli_main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    s = json.loads(last)
    for key in (
        "request_rate",
        "completed",
        "failed",
        "slo_attainment",
        "goodput_rps",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "output_tok_per_s",
        "slo_attainment_online",
        "slo_attainment_offline",
    ):
        assert key in s, key
    assert s["request_rate"] == 40.0 and s["completed"] == 12 and s["failed"] == 0
    assert s["slo_attainment"] == 1.0
    # Every prompt reached the server with exactly the sampled number of tokens.
    assert s["usage_reported"] == 12 and s["prompt_len_mismatch"] == 0
    assert len(app.state.seen) == 12
    assert all(x["body"]["model"] == "default" for x in app.state.seen)
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["result"]["completed"] == 12
    rows = [json.loads(x) for x in out.with_suffix(".requests.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["success"] and r["meets_slo"] for r in rows)
    assert sorted(r["input_len"] for r in rows) == sorted(r["server_prompt_tokens"] for r in rows)
    assert "SLO attainment" in out.with_suffix(".md").read_text()


def test_cli_json_only_with_token_ids_and_missing_dataset(server, tmp_path: Path, capsys):
    url, app = server
    app.state.seen.clear()
    argv = ["bench", "serve", "--base-url", url, "--workload", "random", "--request-rate", "inf"]
    argv += ["--num-prompts", "4", "--random-input-len", "20", "--random-output-len", "3"]
    argv += ["--prompt-format", "token-ids", "--out", str(tmp_path / "r"), "--no-progress", "--json"]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    s = json.loads(lines[0])
    assert s["request_rate"] == "inf" and s["completed"] == 4 and s["prompt_len_mismatch"] == 0
    assert all(isinstance(x["body"]["prompt"], list) for x in app.state.seen)
    argv = ["bench", "serve", "--base-url", url, "--workload", "alpaca", "--request-rate", "1"]
    argv += ["--dataset", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "r2")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and "--dataset" in err
    argv = ["bench", "serve", "--base-url", url.removeprefix("http://"), "--request-rate", "1"]
    assert cli_main([*argv, "--out", str(tmp_path / "r3")]) == 2
    assert "--base-url" in capsys.readouterr().err


def test_the_sweeps_unloaded_probes_and_rates_each_send_prompts_of_their_own(server, tokenizer):
    """A server that caches prefixes must not see a prompt twice: not across the unloaded probe's runs, not
    between the probe and the load, not from one rate to the next."""
    from bench.sweep_systems import measure_unloaded, median_request
    from bench.workload_requests import draw_seed, make_requests

    url, app = server

    def draw(rate: float, name: str) -> list[BenchRequest]:
        return make_requests("random", 20, rate, tokenizer, seed=draw_seed(0, rate, name))

    probes = [median_request(draw(2.0, f"probe-{i}")) for i in range(4)]
    seen = len(app.state.seen)
    unloaded = asyncio.run(measure_unloaded(url, probes, "default"))
    sent = [str(s["body"]["prompt"]) for s in app.state.seen[seen:]]
    assert len(sent) == 4 == len(set(sent)), "every run of the unloaded probe has a prompt of its own"
    assert unloaded["ttft_ms"] >= DELAYS["fast"][0] * 1e3 and unloaded["tpot_ms"] > 0, unloaded
    assert unloaded["input_len"] in {p.input_len for p in probes[1:]}
    prompts = {rate: {str(r.prompt) for r in draw(rate, "load")} for rate in (1.0, 2.0, 4.0)}
    assert (
        not prompts[1.0] & prompts[2.0]
        and not prompts[2.0] & prompts[4.0]
        and not prompts[1.0] & prompts[4.0]
    )
    assert not set(sent) & prompts[2.0]
    # The same draw again is the same requests: a sweep is reproducible from its seed.
    assert [r.prompt for r in draw(2.0, "load")] == [r.prompt for r in draw(2.0, "load")]
