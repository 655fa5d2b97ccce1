"""The simulator's data: its configuration, a simulated request, each worker's simulated state and the result."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bench.metrics import BenchResult, RequestOutcome
from bench.simulator.cost_model import CostModel
from bench.simulator.host import HostModel
from bucket_manager.dispatcher import DispatcherConfig
from bucket_manager.lending import LendingPolicy
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.shape_buckets import ShapeBucketConfig
from bucket_manager.worker_ledger import WorkerLedger

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class SimConfig:
    cost: CostModel
    mode: str = "disaggregated"
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated_workers: int = 1
    slo_ttft_ms: float = 450.0
    slo_tpot_ms: float = 50.0
    policy: PriorityPolicy = field(default_factory=PriorityPolicy)
    theta: float = 0.5
    max_batches_per_prefill_worker: int = 2  # the controller's default
    strategy: str = "exponential"
    # False: the DistServe-like baseline, the controller's ``fcfs`` scheduling (one queue in arrival order).
    request_buckets: bool = True
    # Host CPU contention (workers, gateway and client sharing a few cores); None: every worker has its own
    # device and the host keeps up, as on an accelerator node.
    host: HostModel | None = None
    # Elastic prefill, as the served controller does it (serve --elastic): off unless given.
    lending: LendingPolicy = field(default_factory=LendingPolicy)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefill_workers", "decode_workers", "colocated_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def shape_config(self) -> ShapeBucketConfig:
        """The warmed shapes of a worker serving with the cost model's limits."""
        cost = self.cost
        return ShapeBucketConfig.from_serving(
            strategy=self.strategy,
            block_size=cost.block_size,
            max_model_len=cost.max_model_len,
            max_num_seqs=cost.max_num_seqs,
            max_num_prefill_seqs=cost.max_num_prefill_seqs,
            max_num_batched_tokens=cost.max_num_batched_tokens,
            num_blocks=cost.num_blocks,
        )

    def dispatcher_config(self) -> DispatcherConfig:
        """What the served controller would plan with: the figures its workers report, and the policy."""
        return DispatcherConfig(
            block_size=self.cost.block_size,
            max_model_len=self.cost.max_model_len,
            max_num_batched_tokens=self.cost.max_num_batched_tokens,
            shape_config=self.shape_config(),
            policy=self.policy,
            theta=self.theta,
            max_batches_per_prefill_worker=self.max_batches_per_prefill_worker,
            scheduling="buckets" if self.request_buckets else "fcfs",
            lending=self.lending,
        )


@dataclass
class SimRequest:
    rid: str
    prompt_len: int
    output_len: int
    arrival: float
    priority_class: PriorityClass = PriorityClass.ONLINE
    priority: int = 0
    ttft_slo_ms: float | None = None
    first_token: float | None = None
    finish: float | None = None
    generated: int = 0
    done: bool = False  # its last token is computed (it is stamped with ``finish`` once delivered)
    first_sent: bool = False  # its first token is computed
    # colocated: tokens whose KV is in the cache (0 when waiting or preempted)
    computed: int = 0
    blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    def summary(self) -> RequestSummary:
        """What the gateway would submit to the controller for it."""
        return RequestSummary(
            self.rid,
            self.prompt_len,
            self.output_len,
            priority_class=self.priority_class,
            priority=self.priority,
            arrival=self.arrival,
            ttft_slo_ms=self.ttft_slo_ms,
        )


@dataclass
class PrefillState:
    wid: str
    ledger: WorkerLedger  # the dispatcher's row for this worker
    unsent: dict[int, set[str]] = field(default_factory=dict)  # batch id -> requests whose KV has not left
    queue: deque = field(default_factory=deque)  # FCFS batches: (batch id, plan, decode worker id)
    # batch id -> its forward time, reported with batch_done
    forward_s: dict[int, float] = field(default_factory=dict)
    busy: bool = False
    link_free_at: float = 0.0

    @property
    def reserved(self) -> dict[str, int]:
        return self.ledger.reserved

    @property
    def outstanding(self) -> dict[int, tuple[str, ...]]:
        return self.ledger.outstanding


@dataclass
class DecodeState:
    wid: str
    ledger: WorkerLedger
    arrived: list[SimRequest] = field(default_factory=list)  # KV received, joins at the next step
    running: list[SimRequest] = field(default_factory=list)
    busy: bool = False
    lent: deque[tuple[int, Any]] = field(default_factory=deque)  # lent prompt batches: (batch id, plan)

    @property
    def reserved(self) -> dict[str, int]:
        return self.ledger.reserved


@dataclass
class ColocatedState:
    wid: str
    total_blocks: int
    free_blocks: int
    waiting: deque = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    in_flight: int = 0
    busy: bool = False


@dataclass
class SimResult:
    requests: list[SimRequest]
    config: SimConfig
    rate: float
    stats: dict[str, Any]

    def bench_result(self) -> BenchResult:
        outcomes = []
        for r in self.requests:
            o = RequestOutcome(
                request_id=r.rid,
                priority=None,
                input_len=r.prompt_len,
                expected_output_len=r.output_len,
                slo_ttft_ms=self.config.slo_ttft_ms,
                slo_tpot_ms=self.config.slo_tpot_ms,
                start_s=r.arrival,
            )
            if r.first_token is not None and r.finish is not None:
                o.success = True
                o.ttft_s = r.first_token - r.arrival
                o.e2e_s = r.finish - r.arrival
                o.output_tokens = r.output_len
                o.usage_reported = True
            else:
                o.error = "not finished when the simulation ended"
            outcomes.append(o)
        # The client's clock starts at 0 and the run ends with the last token, as in ``bench serve``.
        end = max((r.finish for r in self.requests if r.finish is not None), default=0.0)
        return BenchResult(outcomes=outcomes, duration_s=end, request_rate=self.rate)

    def summary(self) -> dict[str, Any]:
        s = self.bench_result().summary()
        keep = (
            "request_rate",
            "num_requests",
            "completed",
            "failed",
            "duration_s",
            "slo_attainment",
            "goodput_rps",
            "request_throughput_rps",
            "output_tok_per_s",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
        )
        return {k: s.get(k) for k in keep} | self.stats
