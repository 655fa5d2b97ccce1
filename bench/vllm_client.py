"""``vllm bench serve`` as the load client of ``bucketserve bench sweep --client vllm``: an outside client on an
outside workload (vLLM's own ``random`` dataset, its own arrival process and its own goodput accounting), run from
vLLM's virtual environment against whichever system the sweep started. Its JSON result becomes one sweep point.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workload_requests import draw_seed

# vLLM's random dataset as the engine issue and DESIGN.md state it: prompts of 256 +- 90% tokens, 64 out.
RANDOM_INPUT_LEN = 256
RANDOM_OUTPUT_LEN = 64
RANDOM_RANGE_RATIO = 0.9


@dataclass(frozen=True)
class VllmBench:
    """``vllm bench serve`` against one running system, at whatever rate: streamed ``/v1/completions``, EOS
    ignored, goodput judged by the sweep's SLOs."""

    vllm_python: str  # the python of vLLM's environment; ``vllm`` sits beside it
    base_url: str
    model: str  # the served model name
    tokenizer: str  # a local folder: the random dataset draws its prompts with it
    num_prompts: int
    seed: int
    burstiness: float
    slo_ttft_ms: float
    slo_tpot_ms: float

    def command(self, rate: float, result_path: Path) -> list[str]:
        """The command line of one rate, its result saved as JSON at ``result_path``."""
        vllm = str(Path(self.vllm_python).with_name("vllm"))
        return [
            vllm, "bench", "serve",
            "--backend", "openai", "--base-url", self.base_url, "--endpoint", "/v1/completions",
            "--model", self.model, "--tokenizer", self.tokenizer,
            "--dataset-name", "random",
            "--random-input-len", str(RANDOM_INPUT_LEN), "--random-output-len", str(RANDOM_OUTPUT_LEN),
            "--random-range-ratio", str(RANDOM_RANGE_RATIO),
            "--num-prompts", str(self.num_prompts), "--request-rate", f"{rate:g}",
            "--burstiness", f"{self.burstiness:g}", "--seed", str(draw_seed(self.seed, rate)),
            "--ignore-eos", "--temperature", "0",
            "--goodput", f"ttft:{self.slo_ttft_ms:g}", f"tpot:{self.slo_tpot_ms:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_path.parent), "--result-filename", result_path.name,
            "--disable-tqdm",
        ]  # fmt: skip

    def run(self, rate: float, out_dir: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
        """Run one rate (its output appended to ``log_path``) and return the sweep point."""
        result_path = out_dir / f"vllm_bench_{rate:g}.json"
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.unlink(missing_ok=True)
        cmd = self.command(rate, result_path)
        # The tokenizer is a local folder: nothing may be fetched from a hub.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False
            )
        if proc.returncode != 0 or not result_path.is_file():
            tail = log_path.read_text()[-1500:]
            raise RuntimeError(f"vllm bench serve exited with {proc.returncode} at {rate:g} req/s:\n{tail}")
        return sweep_point(json.loads(result_path.read_text()), rate, self.num_prompts)


def sweep_point(result: dict[str, Any], rate: float, num_prompts: int) -> dict[str, Any]:
    """One sweep point from ``vllm bench serve``'s result JSON: attainment is the share of all requests sent
    (failed ones count against it) that met both SLOs, which vLLM reports as goodput in requests per second."""
    duration = float(result["duration"])
    goodput = result.get("request_goodput")
    if goodput is None:
        raise ValueError("the vLLM result has no request_goodput: it was run without --goodput")
    good = round(float(goodput) * duration)
    if not 0 <= good <= num_prompts:
        raise ValueError(f"the vLLM result counts {good} good requests of {num_prompts} sent")
    completed = int(result["completed"])
    failed = int(result.get("failed", num_prompts - completed))

    def ms(key: str) -> float | None:
        v = result.get(key)
        return None if v is None else round(float(v), 3)

    return {
        "request_rate": rate,
        "client": "vllm bench serve",
        "num_requests": num_prompts,
        "completed": completed,
        "failed": failed,
        "slo_attainment": round(good / num_prompts, 4),
        "goodput_rps": round(float(goodput), 4),
        "duration_s": round(duration, 3),
        "ttft_p50_ms": ms("median_ttft_ms"),
        "ttft_p99_ms": ms("p99_ttft_ms"),
        "tpot_p50_ms": ms("median_tpot_ms"),
        "tpot_p99_ms": ms("p99_tpot_ms"),
        "output_tok_per_s": ms("output_throughput"),
    }
