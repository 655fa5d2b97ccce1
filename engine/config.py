"""Frozen, typed engine configuration, validated at construction with errors that name the field.

Defaults that depend on the hardware (block size) or on the model (max_model_len) are resolved
once, at start-up, by :func:`resolve_engine_config`; the resulting config is never mutated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_PREFILL_SEQS = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096
# A colocated engine's step budget on a CPU, where --max-num-batched-tokens is not given. One step's prompt
# tokens delay the first token of every prompt in it and the next token of every request decoding there: 4096
# tokens are a step of about a second on a 2-core host, so a burst's short online prompts waited for its long
# ones. With 512, on the bursty two-class sweep (2-core Xeon, AVX-512; `small`; README), two runs each way
# alternating: 0.93-0.94 / 0.84-0.88 / 0.84-0.85 / 0.79-0.80 / 0.78-0.84 / 0.76-0.80 at 1.5-6 req/s against
# 0.90-0.93 / 0.84-0.86 / 0.78-0.82 / 0.71 / 0.68-0.78 / 0.72 with 4096. Accelerators keep the engine's budget:
# their prompt steps are short and large batches are where their prefill rate comes from.
COLOCATED_CPU_STEP_TOKENS = 512

DTYPES = ("float32", "bfloat16", "float16")
# KV block size per device. CPU: 64 slots. A CPU core streams a block's K/V rows from DRAM faster the longer the
# contiguous run its prefetchers can follow: on a 2-core AMD EPYC (Zen 5), a bare sum over 512 MiB in shuffled
# blocks read 22.9 GB/s on one thread in 16 KiB runs (one 16-slot block of `small`'s layer) against 32.4 in 64 KiB
# runs, and the decode attention kernel over eight layers' caches at context 512, paired in one process, read
# 26.0 / 28.2 / 24.7 GB/s (batch 8 / 32 / 128, 2 threads) in 16-slot blocks against 30.7 / 32.9 / 27.7 in
# 64-slot ones (32: 28.9 / 31.4 / 26.6; 128: 31.7 / 34.4 / 27.8). The kernel's key chunks stay 128 slots, so
# scores and outputs are the same bits in either size. A request wastes under one block: at most 63 slots.
DEFAULT_BLOCK_SIZE = {"hpu": 128, "cuda": 16, "cpu": 64}
# What a device runs by default: flat tokens with no padding (CPU, CUDA), or the 3-D shape buckets that HPU
# graphs need. ``--shape-policy`` overrides, so the bucket path runs on CPU in CI too.
SHAPE_POLICIES = ("flat", "buckets")
DEFAULT_SHAPE_POLICY = {"hpu": "buckets", "cuda": "flat", "cpu": "flat"}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    # None: the device's default (128 on HPU, 64 on CPU, 16 on CUDA), chosen at start-up.
    block_size: int | None = None
    # Fraction of the device's memory the worker may use in all (weights + activations + KV).
    gpu_memory_utilization: float = 0.9
    # Fraction of the memory left after weights and profiling that is kept for captured graphs.
    graph_reserve_fraction: float = 0.1
    # Fixed number of KV blocks; None = size from free memory after a profiling pass.
    num_blocks: int | None = None
    # On CPU the "device memory" is host RAM shared with everything else: cap the KV cache.
    cpu_kv_cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        _positive(self, "cpu_kv_cache_bytes")
        if self.block_size is not None:
            _positive(self, "block_size")
        if self.num_blocks is not None:
            _positive(self, "num_blocks")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0.0 <= self.graph_reserve_fraction < 1.0:
            raise ConfigError(
                f"CacheConfig.graph_reserve_fraction must be in [0, 1), got {self.graph_reserve_fraction}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    # None: the model's max_position_embeddings, capped at DEFAULT_MAX_MODEL_LEN, at start-up.
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_prefill_seqs: int = DEFAULT_MAX_NUM_PREFILL_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Flat policy: each step's prompt tokens capped so that the requests decoding in it keep their TPOT SLOs
    # (engine/tpot_guard.py; off by default: it trades TTFT for TPOT). Requests without an SLO set no cap.
    tpot_guard: bool = False

    def __post_init__(self) -> None:
        _positive(self, "max_num_seqs", "max_num_prefill_seqs", "max_num_batched_tokens")
        if not isinstance(self.tpot_guard, bool):
            raise ConfigError(f"SchedulerConfig.tpot_guard must be a bool, got {self.tpot_guard!r}")
        if self.max_model_len is not None:
            _positive(self, "max_model_len")
        if self.max_num_prefill_seqs > self.max_num_seqs:
            raise ConfigError(
                f"SchedulerConfig.max_num_prefill_seqs ({self.max_num_prefill_seqs}) must be <= "
                f"max_num_seqs ({self.max_num_seqs})"
            )


@dataclass(frozen=True)
class BucketingConfig:
    strategy: str = "exponential"
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in ("exponential", "linear"):
            raise ConfigError(
                f"BucketingConfig.strategy must be 'exponential' or 'linear', got {self.strategy!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    # "auto": the checkpoint's own dtype (float32 when its config names none), resolved at start-up.
    dtype: str = "auto"
    seed: int = 0
    skip_warmup: bool = False
    # CPU only: torch.compile(dynamic=False) per warmed bucket.
    compile: bool = False
    # "flat" (no padding; decodes and prefill chunks share a step), "buckets" (padded warmed shapes), or
    # "auto": the device's default, resolved at start-up.
    shape_policy: str = "auto"
    # Decode steps queued one ahead of the host (flat policy): step N+1 is launched with step N's tokens still
    # on the device, so the host's bookkeeping overlaps the device's work. "auto": on where decode steps are
    # device graphs (CUDA), off on the CPU (host and device are the same cores); resolved at start-up.
    overlap_decode: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    bucketing: BucketingConfig = field(default_factory=BucketingConfig)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda", "hpu"):
            raise ConfigError(f"EngineConfig.device must be auto, cpu, cuda or hpu, got {self.device!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(
                f"EngineConfig.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if not self.model:
            raise ConfigError("EngineConfig.model must not be empty")
        if self.shape_policy not in ("auto", *SHAPE_POLICIES):
            raise ConfigError(
                f"EngineConfig.shape_policy must be auto, flat or buckets, got {self.shape_policy!r}"
            )
        if self.overlap_decode not in ("auto", "on", "off"):
            raise ConfigError(
                f"EngineConfig.overlap_decode must be auto, on or off, got {self.overlap_decode!r}"
            )


def config_from_args(args) -> EngineConfig:
    """Build an EngineConfig from parsed ``engine.args`` flags; a flag left as None is resolved at start-up."""

    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}

    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return EngineConfig(
        model=g("model", "default"),
        device=g("device", "auto"),
        dtype=g("dtype", "auto"),
        seed=g("seed", 0),
        skip_warmup=bool(g("skip_warmup", False)),
        compile=bool(g("compile", False)),
        shape_policy=g("shape_policy", "auto"),
        overlap_decode=g("overlap_decode", "auto"),
        cache=CacheConfig(
            **given(
                block_size=g("block_size"),
                num_blocks=g("num_blocks"),
                gpu_memory_utilization=g("gpu_memory_utilization"),
            )
        ),
        scheduler=SchedulerConfig(
            **given(
                max_model_len=g("max_model_len"),
                max_num_seqs=g("max_num_seqs"),
                max_num_prefill_seqs=g("max_num_prefill_seqs"),
                max_num_batched_tokens=g("max_num_batched_tokens"),
                tpot_guard=None if g("tpot_guard") is None else g("tpot_guard") == "on",
            )
        ),
        bucketing=BucketingConfig(
            strategy=g("strategy", "exponential"), prefix_caching=bool(g("prefix_caching"))
        ),
    )


def fit_to_model(cfg: EngineConfig, model_max_len: int, checkpoint_dtype: str) -> EngineConfig:
    """Check the config against the model's own limits and take its dtype for "auto". Needs only the
    checkpoint's config file, so a command line can run it before anything starts."""
    sched = cfg.scheduler
    if sched.max_model_len is None:
        sched = replace(sched, max_model_len=min(DEFAULT_MAX_MODEL_LEN, model_max_len))
    elif sched.max_model_len > model_max_len:
        raise ConfigError(
            f"SchedulerConfig.max_model_len ({sched.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({model_max_len})"
        )
    dtype = checkpoint_dtype if cfg.dtype == "auto" else cfg.dtype
    if dtype not in DTYPES:
        raise ConfigError(f"EngineConfig.dtype: the checkpoint's dtype {dtype!r} is not one of {DTYPES}")
    return replace(cfg, dtype=dtype, scheduler=sched)


def block_size_for(cfg: EngineConfig, device_name: str) -> int:
    """The KV block size an engine of ``cfg`` will use on ``device_name``: the configured one or the device's."""
    return cfg.cache.block_size or DEFAULT_BLOCK_SIZE[device_name]


def resolve_engine_config(
    cfg: EngineConfig, device_name: str, model_max_len: int, checkpoint_dtype: str = "float32"
) -> EngineConfig:
    """Fill the device- and model-dependent defaults (block size, max_model_len, dtype) once, at start-up."""
    cfg = fit_to_model(cfg, model_max_len, checkpoint_dtype)
    cache = cfg.cache
    if cache.block_size is None:
        cache = replace(cache, block_size=block_size_for(cfg, device_name))
    policy = DEFAULT_SHAPE_POLICY[device_name] if cfg.shape_policy == "auto" else cfg.shape_policy
    overlap = cfg.overlap_decode
    if overlap == "auto":
        overlap = "on" if device_name == "cuda" and policy == "flat" else "off"
    elif overlap == "on" and policy != "flat":
        raise ConfigError("EngineConfig.overlap_decode 'on' needs shape_policy flat")
    return replace(cfg, device=device_name, cache=cache, shape_policy=policy, overlap_decode=overlap)
