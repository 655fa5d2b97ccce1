"""Prefill/decode autoscaling policy: when to add or remove a worker of each role. Pure: ints and floats in, a
step out; the controller measures the signals, keeps the clocks and carries the step out.

A role grows when its signal has stayed over budget for ``breach_s`` (one slow batch is not a trend):

* prefill: the oldest queued request's wait against ``scale_ttft_budget_s`` (it is time to first token spent before
  any prefill starts, the part more prefill workers remove), while every prefill worker is busy: a queue that
  waits for decode memory, with prefill workers idle, is not one more prefill workers would shorten;
* decode: the share of the decode workers' KV blocks promised against ``kv_high`` (when it is full, requests
  wait for decode memory), or the slowest decode worker's step time against ``scale_tpot_budget_s`` (each
  step gives every running request one token: a step over the budget is a TPOT over it).

It shrinks when it has had nothing to do (prefill: an empty queue and no batch on any worker; decode: KV use
under ``kv_low``) for ``scale_idle_s``. A role that just changed waits ``cooldown_s`` before the next change, and one
with a worker still starting does not grow again: a new worker takes seconds to load and warm up, and adding
another meanwhile overshoots.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ScalingConfig:
    min_prefill_workers: int = 1
    max_prefill_workers: int = 1
    min_decode_workers: int = 1
    max_decode_workers: int = 1
    scale_ttft_budget_s: float = 1.0
    scale_tpot_budget_s: float = 0.1
    kv_high: float = 0.9
    kv_low: float = 0.3
    breach_s: float = 2.0
    scale_idle_s: float = 60.0
    cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        for role in ROLES:
            lo, hi = self.bounds(role)
            if isinstance(lo, bool) or not isinstance(lo, int) or lo < 1:
                raise ValueError(f"ScalingConfig.min_{role}_workers must be an int >= 1, got {lo!r}")
            if isinstance(hi, bool) or not isinstance(hi, int) or hi < lo:
                raise ValueError(
                    f"ScalingConfig.max_{role}_workers must be an int >= ScalingConfig.min_{role}_workers ({lo}), "
                    f"got {hi!r}"
                )
        for name in ("scale_ttft_budget_s", "scale_tpot_budget_s", "breach_s", "scale_idle_s", "cooldown_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ScalingConfig.{name} must be > 0, got {value!r}")
        if not 0 < self.kv_low < self.kv_high <= 1:
            raise ValueError(
                f"ScalingConfig.kv_low and kv_high must satisfy 0 < kv_low < kv_high <= 1, "
                f"got {self.kv_low!r} and {self.kv_high!r}"
            )

    def bounds(self, role: str) -> tuple[int, int]:
        if role == "prefill":
            return self.min_prefill_workers, self.max_prefill_workers
        if role == "decode":
            return self.min_decode_workers, self.max_decode_workers
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")

    @property
    def enabled(self) -> bool:
        return any(lo != hi for lo, hi in map(self.bounds, ROLES))


@dataclass(frozen=True)
class RoleSignal:
    """One role, now. Durations are None while the condition does not hold."""

    role: str
    serving: int  # workers planned for (not draining, not starting)
    starting: int  # workers asked for and not yet serving
    over_budget_for_s: float | None
    idle_for_s: float | None
    since_change_s: float | None  # None: never changed


def pressure(
    role: str,
    config: ScalingConfig,
    oldest_wait_s: float | None,
    kv_usage: float,
    busy: int,
    serving: int,
    step_s: float | None = None,
) -> bool:
    """Whether the role's signal is over budget now (``busy`` of its ``serving`` workers hold work; ``step_s``:
    the slowest of its workers' latest step, when known)."""
    if role == "prefill":
        return oldest_wait_s is not None and oldest_wait_s > config.scale_ttft_budget_s and busy >= serving
    return kv_usage > config.kv_high or (step_s is not None and step_s > config.scale_tpot_budget_s)


def idle(role: str, config: ScalingConfig, queued: int, busy_workers: int, kv_usage: float) -> bool:
    """Whether the role has nothing (prefill) or little (decode) to do now."""
    if role == "prefill":
        return queued == 0 and busy_workers == 0
    return kv_usage < config.kv_low


def decide(config: ScalingConfig, signal: RoleSignal) -> int:
    """+1: add a worker of the role; -1: drain and remove one; 0: keep."""
    lo, hi = config.bounds(signal.role)
    total = signal.serving + signal.starting
    if signal.since_change_s is not None and signal.since_change_s < config.cooldown_s:
        return 0
    if (
        signal.over_budget_for_s is not None
        and signal.over_budget_for_s >= config.breach_s
        and signal.starting == 0
        and total < hi
    ):
        return 1
    if signal.idle_for_s is not None and signal.idle_for_s >= config.scale_idle_s and signal.serving > lo:
        return -1
    return 0


@dataclass
class ScalingEvent:
    """One change of a role's worker count, with its clocks (the controller's monotonic seconds)."""

    role: str
    direction: str  # "up" or "down"
    worker_id: str
    decided_at: float
    # Up: since when the signal was over budget; down: since when the role was idle.
    since: float | None
    done_at: float | None = None  # up: the worker serving; down: the worker drained and removed

    def as_dict(self) -> dict:
        return {
            "role": self.role,
            "direction": self.direction,
            "worker_id": self.worker_id,
            "signal_to_decision_s": None if self.since is None else round(self.decided_at - self.since, 3),
            "decision_to_done_s": None if self.done_at is None else round(self.done_at - self.decided_at, 3),
        }


class ScalingState:
    """The clocks the policy reads, per role: since when its signal has been over budget, since when it has been
    idle, when it last changed; and the workers starting and draining. Fed by the controller, tick by tick."""

    def __init__(self, config: ScalingConfig) -> None:
        self.config = config
        self.over_since: dict[str, float | None] = dict.fromkeys(ROLES)
        self.idle_since: dict[str, float | None] = dict.fromkeys(ROLES)
        self.changed_at: dict[str, float | None] = dict.fromkeys(ROLES)
        self.starting: dict[str, ScalingEvent] = {}  # worker id -> its scale-up
        self.draining: dict[str, ScalingEvent] = {}  # worker id -> its scale-down
        self.events: list[ScalingEvent] = []

    def observe(self, role: str, now: float, over_budget: bool, is_idle: bool) -> None:
        if not over_budget:
            self.over_since[role] = None
        elif self.over_since[role] is None:
            self.over_since[role] = now
        if not is_idle:
            self.idle_since[role] = None
        elif self.idle_since[role] is None:
            self.idle_since[role] = now

    def step(self, role: str, now: float, serving: int) -> int:
        def age(t: float | None) -> float | None:
            return None if t is None else now - t

        return decide(
            self.config,
            RoleSignal(
                role=role,
                serving=serving,
                starting=sum(1 for e in self.starting.values() if e.role == role),
                over_budget_for_s=age(self.over_since[role]),
                idle_for_s=age(self.idle_since[role]),
                since_change_s=age(self.changed_at[role]),
            ),
        )

    def started(self, role: str, worker_id: str, now: float) -> ScalingEvent:
        event = ScalingEvent(role, "up", worker_id, now, self.over_since[role])
        self.starting[worker_id] = event
        self.events.append(event)
        self.changed_at[role] = now
        self.over_since[role] = None  # the next scale-up needs a fresh breach, counted from now
        return event

    def serving(self, worker_id: str, now: float) -> ScalingEvent | None:
        event = self.starting.pop(worker_id, None)
        if event is not None:
            event.done_at = now
            self.changed_at[event.role] = now
        return event

    def overdue(self, now: float, timeout_s: float) -> list[str]:
        """Workers asked for more than ``timeout_s`` ago that never joined (out of memory, no node for them):
        forgotten here, so the role may try again; the caller stops them."""
        late = [w for w, e in self.starting.items() if now - e.decided_at > timeout_s]
        for w in late:
            del self.starting[w]
        return late

    def drain(self, role: str, worker_id: str, now: float) -> ScalingEvent:
        event = ScalingEvent(role, "down", worker_id, now, self.idle_since[role])
        self.draining[worker_id] = event
        self.events.append(event)
        self.changed_at[role] = now
        self.idle_since[role] = None
        return event

    def removed(self, worker_id: str, now: float) -> ScalingEvent | None:
        event = self.draining.pop(worker_id, None)
        if event is not None:
            event.done_at = now
        return event

    def summary(self, last: int = 20) -> dict:
        return {
            "starting": sorted(self.starting),
            "draining": sorted(self.draining),
            "events": [e.as_dict() for e in self.events[-last:]],
        }
