"""Elastic prefill: when a decode worker lends its steps to a batch of prompts, and how big each batch is.

A cluster of one prefill and one decode worker leaves the decode worker's compute idle while prompts queue behind
the prefill worker (a burst after a quiet spell). With lending on, the dispatcher also plans prompt batches for a
decode worker that has slack: it runs the prompts in its own engine steps (chunked prefill mixed into its decode
steps, no KV transfer: the blocks are its own) and then decodes them. It gives the steps back by itself: a decode
worker lends only while it decodes at most ``max_running`` requests, one lent batch at a time, each of at most
``max_tokens`` prompt tokens, so the requests decoding there lose at most one such prompt step between two of their
tokens (the guard on their time per output token). Requests still being prefilled for it elsewhere do not count:
they join it after the lent batch's prompt steps.

A burst is also spread: each batch takes at most an even share of the queued prompt tokens over the workers that may
run prompts (the prefill workers, and the decode workers within the guard), instead of the first free one taking
them all while another could have shared them.

Cores are lent too (``share_cores``): a batch that a prefill worker starts at once (it holds no other) and that
leaves nothing queued may run on the cores of the decode workers pinned beside it on its node while they hold
nothing at all (no request decoding or on its way, no lent batch). A lone prompt then prefills on every core of a 2-core host instead of one (1.5-1.7x
faster there), and the decode core is back before the prompt's own KV reaches it. While lent, that decode worker
takes no lent batch (the two would share one core and stall each other's threads).

A busy decode worker lends its cores too, to a prompt batch that needs them (``pause_decode_ms``): a long prompt on one
core of a 2-core host misses a TTFT target that it meets on both (`small`: 1,500 tokens take 1.05 s on one core,
0.53 s on two). When the batch starts at once and leaves nothing queued, its forward on its own cores would end past
its most urgent TTFT deadline, on the widened cores would not, and would pause the decodes for at most
``pause_decode_ms``, the decode workers beside it stop stepping for that forward pass (``worker/core_gate.py``). Each
request decoding there waits that long once between two of its tokens; the TPOT targets stay the guard: the pauses a
request takes over its life may use at most half of its TPOT slack (``pause_fits_tpot``).

A batch already queued on a prefill worker behind the one it runs may still be lent: when a decode worker frees up
and the batch's most urgent prompt would miss its TTFT target waiting there but not if it started now
(``withdraw_to_lend``), the controller takes it back from the prefill worker (only if it has not started) and plans
it again, so the lender gets it. Short prompts that came while the decode worker ran its one lent batch no longer
wait behind a long prompt for that reason.

Colocated workers of one node lend each other their cores the same way, each deciding for its own next step from
what its neighbours post (``colocated_borrow``, ``worker/neighbour_cores.py``): a step with a long prompt chunk runs
on the idle neighbours' cores too, and pauses neighbours that only decode when its most urgent prompt needs them
and their requests' TPOT allowance has room for the pause.

Pure functions over ints: no Ray, no torch, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LendingPolicy:
    enabled: bool = False
    # A decode worker decoding more requests than this keeps its steps for them. 16, not fewer: on a 2-core host
    # (one prefill, one decode worker, `small`) a guard of 4 stopped lending exactly when prompts queued, and under
    # vLLM's client (random 256 +- 90% tokens, Poisson) the cluster held 80% of TTFT <= 450 / TPOT <= 50 ms up to
    # 8.5 req/s; with 16, >= 10 req/s (TPOT p50 16 against 14.5 ms at 8 req/s), and on the bursty two-class sweep
    # 0.78 against 0.48-0.55 at 8 req/s. 64, not 16: on a faster 2-core host (Xeon with AMX) the bursty two-class
    # workload at 10 req/s keeps more than 16 requests decoding through its bursts, so a guard of 16 stopped lending
    # just when prompts queued; four alternating runs (seeds 0 and 1, twice) held 0.78-0.84 of the SLOs with 64
    # against 0.55-0.66 with 16, the lent prompt steps leaving TPOT within its target.
    max_running: int = 64
    # Prompt tokens of one lent batch: the longest prompt step the requests decoding there may have to wait for.
    max_tokens: int = 512
    # A prefill batch may run on the cores of idle decode workers of its node (the launcher names them).
    share_cores: bool = True
    # A prompt batch that would miss its TTFT deadline on its own cores may pause busy decode workers beside it for
    # at most this long (its estimated forward on the widened cores) to run on their cores too; 0: only idle ones
    # lend their cores.
    pause_decode_ms: int = 800

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"LendingPolicy.enabled must be a bool, got {self.enabled!r}")
        if (
            not isinstance(self.max_running, int)
            or isinstance(self.max_running, bool)
            or self.max_running < 0
        ):
            raise ValueError(f"LendingPolicy.max_running must be an int >= 0, got {self.max_running!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"LendingPolicy.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.share_cores, bool):
            raise ValueError(f"LendingPolicy.share_cores must be a bool, got {self.share_cores!r}")
        if (
            not isinstance(self.pause_decode_ms, int)
            or isinstance(self.pause_decode_ms, bool)
            or self.pause_decode_ms < 0
        ):
            raise ValueError(
                f"LendingPolicy.pause_decode_ms must be an int >= 0, got {self.pause_decode_ms!r}"
            )

    def can_lend(self, decoding: int, lent_batches: int) -> bool:
        """A decode worker decoding ``decoding`` requests and running ``lent_batches`` prompt batches may take one
        more."""
        return self.enabled and lent_batches == 0 and decoding <= self.max_running


def lend_instead(prefill_queue_lens: list[int], lenders: int, first_prompt: int, max_tokens: int) -> bool:
    """Whether the next batch goes to a lending decode worker rather than a prefill worker with room: when every
    prefill worker already holds a batch (the prompt would wait behind it), a decode worker may lend, and the
    batch's first prompt (``first_prompt`` tokens, the head of the queue's order) fits a lent batch; a longer one
    waits for a prefill worker rather than stall the decodes, while short prompts queued behind other long ones
    still go to the lender, in a batch of at most ``max_tokens``."""
    busy = not prefill_queue_lens or min(prefill_queue_lens) > 0
    return lenders > 0 and busy and first_prompt <= max_tokens


def withdraw_to_lend(
    batch_tokens: int, batch_s: float, running_left_s: float, slack_s: float, max_tokens: int
) -> bool:
    """Whether a batch queued on a prefill worker behind the batch it runs should be taken back and lent to a
    decode worker that has just freed up: it fits a lent batch (``batch_tokens`` <= ``max_tokens``), and its most
    urgent prompt (TTFT deadline ``slack_s`` from now) would miss its target behind the running batch
    (``running_left_s`` more, then ``batch_s`` of its own) and make it if it started now. Unknown times (0) never
    withdraw anything."""
    if not (0 < batch_tokens <= max_tokens) or not (batch_s > 0 and running_left_s > 0):
        return False
    return running_left_s + batch_s > slack_s >= batch_s


def batch_token_budget(queued_prompt_tokens: int, longest_prompt: int, runners: int, cap: int) -> int:
    """The prompt-token budget of the next batch: an even share of the queued prompt tokens over the ``runners``
    (the workers that may run prompts, so a burst runs on all of them, not in one batch on one), never below the
    longest queued prompt (it must fit one batch) nor above ``cap`` (the step budget)."""
    if runners <= 1 or queued_prompt_tokens <= 0:
        return cap
    share = -(-queued_prompt_tokens // runners)
    return min(cap, max(share, longest_prompt))


# A forward on n equal workers' cores runs this share of n times as fast as on one's: two threads on two cores ran
# `small`'s prefill 1.82-1.89x as fast as one (256-1,920 tokens, a 2-core EPYC).
WIDENED_EFFICIENCY = 0.9


def widened_s(forward_alone_s: float, own: int, borrowed: int) -> float:
    """The forward pass's estimated seconds on ``own`` plus ``borrowed`` workers' cores (workers of equal size), from
    its seconds on ``own`` alone."""
    if borrowed < 1:
        return forward_alone_s
    return forward_alone_s * own / (WIDENED_EFFICIENCY * (own + borrowed))


def pause_decode_for(
    forward_alone_s: float, slack_s: float, own: int, borrowed: int, max_pause_s: float
) -> bool:
    """Whether a prompt batch may pause ``borrowed`` busy decode workers to run on their cores besides its ``own``:
    on its own cores (``forward_alone_s``) it would end past its most urgent TTFT deadline (``slack_s`` from now),
    on the widened cores it would not, and the pause (that widened forward) is at most ``max_pause_s``. A batch
    without a target (infinite slack), an unknown pace (``forward_alone_s`` 0) or no limit never pauses anyone."""
    if borrowed < 1 or own < 1 or not max_pause_s > 0 or not forward_alone_s > 0:
        return False
    widened = widened_s(forward_alone_s, own, borrowed)
    return forward_alone_s > slack_s and widened <= min(slack_s, max_pause_s)


def pause_fits_tpot(pause_s: float, decoding: list[tuple[float, float | None, int]], step_s: float) -> bool:
    """Whether every request decoding on a worker can take one more pause of ``pause_s``: each is (seconds it has
    been paused already, its TPOT target in seconds or None for none, its most output tokens). Over its life a
    request's pauses may use at most half its TPOT slack, ``(target - step_s) x (max_tokens - 1) / 2``, where
    ``step_s`` is the worker's decode step (0 when unknown); the other half is left to the load."""
    for paused, tpot_s, max_tokens in decoding:
        if tpot_s is None:
            continue
        if paused + pause_s > 0.5 * max(0.0, tpot_s - step_s) * max(1, max_tokens - 1):
            return False
    return True


@dataclass(frozen=True)
class Neighbour:
    """A colocated worker beside the one about to step, as its post says (``worker/core_board.py``)."""

    prompt_tokens: int  # prompt tokens it has yet to compute
    decoding: int  # requests it decodes
    pause_room_s: float  # how long its decodes can wait from now (inf: no TPOT target)


def colocated_borrow(
    prompt_tokens: int,
    step_alone_s: float,
    remaining_alone_s: float,
    slack_s: float,
    own: int,
    neighbours: list[Neighbour],
    max_pause_s: float,
    min_tokens: int,
) -> list[int]:
    """Which neighbours' cores a colocated worker's next step runs on besides its ``own`` (indices into
    ``neighbours``). A step with at least ``min_tokens`` prompt tokens borrows every idle neighbour (nothing to
    compute, nothing decoding). It also pauses the neighbours that only decode when its most urgent prompt needs
    them: the rest of that prompt's forward (``remaining_alone_s`` on the worker's own cores) would end past its
    TTFT deadline (``slack_s`` from now) on the cores it has so far and on the widened cores would not, and this
    step on the widened cores (``step_alone_s`` on its own) pauses them for at most ``max_pause_s`` and within each
    one's room. Unknown times (0) pause nobody. A neighbour with prompt work of its own is never borrowed: it needs
    its cores for that."""
    if prompt_tokens < min_tokens or own < 1:
        return []
    chosen = [i for i, n in enumerate(neighbours) if n.prompt_tokens == 0 and n.decoding == 0]
    busy = [i for i, n in enumerate(neighbours) if n.prompt_tokens == 0 and n.decoding > 0]
    if not busy or not max_pause_s > 0 or not (step_alone_s > 0 and remaining_alone_s > 0):
        return chosen
    if widened_s(remaining_alone_s, own, len(chosen)) <= slack_s:
        return chosen  # on time without pausing anyone
    every = len(chosen) + len(busy)
    if widened_s(remaining_alone_s, own, every) > slack_s:
        return chosen  # late even so: not worth the decodes' time
    pause = widened_s(step_alone_s, own, every)
    if pause > max_pause_s or any(neighbours[i].pause_room_s < pause for i in busy):
        return chosen
    return sorted(chosen + busy)
