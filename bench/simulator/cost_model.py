"""Cost model of one worker: how long a prefill batch, a decode step and a KV transfer take.

Three small formulas, each over the *padded* shape the engine actually runs (a batch is padded to a warmed
shape bucket, and on the device a padded row costs what a real one costs):

* prefill ``(B, q)`` (``B`` sequences padded to ``q`` tokens, ``T = B * q``)::

      t = prefill_base_s + prefill_per_seq_s * B + prefill_per_token_s * T + prefill_per_attn_s * B * q^2

  the last term is causal self-attention, quadratic in the query length;
* decode step ``(B, N)`` (``B`` sequences, ``N`` KV blocks over the whole batch)::

      t = decode_base_s + decode_per_seq_s * B + decode_per_block_s * N

  weights are read once per step (``decode_base_s``), every sequence adds its MLP/sampling work and every
  context block is read by attention;
* KV transfer of ``n`` bytes: ``transfer_latency_s + n / (transfer_gbps * 1e9)``.

The coefficients come either from measurements of the real engine (:mod:`bench.simulator.calibrate` writes a
JSON file with :meth:`CostModel.save`) or from accelerator figures (:func:`project`). A model also carries the
serving shape it was measured with (block size, KV blocks per worker, limits), because the simulator builds
the same :class:`~bucket_manager.shape_buckets.ShapeBuckets` the engine builds from them.

Projections (**estimates, not measurements**) for a Llama-3-8B-like model (32 layers, hidden 4096, 8 KV heads
of dimension 128, 8.03 B parameters, bf16), derived from public peak figures with stated efficiency factors:

==================  ==========================  =====================  ===============================
card                dense BF16 peak             memory                 card-to-card link (one way)
==================  ==========================  =====================  ===============================
Intel Gaudi 2       432 TFLOP/s (MME)           96 GB HBM2E, 2.45 TB/s 3 x 100 GbE RoCE per peer in the
                                                                       8-card HLS-Gaudi2 node = 37.5 GB/s
NVIDIA H100 SXM5    989 TFLOP/s (1979 sparse)   80 GB HBM3, 3.35 TB/s  NVLink 4: 900 GB/s bidirectional
                                                                       = 450 GB/s one way
==================  ==========================  =====================  ===============================

Sources: Intel Gaudi 2 AI accelerator white paper and product page (habana.ai/products/gaudi2; 96 GB
HBM2E at 2.45 TB/s, 24 x 100 GbE of which 21 connect the 8 cards of a node, 3 per peer); NVIDIA H100 Tensor
Core GPU datasheet (nvidia.com/en-us/data-center/h100; SXM5 column). Efficiency factors (stated, not measured):
prefill reaches ``COMPUTE_EFFICIENCY`` = 0.5 of the dense peak, decode reaches ``MEMORY_EFFICIENCY`` = 0.6 of
the memory bandwidth, a transfer ``LINK_EFFICIENCY`` = 0.7 of the link; fixed per-launch costs
(``LAUNCH_OVERHEAD_S``) and a transfer latency of ``PROJECTED_TRANSFER_LATENCY_S`` are added. KV memory per
card is ``MEMORY_UTILIZATION`` = 0.9 of the card less the weights.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

# Where the committed calibrations (and the simulator's other reports) are kept.
REPORTS_DIR = Path(__file__).resolve().parents[1] / "reports"

PREFILL_TERMS = ("prefill_base_s", "prefill_per_seq_s", "prefill_per_token_s", "prefill_per_attn_s")
DECODE_TERMS = ("decode_base_s", "decode_per_seq_s", "decode_per_block_s")


@dataclass(frozen=True)
class CostModel:
    name: str
    source: str  # how the figures were obtained: "measured ..." or "projection ..."
    # prefill
    prefill_base_s: float
    prefill_per_seq_s: float
    prefill_per_token_s: float
    prefill_per_attn_s: float
    # decode step
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_block_s: float
    # KV transfer
    transfer_latency_s: float
    transfer_gbps: float
    # serving shape of one worker (what the engine derives its shape buckets and limits from)
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = 128
    max_num_prefill_seqs: int = 16
    max_num_batched_tokens: int = 4096
    # Fixed latencies of the serving path outside the engine: a request's way in (gateway, controller hop)
    # delays its queueing; every token's way out (worker -> gateway -> client stream) delays its arrival.
    request_overhead_s: float = 0.0
    token_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, float | int) and not isinstance(value, bool)
            if number and (not math.isfinite(value) or value < 0):
                raise ValueError(f"CostModel.{f.name} must be a finite number >= 0, got {value!r}")
        if self.transfer_gbps <= 0:
            raise ValueError(f"CostModel.transfer_gbps must be > 0, got {self.transfer_gbps}")
        for name in ("kv_bytes_per_token", "block_size", "num_blocks", "max_model_len", "max_num_seqs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"CostModel.{name} must be >= 1")

    # ------------------------------------------------------------------ costs
    def prefill_s(self, batch: int, query_len: int) -> float:
        """Seconds for a prefill of ``batch`` sequences padded to ``query_len`` tokens."""
        return (
            self.prefill_base_s
            + self.prefill_per_seq_s * batch
            + self.prefill_per_token_s * batch * query_len
            + self.prefill_per_attn_s * batch * query_len * query_len
        )

    def decode_s(self, batch: int, num_blocks: int) -> float:
        """Seconds for one decode step of ``batch`` sequences holding ``num_blocks`` KV blocks in all."""
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_block_s * num_blocks

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move the KV of ``tokens`` tokens from a prefill to a decode worker."""
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9)

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"measurements", "fit"})
        if unknown:
            raise ValueError(f"unknown cost model keys: {unknown}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict() | (extra or {}), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def with_overheads(self, request_s: float, token_s: float) -> CostModel:
        return replace(self, request_overhead_s=request_s, token_overhead_s=token_s)

    def with_slowdown(self, factor: float) -> CostModel:
        """Every compute cost (prefill and decode) times ``factor``: the engine's steps slowed by other processes
        sharing its cores. Transfers and fixed overheads are left alone."""
        scaled = {name: getattr(self, name) * factor for name in (*PREFILL_TERMS, *DECODE_TERMS)}
        return replace(self, **scaled)


# ---------------------------------------------------------------------------- fitting


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the most negative term until none is left.

    A negative cost per token or per block would make a larger batch cheaper, which the simulator must never
    believe; measurement noise on a nearly flat term is the usual cause, and dropping it is the honest fix.
    """
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def prefill_features(batch: int, query_len: int) -> list[float]:
    return [1.0, float(batch), float(batch * query_len), float(batch * query_len * query_len)]


def decode_features(batch: int, num_blocks: int) -> list[float]:
    return [1.0, float(batch), float(num_blocks)]


def _fit(samples: Sequence[tuple[int, int, float]], features, terms: tuple[str, ...]) -> dict[str, float]:
    if len(samples) < len(terms):
        raise ValueError(f"need at least {len(terms)} samples to fit {terms}, got {len(samples)}")
    x = np.array([features(a, b) for a, b, _ in samples])
    y = np.array([t for _, _, t in samples])
    # Relative errors matter (a 5 ms step is as important as a 2 s batch): weight each row by 1 / t.
    w = 1.0 / np.maximum(y, 1e-6)
    coef = nonnegative_lstsq(x * w[:, None], y * w)
    return dict(zip(terms, (float(c) for c in coef), strict=True))


def fit_prefill(samples: Sequence[tuple[int, int, float]]) -> dict[str, float]:
    """``(batch, query_len, seconds)`` samples (padded shapes) -> the four prefill coefficients."""
    return _fit(samples, prefill_features, PREFILL_TERMS)


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> dict[str, float]:
    """``(batch, num_blocks, seconds)`` samples (padded shapes) -> the three decode coefficients."""
    return _fit(samples, decode_features, DECODE_TERMS)


def fit_error(samples: Sequence[tuple[int, int, float]], predict) -> float:
    """Mean absolute relative error of ``predict(a, b)`` over the samples."""
    errs = [abs(predict(a, b) - t) / t for a, b, t in samples if t > 0]
    return float(sum(errs) / len(errs)) if errs else 0.0


# ---------------------------------------------------------------------------- projections


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    memory_bytes: float
    memory_gbps: float  # HBM bandwidth, GB/s
    link_gbps: float  # card-to-card, one way, GB/s: what a prefill worker's KV crosses to its decode worker
    block_size: int  # the device's default KV block size (128 on Gaudi, 16 on CUDA)
    source: str
    # Within one node, one way, GB/s: what a tensor-parallel worker's all-reduces cross (NVLink; Gaudi's
    # on-chip RoCE ports wired card to card).
    scaleup_gbps: float = 0.0
    cards_per_node: int = 8


ACCELERATORS = {
    "gaudi2": Accelerator(
        "Intel Gaudi 2",
        bf16_flops=432e12,
        memory_bytes=96e9,
        memory_gbps=2450.0,
        link_gbps=37.5,
        block_size=128,
        source="Intel Gaudi 2 white paper / habana.ai/products/gaudi2",
        # 21 of its 24 100 GbE ports wired to the other 7 cards of an HLS-2 node.
        scaleup_gbps=262.5,
    ),
    "gaudi3": Accelerator(
        "Intel Gaudi 3",
        bf16_flops=1835e12,
        memory_bytes=128e9,
        memory_gbps=3700.0,
        # 3 of its 24 200 GbE ports for scale-out.
        link_gbps=75.0,
        block_size=128,
        source="Intel Gaudi 3 AI accelerator white paper (HL-325L OAM)",
        # 21 of its 24 200 GbE ports wired to the other 7 cards of a node.
        scaleup_gbps=525.0,
    ),
    "h100": Accelerator(
        "NVIDIA H100 SXM5",
        bf16_flops=989e12,
        memory_bytes=80e9,
        memory_gbps=3350.0,
        link_gbps=450.0,
        block_size=16,
        source="NVIDIA H100 datasheet, SXM5 column",
        scaleup_gbps=450.0,
    ),
    "h200": Accelerator(
        "NVIDIA H200 SXM",
        bf16_flops=989e12,
        memory_bytes=141e9,
        memory_gbps=4800.0,
        link_gbps=450.0,
        block_size=16,
        source="NVIDIA H200 datasheet, SXM column",
        scaleup_gbps=450.0,
    ),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    num_layers: int
    hidden: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


PROJECTION_MODELS = {
    "llama3-8b": ModelShape("Llama-3-8B", 8.03e9, 32, 4096, 8, 128, 2),
    "llama3-70b": ModelShape("Llama-3-70B", 70.6e9, 80, 8192, 8, 128, 2),
}

COMPUTE_EFFICIENCY = 0.5
MEMORY_EFFICIENCY = 0.6
LINK_EFFICIENCY = 0.7
MEMORY_UTILIZATION = 0.9
LAUNCH_OVERHEAD_S = 2e-3  # per batch or step: host scheduling, graph launch
# A tensor-parallel worker's weights may take this share of its cards' memory; the rest holds KV and activations.
MAX_WEIGHT_SHARE = 0.6
ALLREDUCE_LATENCY_S = 10e-6  # per all-reduce: two per layer in a tensor-parallel forward
PROJECTED_TRANSFER_LATENCY_S = 1e-3


def tensor_parallel(hardware: str, model: str) -> int:
    """Cards per worker: the fewest (1, 2, 4 or 8) whose memory holds the model's weights within
    ``MAX_WEIGHT_SHARE``, leaving the rest for KV."""
    acc, m = ACCELERATORS[hardware], PROJECTION_MODELS[model]
    for tp in (1, 2, 4, 8):
        if m.params * m.dtype_bytes / tp <= MAX_WEIGHT_SHARE * acc.memory_bytes:
            return tp
    raise ValueError(f"{m.name} does not fit 8 cards of {acc.name}")


def project(
    hardware: str,
    model: str = "llama3-8b",
    max_model_len: int = 4096,
    max_num_seqs: int = 128,
    max_num_prefill_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    tp: int | None = None,
) -> CostModel:
    """A cost model for one worker of ``tp`` cards of ``hardware`` running ``model`` (default: as few cards as
    hold it, :func:`tensor_parallel`), from peak figures (a projection).

    With ``tp`` cards, compute, memory bandwidth and memory add up, and every layer adds two all-reduces of the
    tokens' hidden states over the node's scale-up links (ring: ``2 (tp - 1) / tp`` of the bytes each way).
    """
    if hardware not in ACCELERATORS:
        raise ValueError(f"hardware must be one of {sorted(ACCELERATORS)}, got {hardware!r}")
    if model not in PROJECTION_MODELS:
        raise ValueError(f"model must be one of {sorted(PROJECTION_MODELS)}, got {model!r}")
    acc, m = ACCELERATORS[hardware], PROJECTION_MODELS[model]
    tp = tp or tensor_parallel(hardware, model)
    if tp not in (1, 2, 4, 8) or tp > acc.cards_per_node:
        raise ValueError(f"tp must be 1, 2, 4 or 8 cards of one node, got {tp}")
    flops = acc.bf16_flops * COMPUTE_EFFICIENCY * tp
    bw = acc.memory_gbps * 1e9 * MEMORY_EFFICIENCY * tp
    weight_bytes = m.params * m.dtype_bytes
    kv_block_bytes = m.kv_bytes_per_token * acc.block_size
    num_blocks = int((acc.memory_bytes * tp * MEMORY_UTILIZATION - weight_bytes) // kv_block_bytes)
    if num_blocks < 1:
        raise ValueError(f"{m.name} leaves no KV memory on {tp} card(s) of {acc.name}")
    # Attention flops per q^2 of one sequence: QK^T and AV, each `hidden` MACs per token pair per layer (every
    # query head computes, whatever the KV heads), 2 flops per MAC, half the square for the causal mask.
    attn_per_q2 = 2 * m.num_layers * m.hidden
    # Tensor parallelism: per token, 2 all-reduces per layer of its hidden state; per step, their latency.
    allreduce_per_token_s = allreduce_base_s = 0.0
    if tp > 1:
        ring = 2 * (tp - 1) / tp
        scaleup = acc.scaleup_gbps * 1e9 * LINK_EFFICIENCY
        allreduce_per_token_s = 2 * m.num_layers * ring * m.hidden * m.dtype_bytes / scaleup
        allreduce_base_s = 2 * m.num_layers * ALLREDUCE_LATENCY_S
    return CostModel(
        name=f"{hardware}-{model}" + (f"-tp{tp}" if tp > 1 else ""),
        source=(
            f"projection from stated figures ({acc.name}: {acc.bf16_flops / 1e12:.0f} TFLOP/s bf16, "
            f"{acc.memory_gbps / 1000:.2f} TB/s, link {acc.link_gbps:.1f} GB/s, scale-up {acc.scaleup_gbps:.1f} "
            f"GB/s; {acc.source}), {tp} card(s) per worker, efficiency compute {COMPUTE_EFFICIENCY}, memory "
            f"{MEMORY_EFFICIENCY}, link {LINK_EFFICIENCY}; {m.name}"
        ),
        prefill_base_s=LAUNCH_OVERHEAD_S + allreduce_base_s,
        prefill_per_seq_s=0.0,
        # Weights must also stream from memory once per batch; for any real batch compute dominates.
        prefill_per_token_s=2 * m.params / flops + allreduce_per_token_s,
        prefill_per_attn_s=attn_per_q2 / flops,
        decode_base_s=LAUNCH_OVERHEAD_S + allreduce_base_s + weight_bytes / bw,
        decode_per_seq_s=2 * m.params / flops + allreduce_per_token_s,
        decode_per_block_s=kv_block_bytes / bw,
        transfer_latency_s=PROJECTED_TRANSFER_LATENCY_S,
        transfer_gbps=acc.link_gbps * LINK_EFFICIENCY,
        kv_bytes_per_token=m.kv_bytes_per_token,
        block_size=acc.block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_prefill_seqs=max_num_prefill_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def calibration_path(model: str) -> Path:
    """Where the calibration of ``model`` is kept (``simulate --calibrate`` writes it there by default)."""
    return REPORTS_DIR / f"calibration_{model}.json"


def load_cost(args: argparse.Namespace) -> CostModel:
    """The cost model ``bucketserve simulate``'s flags name: a projection for ``--hardware``, else the
    calibration in ``--calibration`` or the one kept for ``--model``."""
    if args.hardware:
        return project(args.hardware, args.projection_model)
    path = Path(args.calibration) if args.calibration else calibration_path(args.model)
    if not path.is_file():
        raise FileNotFoundError(
            f"no calibration at {path}: make one with `bucketserve simulate --calibrate --model {args.model}`"
        )
    return CostModel.load(path)
