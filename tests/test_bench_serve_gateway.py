"""The benchmark client against the product's own gateway on a real in-process engine (tiny model)."""

from __future__ import annotations

import json

import gateway_helpers as helpers

import gateway.app as gateway_app
import gateway.local_backend as local_backend


def test_bench_serve_against_the_gateway(tmp_path, capsys):
    from gateway.cli import main as cli_main

    backend = local_backend.LocalEngineBackend(helpers.tiny_config())
    try:
        app = gateway_app.create_app(backend)
        with helpers.serve_app(app) as url:
            argv = ["bench", "serve", "--base-url", url, "--model", "tiny", "--workload", "random"]
            argv += ["--request-rate", "20", "--num-prompts", "6", "--random-input-len", "48"]
            argv += ["--random-output-len", "5", "--max-model-len", str(helpers.MAX_MODEL_LEN)]
            argv += ["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--priority-mix", "2:1"]
            argv += ["--out", str(tmp_path / "gw"), "--no-progress", "--json"]
            assert cli_main(argv) == 0
    finally:
        backend.close()
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["completed"] == 6 and s["failed"] == 0, s["errors"]
    # The gateway reports usage; its own tokenization of our text matches the sampled lengths.
    assert s["usage_reported"] == 6 and s["prompt_len_mismatch"] == 0
    assert s["total_output_tokens"] == 6 * 5 and s["short_outputs"] == 0
    assert s["slo_attainment"] == 1.0 and s["ttft_p50_ms"] > 0 and s["tpot_p50_ms"] > 0
