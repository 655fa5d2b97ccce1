"""Shape buckets: the fixed tensor shapes the device warms up, and the lookup that pads a batch onto one.

Prompt buckets are ``(batch_size, query_len, ctx_blocks)``; decode buckets are ``(batch_size, 1, num_blocks)``
where ``num_blocks`` is the total number of KV blocks of the whole batch (the flat block layout). Each dimension
is a :class:`~bucket_manager.bucket_range.BucketRange` ``(min, step, max, limit)``; the grid of all combinations is
filtered so no bucket is impossible:

* prompt: ``batch_size * query_len <= max_num_batched_tokens`` and, for a prefix context,
  ``query_len + ctx_blocks * block_size <= max_model_len`` (both limits rounded up to their step, so the top
  bucket, itself rounded up, survives);
* decode: ``num_blocks >= batch_size`` (every sequence holds at least one block).

Defaults derived from the serving configuration (``L = max_model_len``, ``T = max_num_batched_tokens``,
``B = block_size``, ``P = max_num_prefill_seqs``, ``S = max_num_seqs``, ``N`` = KV blocks):

==============  ==============================  ==========================================
dimension       exponential                     linear
==============  ==============================  ==========================================
prompt_bs       ``(1, 1, P, ceil(log2 P)+1)``   ``(1, 32, P)``
prompt_seq      ``(B, B, Q, ceil(log2 Q)+1)``   ``(B, s, Q)``, ``Q = min(L, T)``
prompt_ctx      ``(0, 1, C, C+1)``              ``(0, 1, C)``, ``C = (L - B) // B``
decode_bs       ``(1, 1, S, ceil(log2 S)+1)``   ``(1, 32, S)``
decode_block    ``(B, B, N, ceil(log2 N)+1)``   ``(B, s, N)``
==============  ==============================  ==========================================

``s`` is the block size rounded up so a linear dimension has at most 32 steps (a linear grid at step ``B``
over thousands of blocks would take hours to warm). The context dimension exists only with prefix caching
(otherwise it is ``[0]``) and warms every block count, so a cache hit never pads its context. Minimums are
capped at the maximum so a small model length or cache still yields a valid range.

Overrides, per dimension and field, in increasing precedence: ``overrides={"decode_block": {"step": 64}}``
(from a config file), then environment variables ``BUCKETSERVE_<DIM>_BUCKET_<FIELD>`` with ``<DIM>`` one of
``PROMPT_BS``, ``PROMPT_SEQ``, ``PROMPT_CTX``, ``DECODE_BS``, ``DECODE_BLOCK`` and ``<FIELD>`` one of ``MIN``,
``STEP``, ``MAX``, ``LIMIT`` (e.g. ``BUCKETSERVE_PROMPT_SEQ_BUCKET_MAX=2048``). The caller passes the
environment mapping in; nothing here reads the process environment.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import product

from bucket_manager.bucket_range import STRATEGIES, BucketRange

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_PREFILL_SEQS = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096

DIMENSIONS = ("prompt_bs", "prompt_seq", "prompt_ctx", "decode_bs", "decode_block")
FIELDS = ("min", "step", "max", "limit")
ENV_PREFIX = "BUCKETSERVE_"
LINEAR_MAX_STEPS = 32
LINEAR_BATCH_STEP = 32

Bucket = tuple[int, int, int]


def env_name(dimension: str, field: str) -> str:
    return f"{ENV_PREFIX}{dimension.upper()}_BUCKET_{field.upper()}"


def default_num_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """KV blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens: the size used when none is given."""
    return max_num_seqs * math.ceil(max_model_len / block_size)


def _log2_limit(vmax: int) -> int:
    return math.ceil(math.log2(vmax)) + 1 if vmax > 1 else 1


def _linear_step(unit: int, vmax: int) -> int:
    return max(unit, math.ceil(math.ceil(vmax / LINEAR_MAX_STEPS) / unit) * unit)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ShapeBucketConfig:
    strategy: str
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    prompt_bs: BucketRange
    prompt_seq: BucketRange
    decode_bs: BucketRange
    decode_block: BucketRange
    # None: no prefix caching, so every prompt runs with zero context blocks.
    prompt_ctx: BucketRange | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("block_size", "max_model_len", "max_num_batched_tokens"):
            _positive(name, getattr(self, name))
        for name in DIMENSIONS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, BucketRange):
                raise TypeError(f"{name} must be a BucketRange, got {type(value).__name__}")
        if self.prompt_bs.min < 1:
            raise ValueError(f"prompt_bs.min must be >= 1, got {self.prompt_bs.min}")
        if self.decode_bs.min < 1:
            raise ValueError(f"decode_bs.min must be >= 1, got {self.decode_bs.min}")
        if self.prompt_seq.min < 1:
            raise ValueError(f"prompt_seq.min must be >= 1, got {self.prompt_seq.min}")
        if self.decode_block.min < 1:
            raise ValueError(f"decode_block.min must be >= 1, got {self.decode_block.min}")

    @classmethod
    def from_serving(
        cls,
        strategy: str = "exponential",
        block_size: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_prefill_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        num_blocks: int | None = None,
        prefix_caching: bool = False,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Mapping[str, int]] | None = None,
    ) -> ShapeBucketConfig:
        """Default ranges from the serving flags (None means the engine default), then overrides, then env."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        block = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        model_len = DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len
        seqs = DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
        prefill_seqs = DEFAULT_MAX_NUM_PREFILL_SEQS if max_num_prefill_seqs is None else max_num_prefill_seqs
        tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens
        for name, value in (
            ("block_size", block),
            ("max_model_len", model_len),
            ("max_num_seqs", seqs),
            ("max_num_prefill_seqs", prefill_seqs),
            ("max_num_batched_tokens", tokens),
        ):
            _positive(name, value)
        blocks = default_num_blocks(seqs, model_len, block) if num_blocks is None else num_blocks
        _positive("num_blocks", blocks)

        query_max = min(model_len, tokens)
        query_min = min(block, query_max)
        ctx_max = (model_len - query_min) // block
        block_min = min(block, blocks)
        ranges: dict[str, tuple[int, int, int, int] | None]
        if strategy == "exponential":
            ranges = {
                "prompt_bs": (1, 1, prefill_seqs, _log2_limit(prefill_seqs)),
                "prompt_seq": (query_min, block, query_max, _log2_limit(query_max)),
                "prompt_ctx": (0, 1, ctx_max, ctx_max + 1),
                "decode_bs": (1, 1, seqs, _log2_limit(seqs)),
                "decode_block": (block_min, block_min, blocks, _log2_limit(blocks)),
            }
        else:
            # limit is unused by the linear strategy; the step bounds the count instead.
            ranges = {
                "prompt_bs": (1, LINEAR_BATCH_STEP, prefill_seqs, 1),
                "prompt_seq": (query_min, _linear_step(block, query_max), query_max, 1),
                "prompt_ctx": (0, 1, ctx_max, 1),
                "decode_bs": (1, LINEAR_BATCH_STEP, seqs, 1),
                "decode_block": (block_min, _linear_step(block_min, blocks), blocks, 1),
            }
        if not prefix_caching or ctx_max < 1:
            ranges["prompt_ctx"] = None

        built: dict[str, BucketRange | None] = {}
        for dim in DIMENSIONS:
            base = ranges[dim]
            fields = dict(zip(FIELDS, base, strict=True)) if base is not None else None
            fields = _apply_overrides(dim, fields, (overrides or {}).get(dim), env or {})
            built[dim] = None if fields is None else BucketRange(name=dim, **fields)
        return cls(
            strategy=strategy,
            block_size=block,
            max_model_len=model_len,
            max_num_batched_tokens=tokens,
            prompt_bs=_required(built, "prompt_bs"),
            prompt_seq=_required(built, "prompt_seq"),
            prompt_ctx=built["prompt_ctx"],
            decode_bs=_required(built, "decode_bs"),
            decode_block=_required(built, "decode_block"),
        )

    def with_range(self, dimension: str, value: BucketRange | None) -> ShapeBucketConfig:
        if dimension not in DIMENSIONS:
            raise ValueError(f"dimension must be one of {DIMENSIONS}, got {dimension!r}")
        return replace(self, **{dimension: value})


def _required(built: Mapping[str, BucketRange | None], dim: str) -> BucketRange:
    value = built[dim]
    if value is None:  # only prompt_ctx may be absent
        raise ValueError(f"{dim} has no range")
    return value


def _apply_overrides(
    dim: str,
    fields: dict[str, int] | None,
    config: Mapping[str, int] | None,
    env: Mapping[str, str],
) -> dict[str, int] | None:
    updates: dict[str, int] = {}
    for field, value in (config or {}).items():
        if field not in FIELDS:
            raise ValueError(f"{dim}.{field} is not a bucket field; use one of {FIELDS}")
        updates[field] = value
    for field in FIELDS:
        name = env_name(dim, field)
        if name in env:
            raw = env[name].strip()
            try:
                updates[field] = int(raw)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if not updates:
        return fields
    if fields is None:
        # A context range switched on by override alone needs all of its fields: there is no default to fill in.
        missing = [f for f in FIELDS if f not in updates]
        if missing:
            names = ", ".join(env_name(dim, f) for f in missing)
            raise ValueError(f"{dim} is off by default (no prefix caching); to enable it set all of: {names}")
        return updates
    return {**fields, **updates}


def describe(phase: str, index: int, total: int, bucket: Bucket) -> str:
    """One warm-up log line, e.g. ``[Prompt][1/36] batch_size:1 query_len:128 num_blocks:0``."""
    bs, query, blocks = bucket
    return f"[{phase}][{index}/{total}] batch_size:{bs} query_len:{query} num_blocks:{blocks}"


def _first_at_least(values: list[int], target: int) -> int | None:
    i = bisect.bisect_left(values, target)
    return values[i] if i < len(values) else None


class ShapeBuckets:
    """The warmed shapes of one configuration and the lookup from a batch to the shape it is padded to."""

    def __init__(self, config: ShapeBucketConfig) -> None:
        self.config = config
        strategy = config.strategy
        self.prompt_batch_sizes = config.prompt_bs.values(strategy)
        self.prompt_query_lens = config.prompt_seq.values(strategy)
        self.prompt_ctx_blocks = [0] if config.prompt_ctx is None else config.prompt_ctx.values(strategy)
        self.decode_batch_sizes = config.decode_bs.values(strategy)
        self.decode_block_counts = config.decode_block.values(strategy)
        if self.decode_block_counts[-1] < self.decode_batch_sizes[-1]:
            # A cache smaller than the largest padded batch would leave that batch no bucket (blocks >= batch).
            self.decode_block_counts.append(self.decode_batch_sizes[-1])

        block = config.block_size
        # Both limits rounded up to their grid so the top value, itself rounded up, is not filtered away.
        token_cap = math.ceil(config.max_num_batched_tokens / config.prompt_seq.step) * config.prompt_seq.step
        len_cap = math.ceil(config.max_model_len / block) * block
        self._prompt_set = {
            (bs, q, ctx)
            for bs, q, ctx in product(self.prompt_batch_sizes, self.prompt_query_lens, self.prompt_ctx_blocks)
            if bs * q <= token_cap and (ctx == 0 or q + ctx * block <= len_cap)
        }
        self._decode_set = {
            (bs, 1, n) for bs, n in product(self.decode_batch_sizes, self.decode_block_counts) if n >= bs
        }
        self.prompt: list[Bucket] = sorted(self._prompt_set)
        self.decode: list[Bucket] = sorted(self._decode_set)

    @property
    def max_prompt_batch_size(self) -> int:
        return max(b for b, _, _ in self.prompt) if self.prompt else 0

    @property
    def max_decode_batch_size(self) -> int:
        return max(b for b, _, _ in self.decode) if self.decode else 0

    def find_prompt(self, batch_size: int, query_len: int, ctx_blocks: int = 0) -> Bucket | None:
        """The first prompt bucket (in sorted order) >= the batch in every dimension; None above all of them.

        O(log n): the kept set is closed downwards (each filter only removes larger values), so the first
        dominating bucket is the grid point of the smallest value >= each dimension, if that point was kept.
        """
        if batch_size < 1 or query_len < 0 or ctx_blocks < 0:
            raise ValueError(
                f"batch_size must be >= 1 and query_len, ctx_blocks >= 0; got {batch_size}, {query_len}, {ctx_blocks}"
            )
        bs = _first_at_least(self.prompt_batch_sizes, batch_size)
        q = _first_at_least(self.prompt_query_lens, query_len)
        ctx = _first_at_least(self.prompt_ctx_blocks, ctx_blocks)
        if bs is None or q is None or ctx is None:
            return None
        bucket = (bs, q, ctx)
        return bucket if bucket in self._prompt_set else None

    def find_decode(self, batch_size: int, num_blocks: int) -> Bucket | None:
        """The first decode bucket >= ``(batch_size, 1, num_blocks)``; None above all of them. O(log n).

        The only filter is ``blocks >= batch size``, so after padding the batch size the block count is the
        first value >= both the batch's blocks and the padded batch size.
        """
        if batch_size < 1 or num_blocks < 0:
            raise ValueError(f"batch_size must be >= 1 and num_blocks >= 0; got {batch_size}, {num_blocks}")
        bs = _first_at_least(self.decode_batch_sizes, batch_size)
        if bs is None:
            return None
        blocks = _first_at_least(self.decode_block_counts, max(num_blocks, bs))
        return None if blocks is None else (bs, 1, blocks)
