"""What a worker actor tells the cluster about itself once its model is loaded and warmed, and how a prefill
worker knows a decode worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ray.actor import ActorHandle

from bucket_manager.shape_buckets import ShapeBucketConfig


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's identity and its engine's fixed facts; the answer of every worker actor's ``info()``.

    Workers of one cluster load the same model with the same engine config, so any one worker's
    ``block_size`` / ``max_model_len`` / ``shape_config`` describe them all.
    """

    worker_id: str
    role: str  # "prefill", "decode" or "colocated"
    # The actor answers only after its constructor (model load and warm-up) returned.
    warmed: bool
    startup_s: float
    warmup: dict[str, float]  # seconds per warm-up phase
    kv_blocks_total: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    shape_config: ShapeBucketConfig
    eos_token_ids: tuple[int, ...]
    model_path: str
    device: str  # "cpu", "cuda" or "hpu"
    dtype: str  # of weights and KV cache
    shape_policy: str  # "flat" or "buckets"
    # Decode workers: where their KV receiver listens (prefill workers send there); None for other roles.
    address: str | None = None
    # The Ray node the worker runs on, and the cores it is pinned to (empty: not pinned): which workers share a node's
    # cores (a prefill worker borrows an idle decode worker's, bucket_manager/lending.py).
    node_id: str = ""
    cores: tuple[int, ...] = ()


class DecodePeer(NamedTuple):
    """A decode worker as a prefill worker reaches it: its actor, and the address its KV goes to."""

    handle: ActorHandle
    kv_address: str
