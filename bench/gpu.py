"""``bucketserve bench gpu``: the engine alone on one accelerator, against the device's bounds and against Hugging Face.

In one process, on one device:

1. the device's copy bandwidth (bytes read + written per second, a 2 GiB copy) and its matmul rate (an
   8192^3 product in the model's dtype);
2. the engine's prefill steps (1x1024, 8x256 by default) against their FLOPs at that matmul rate, and its decode
   steps (batch 1, 8, 32, 64 at context 512) against their bytes at that bandwidth, as ``bench roofline``
   computes them (every weight read once per step, the KV of every sequence read);
3. where the device time of a small decode step goes (``--profile-batch``, torch's profiler over its kernels:
   GEMMs, attention, the rest) and how much of the step's wall time the device is idle;
4. offline generation at batch 64 (prompts of equal length, EOS ignored) through the engine against Hugging Face
   ``generate`` with a static cache on the same prompts and checkpoint, with how many outputs are identical.

With ``--ab KNOB`` it instead builds two engines in the process, the knob on and off, and times their steps in
alternating rounds (on, off, then off, on, ...) against the same bounds: each round's off/on ratio is taken from
steps timed minutes apart at most, so a device that drifts over a session (clocks, a neighbour's load) moves
both sides alike, which separate processes run one after the other do not.

The default model is the built-in ``llama3-8b-l8`` (Llama 3 8B's shapes with 8 of its layers, random bf16 weights,
built on first use). Ray is not needed: the engine runs in this process.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import statistics
import sys
import time

logger = logging.getLogger(__name__)

# What --ab compares: start-up switches of the CUDA device (read when an engine is built) and the engine's
# overlapped decode (its config), the one that changes anything on the CPU too.
AB_KNOBS = (
    "fuse-projections",
    "skinny-gemm",
    "kv-write-kernel",
    "rope-write-kernel",
    "gated-down",
    "split-greedy",
    "combo-kernels",
    "overlap-decode",
)
# The CUDA device's start-up switches (engine/device/cuda.py), each behind its --FLAG on|off.
CUDA_SWITCHES = {
    "fuse-projections": "FUSE_PROJECTIONS",
    "skinny-gemm": "SKINNY_GEMM",
    "kv-write-kernel": "KV_WRITE_KERNEL",
    "rope-write-kernel": "ROPE_WRITE_KERNEL",
    "gated-down": "GATED_DOWN_KERNEL",
    "split-greedy": "SPLIT_GREEDY",
    "combo-kernels": "COMBO_KERNELS",
}

# What each switch's --FLAG on|off does (each defaults to the device's own setting).
SWITCH_HELP = {
    "skinny-gemm": "time the Triton skinny GEMM against cuBLAS per weight shape at start-up and take it where faster",
    "fuse-projections": "fuse each layer's Q/K/V and gate/up linears into one GEMM each where the device does (CUDA)",
    "kv-write-kernel": "write each layer's new K and V with one Triton kernel (CUDA) instead of two index_copy_",
    "rope-write-kernel": "rotate Q and K and write K/V into the cache with one Triton kernel a fused attention layer "
    "(CUDA)",
    "gated-down": "silu(gate) * up inside the down projection's skinny GEMM where it took that kernel (CUDA)",
    "split-greedy": "the greedy argmax over the vocabulary as a split reduction inside the decode graphs (CUDA)",
    "combo-kernels": "with --compile: launch independent elementwise kernels together (inductor's combo kernels, CUDA)",
}


def _ab_knobs(text: str) -> tuple[str, ...]:
    """``--ab``'s value: one knob, or several joined by commas (switched together)."""
    knobs = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in knobs if k not in AB_KNOBS]
    if not knobs or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown knob(s) {unknown or [text]}; choose from {', '.join(AB_KNOBS)}"
        )
    return knobs


def register(sub) -> None:
    p = sub.add_parser(
        "gpu", help="the engine on one accelerator: bounds and Hugging Face static-cache generate"
    )
    _add_args(p)
    p.set_defaults(func=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama3-8b-l8", help="built-in model name or checkpoint folder")
    p.add_argument("--device", default="cuda", help="engine device (cuda; cpu runs the same steps slowly)")
    p.add_argument("--dtype", default="bfloat16", help="weights and KV cache dtype")
    p.add_argument("--prefill", default="1x1024,8x256", help="prefill shapes BATCHxTOKENS, comma-separated")
    p.add_argument("--decode-batches", default="1,8,32,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=512, help="context length of the decode steps")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per item (median reported)")
    p.add_argument(
        "--profile-batch", type=int, default=1, help="decode batch whose kernels are profiled (0: skip)"
    )
    p.add_argument("--offline-batch", type=int, default=64, help="prompts generated at once (0: skip)")
    p.add_argument("--offline-prompt", type=int, default=256, help="tokens per offline prompt")
    p.add_argument("--offline-out", type=int, default=128, help="tokens generated per offline prompt")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--max-decode-splits",
        type=int,
        default=None,
        help="most parts the CUDA decode kernel splits a context into (1: none; default: the kernel's own)",
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the engine's forward (graphs still captured)"
    )
    p.add_argument(
        "--freeze",
        choices=["on", "off"],
        default=None,
        help="with --compile: freeze the weights into the graph (q/k/v and gate/up concatenated by the "
        "compiler); default: the engine's own choice for the device",
    )
    for flag, what in SWITCH_HELP.items():
        p.add_argument(
            f"--{flag}", choices=["on", "off"], default=None, help=f"{what}; default: the device's own"
        )
    p.add_argument(
        "--overlap-decode",
        choices=["auto", "on", "off"],
        default="auto",
        help="launch each decode step before the previous one's tokens reach the host (auto: the engine's default)",
    )
    p.add_argument(
        "--ab",
        type=_ab_knobs,
        default=None,
        metavar="KNOB[,KNOB...]",
        help=f"two engines in this process, the knob on and off (several: switched together), timed in "
        f"alternating rounds (no profile, no offline generation); knobs: {', '.join(AB_KNOBS)}",
    )
    p.add_argument("--rounds", type=int, default=3, help="with --ab: rounds of both engines' steps")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--out", default="bench/results/gpu", help="report path (without extension)")


def _gated_downs(model) -> int:
    """MLPs whose activation runs inside the down projection's kernel (``--gated-down``)."""
    try:
        from engine.kernels.skinny_gemm_triton import is_gated_down
    except ImportError:
        return 0
    return sum(is_gated_down(m) for m in model.modules())


def _offline_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def time_engine_offline(engine, prompts: list[list[int]], out: int) -> tuple[float, list[list[int]]]:
    from engine.request import Request, SamplingParams

    sp = SamplingParams(max_tokens=out, ignore_eos=True)
    engine.generate([Request(f"warm-{i}", p, sp) for i, p in enumerate(prompts[:2])])  # untimed
    reqs = [Request(f"off-{i}", p, sp) for i, p in enumerate(prompts)]
    engine.device.synchronize()
    t0 = time.perf_counter()
    engine.generate(reqs)
    took = time.perf_counter() - t0
    engine.check_integrity()
    return took, [r.output_token_ids for r in reqs]


def time_hf_static(path, dev, dtype, prompts: list[list[int]], out: int) -> tuple[float, list[list[int]]]:
    """Hugging Face ``generate``, greedy, static KV cache, all prompts in one batch (equal lengths: no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(dev).eval()
    ids = torch.tensor(prompts, device=dev)  # [B, P]

    def gen():
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=out,
                min_new_tokens=out,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
            )

    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    gen()  # untimed: the static cache's allocation and the kernels' first launch
    sync()
    t0 = time.perf_counter()
    result = gen()
    sync()
    took = time.perf_counter() - t0
    return took, result[:, ids.shape[1] :].tolist()


# Kernel names by what they compute: cuBLAS/cuBLASLt GEMMs and GEMVs (nvjet is cuBLASLt's Hopper family), the
# paged-attention kernels, and the rest (norms, rotary embedding, residual adds, the KV write, sampling).
_KERNEL_KINDS = (
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas", re.I)),
    ("attention", re.compile(r"paged_decode|merge_splits|flash|attn", re.I)),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in _KERNEL_KINDS if pattern.search(name)), "other")


def profile_decode(engine, batch: int, context: int, steps: int) -> dict:
    """Device time per decode step by kind of kernel, the busiest kernels, and the step's wall time: what the
    device did not spend computing is the host's share (scheduling, inputs, sampling, the token's read-back)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.roofline import time_decode

    on_cuda = engine.device.torch_device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU])
    times = time_decode(engine, batch, context, steps, around=lambda: prof)
    kernels: dict[str, float] = {}
    counts: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3 / steps  # ms a step
            counts[e.key] = counts.get(e.key, 0.0) + e.count / steps
    # Kernels run a step: in a captured graph each adds its start-up gap to the step's idle time.
    launches = sum(counts.values())
    by_kind: dict[str, float] = {}
    for name, ms in kernels.items():
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    busy = sum(kernels.values())
    wall = statistics.median(times) * 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {
        "batch": batch,
        "context": context,
        "wall_ms": wall,
        "device_busy_ms": busy,
        "device_idle_ms": wall - busy,
        "kernels_per_step": launches,
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [{"kernel": name[:120], "ms": ms} for name, ms in top],
        # Every kernel: ms and launches a step, busiest first.
        "kernels": [
            {"kernel": name[:160], "ms": ms, "per_step": counts[name]}
            for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])
        ],
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(args: argparse.Namespace) -> None:
    import torch

    from bench.report import publish
    from bench.roofline import ModelShape, measure_machine, step_rows
    from engine import flat_runner
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    prefill = [tuple(int(x) for x in item.split("x")) for item in args.prefill.split(",") if item]
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    budget = max([b * t for b, t in prefill] + [args.offline_prompt * 2, 8192])
    decode_blocks = max(batches) * (-(-(args.context + args.repeats + 4) // 16) + 1)
    offline_blocks = args.offline_batch * -(-(args.offline_prompt + args.offline_out) // 16)
    cfg = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        overlap_decode=args.overlap_decode,
        cache=CacheConfig(block_size=16, num_blocks=max(decode_blocks, offline_blocks, budget // 16) + 64),
        scheduler=SchedulerConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=max(batches + [args.offline_batch]),
            max_num_prefill_seqs=min(16, max(batches + [args.offline_batch])),
            max_num_batched_tokens=budget,
        ),
    )
    if args.max_decode_splits is not None:  # before the engine captures its decode graphs
        from engine.kernels import paged_decode_triton

        paged_decode_triton.MAX_SPLITS = args.max_decode_splits
    from engine.device import cuda as cuda_device

    for flag, switch in CUDA_SWITCHES.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:  # before the engine loads its model
            setattr(cuda_device, switch, value == "on")
        setattr(args, flag.replace("-", "_"), "on" if getattr(cuda_device, switch) else "off")  # as reported
    if args.freeze is not None:  # before the engine compiles its forward
        flat_runner.FREEZE_WEIGHTS = {
            **flat_runner.FREEZE_WEIGHTS,
            torch.device(args.device).type: args.freeze == "on",
        }
    if args.ab:
        run_ab(args, cfg, prefill, batches)
        return
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    start_s = time.perf_counter() - t0
    dev = engine.device.torch_device
    engine_frozen = flat_runner.FREEZE_WEIGHTS.get(dev.type, False)
    engine_overlap = engine.config.overlap_decode
    linear_choices = engine.linear_choices
    engine_fused = engine.fused_projections
    engine_rope_writes = engine.rope_writes
    engine_gated_downs = _gated_downs(engine.loaded.model)
    model = engine.loaded.model
    dtype = next(model.parameters()).dtype
    machine = measure_machine(dtype, args.repeats, str(dev))
    bw, rate = machine["bandwidth_Bps"], machine["gemm_flops"]
    shape = ModelShape.of(model, torch.tensor([], dtype=dtype).element_size())
    rows = step_rows(engine, shape, prefill, batches, args.context, args.repeats, bw, rate)
    profiled = None
    if args.profile_batch and dev.type == "cuda":
        profiled = profile_decode(engine, args.profile_batch, args.context, args.repeats)
        logger.info("decode batch %d, device time by kind (ms a step): %s", args.profile_batch, profiled)
    offline = None
    if args.offline_batch:
        vocab = len(engine.tokenizer)
        prompts = _offline_prompts(args.offline_batch, args.offline_prompt, vocab)
        ours_s, ours = time_engine_offline(engine, prompts, args.offline_out)
        path = engine.loaded.path
        del engine, model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        hf_s, theirs = time_hf_static(path, dev, dtype, prompts, args.offline_out)
        generated = args.offline_batch * args.offline_out
        prefixes = [_common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
        offline = {
            "batch": args.offline_batch,
            "prompt_tokens": args.offline_prompt,
            "output_tokens": args.offline_out,
            "ours_s": ours_s,
            "hf_static_s": hf_s,
            "ours_tok_s": generated / ours_s,
            "hf_static_tok_s": generated / hf_s,
            "speedup": hf_s / ours_s,
            "identical_outputs": sum(p == args.offline_out for p in prefixes),
            "mean_common_prefix": statistics.mean(prefixes),
        }
    result = {
        **_result_head(args, dev, dtype),
        "max_decode_splits": args.max_decode_splits,
        "frozen_weights": args.compile and engine_frozen,
        "overlap_decode": engine_overlap,
        "skinny_gemm": args.skinny_gemm,
        "kv_write_kernel": args.kv_write_kernel,
        "rope_write_kernel": args.rope_write_kernel,
        "rope_write_layers": engine_rope_writes,
        "gated_down": args.gated_down,
        "gated_down_mlps": engine_gated_downs,
        "split_greedy": args.split_greedy,
        "combo_kernels": args.combo_kernels,
        "fused_projections": engine_fused,
        "linear_choices": linear_choices,
        "torch": torch.__version__,
        "engine_start_s": start_s,
        "bandwidth_GBps": bw / 1e9,
        "gemm_TFLOPs": rate / 1e12,
        "rows": rows,
        "decode_profile": profiled,
        "offline": offline,
    }
    table = [("step", "measured ms", "bound", "bound ms", "measured / bound", "achieved")]
    for r in rows:
        achieved = (
            f"{r['achieved_gflops'] / 1e3:.0f} TFLOP/s"
            if r["bound"] == "gemm"
            else f"{r['achieved_GBps']:.0f} GB/s"
        )
        table.append(
            (
                r["step"],
                f"{r['measured_ms']:.2f}",
                r["bound"],
                f"{r['bound_ms']:.3f}",
                f"{r['ratio']:.2f}",
                achieved,
            )
        )
    if profiled:
        kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in profiled["by_kind_ms"].items())
        table.append(
            (
                f"decode batch {profiled['batch']}: device ms by kind",
                f"{profiled['wall_ms']:.2f} wall, profiled",
                kinds,
                f"{profiled['device_busy_ms']:.2f} busy",
                "",
                f"{profiled['device_idle_ms']:.2f} ms idle, {profiled['kernels_per_step']:.0f} kernels",
            )
        )
    if offline:
        table.append(
            (
                f"offline batch {offline['batch']}",
                f"{offline['ours_tok_s']:.0f} tok/s",
                "HF static",
                f"{offline['hf_static_tok_s']:.0f} tok/s",
                f"{offline['speedup']:.2f}x",
                f"{offline['identical_outputs']}/{offline['batch']} identical",
            )
        )
    publish(
        args.out,
        "The engine on one accelerator: bounds and Hugging Face",
        result,
        table,
        f"device: {result['device']}, copy {bw / 1e9:.0f} GB/s, matmul {rate / 1e12:.0f} TFLOP/s "
        f"({result['dtype']}); engine started in {start_s:.1f} s; compiled {args.compile} (weights frozen "
        f"{result['frozen_weights']}), decode steps overlapped {engine_overlap}, "
        f"skinny GEMM {args.skinny_gemm}, projections fused {engine_fused or 'none'}, K/V write kernel "
        f"{args.kv_write_kernel}, rotary + K/V write kernel {args.rope_write_kernel} ({engine_rope_writes} layers), "
        f"activation in the down projection {args.gated_down} ({engine_gated_downs} MLPs), "
        f"split greedy {args.split_greedy}",
        args.json,
        getattr(args, "command", None),
    )


def _result_head(args: argparse.Namespace, dev, dtype) -> dict:
    """The fields every report of this benchmark starts with: what ran, where, in which dtype."""
    import torch

    return {
        "model": args.model,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "compiled": args.compile,
    }


def _ab_engine(knobs: tuple[str, ...], on: bool, cfg):
    """An engine built with ``knobs`` on or off (the device's switches are put back as they were afterwards)."""
    from dataclasses import replace

    from engine.device import cuda as cuda_device
    from engine.llm_engine import LLMEngine

    if "overlap-decode" in knobs:
        cfg = replace(cfg, overlap_decode="on" if on else "off")
    names = [CUDA_SWITCHES[k] for k in knobs if k in CUDA_SWITCHES]
    before = {name: getattr(cuda_device, name) for name in names}
    for name in names:
        setattr(cuda_device, name, on)
    try:
        return LLMEngine(cfg)
    finally:
        for name, value in before.items():
            setattr(cuda_device, name, value)


def run_ab(args: argparse.Namespace, cfg, prefill: list[tuple[int, int]], batches: list[int]) -> None:
    """``--ab``: both engines' steps in alternating rounds, each round's off/on ratio, against one machine
    measurement."""
    import torch

    from bench.report import publish
    from bench.roofline import ModelShape, measure_machine, step_rows
    from engine.flat_runner import compiled_graphs

    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    # Two engines compile the same forward for two runner objects: room for both sets of graphs, so neither
    # falls back to running eagerly once the other has compiled.
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    engines, start_s = {}, {}
    for side in ("on", "off"):
        t0 = time.perf_counter()
        engines[side] = _ab_engine(args.ab, side == "on", cfg)
        start_s[side] = time.perf_counter() - t0
    model = engines["on"].loaded.model
    dtype = next(model.parameters()).dtype
    dev = engines["on"].device.torch_device
    machine = measure_machine(dtype, args.repeats, str(dev))
    bw, rate = machine["bandwidth_Bps"], machine["gemm_flops"]
    shape = ModelShape.of(model, torch.tensor([], dtype=dtype).element_size())
    rounds: dict[str, list[list[dict]]] = {"on": [], "off": []}
    compiled: list[int] = []  # graphs compiled during each engine's round: none, unless a guard missed
    for r in range(args.rounds):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            before = compiled_graphs()
            rounds[side].append(
                step_rows(engines[side], shape, prefill, batches, args.context, args.repeats, bw, rate)
            )
            compiled.append(compiled_graphs() - before)
    for engine in engines.values():
        engine.check_integrity()
    rows = []
    for i, first in enumerate(rounds["on"][0]):
        on = [rs[i]["measured_ms"] for rs in rounds["on"]]
        off = [rs[i]["measured_ms"] for rs in rounds["off"]]
        ratios = [b / a for a, b in zip(on, off, strict=True)]
        rows.append(
            {
                "step": first["step"],
                "on_ms": on,
                "off_ms": off,
                "off_over_on": ratios,
                "bound": first["bound"],
                "bound_ms": first["bound_ms"],
                "on_over_bound": statistics.median(on) / first["bound_ms"],
                "off_over_bound": statistics.median(off) / first["bound_ms"],
            }
        )
    result = {
        **_result_head(args, dev, dtype),
        "ab": ",".join(args.ab),
        "rounds": args.rounds,
        "engine_start_s": start_s,
        "fused_projections": {side: e.fused_projections for side, e in engines.items()},
        "linear_choices": {side: e.linear_choices for side, e in engines.items()},
        "overlap_decode": {side: e.config.overlap_decode for side, e in engines.items()},
        "torch": torch.__version__,
        "bandwidth_GBps": bw / 1e9,
        "gemm_TFLOPs": rate / 1e12,
        "rows": rows,
        "compiled_during_rounds": compiled,
    }
    knobs = "+".join(args.ab)
    table = [("step", f"{knobs} on, ms", "off, ms", "off / on by round", "bound ms", "on / bound")]
    for row in rows:
        table.append(
            (
                row["step"],
                f"{statistics.median(row['on_ms']):.2f}",
                f"{statistics.median(row['off_ms']):.2f}",
                ", ".join(f"{x:.3f}" for x in row["off_over_on"]),
                f"{row['bound_ms']:.3f} ({row['bound']})",
                f"{row['on_over_bound']:.2f}",
            )
        )
    publish(
        args.out,
        f"The engine on one accelerator: {knobs} on against off, in one process",
        result,
        table,
        f"device: {result['device']}, copy {bw / 1e9:.0f} GB/s, matmul {rate / 1e12:.0f} TFLOP/s "
        f"({result['dtype']}); compiled {args.compile}; {args.rounds} rounds, each engine's steps timed "
        f"{args.repeats} times a round (median); medians of the rounds' figures",
        args.json,
        getattr(args, "command", None),
    )


def main() -> None:
    """``python -m bench.gpu``: the same benchmark without the product's command line (a GPU host may lack Ray)."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    _add_args(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    args.command = "python -m bench.gpu " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(args)


if __name__ == "__main__":
    main()
