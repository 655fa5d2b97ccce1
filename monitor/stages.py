"""Where a request's time to first token goes: the marks the processes stamp on it, and the stages between them.

Each process a request passes through stamps the moment it did its part (Unix seconds, ``time.time()``); the
marks ride on the request's outputs back to the gateway, which turns them into stage durations when the request
ends and records them with the request (``RequestRecord.stages``). Pure functions over floats: no clock is read
here.

The time to first token is a chain of marks, and its stages sum to it exactly:

    received -> submitted -> dispatched -> forward_start -> forward_end -> first_token
      admission   controller_queue   prefill_queue   prefill_forward   first_token_out

A stage ends at its mark and begins at the last earlier mark the request has: colocated mode has no controller,
so its ``prefill_queue`` runs from ``submitted``. In disaggregated mode the first token comes from the prefill
worker, so the hand-off to the decode worker is not on this path; it is on the way to the second token:

    forward_end -> kv_received -> decode_first
         kv_transfer      decode_join

``kv_transfer`` is the part of the KV transfer that the forward pass did not hide (layers stream while it
runs), plus the wait for the decode loop to pick the KV up; ``decode_join`` is the decode worker's first step
with the request in it. ``overhead`` is the time to first token less the prefill forward: everything the
serving path adds to the model's own work.

Marks from different processes compare only where their clocks agree: on one host they do; across hosts the
hops between processes carry the clocks' offset (a stage that comes out negative is counted as 0).
"""

from __future__ import annotations

from collections.abc import Mapping

# Marks, in the order a request passes them.
RECEIVED = "received"  # gateway: the HTTP request came in
SUBMITTED = (
    "submitted"  # gateway: parsed, tokenized and admitted; sent to the controller (or colocated worker)
)
DISPATCHED = "dispatched"  # controller: planned into a prefill batch and sent to that prefill worker
FORWARD_START = "forward_start"  # worker: the forward pass that samples the request's first token began
FORWARD_END = "forward_end"  # worker: that forward pass ended (the first token is sampled)
FIRST_TOKEN = "first_token"  # gateway: the first token is in hand, on its way to the client
KV_RECEIVED = "kv_received"  # decode worker: the request's KV has landed and its loop took it
DECODE_FIRST = "decode_first"  # decode worker: its first decode step with the request ended

MARKS = (RECEIVED, SUBMITTED, DISPATCHED, FORWARD_START, FORWARD_END, FIRST_TOKEN, KV_RECEIVED, DECODE_FIRST)

# The time to first token: (stage, the mark that ends it), in order.
TTFT_STAGES: tuple[tuple[str, str], ...] = (
    ("admission", SUBMITTED),
    ("controller_queue", DISPATCHED),
    ("prefill_queue", FORWARD_START),
    ("prefill_forward", FORWARD_END),
    ("first_token_out", FIRST_TOKEN),
)
# After the first token, in disaggregated mode: (stage, from mark, to mark).
HANDOFF_STAGES: tuple[tuple[str, str, str], ...] = (
    ("kv_transfer", FORWARD_END, KV_RECEIVED),
    ("decode_join", KV_RECEIVED, DECODE_FIRST),
)
OVERHEAD = "overhead"

STAGES: tuple[str, ...] = (
    *(name for name, _ in TTFT_STAGES),
    *(name for name, _, _ in HANDOFF_STAGES),
    OVERHEAD,
)


def stage_seconds(marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds per stage from a request's marks; empty when the worker stamped no forward pass (a backend that
    does not report its stages), so no stage is ever named for time it did not measure."""
    if RECEIVED not in marks or FORWARD_START not in marks or FORWARD_END not in marks:
        return {}
    out: dict[str, float] = {}
    last = marks[RECEIVED]
    for name, mark in TTFT_STAGES:
        t = marks.get(mark)
        if t is None:
            continue
        out[name] = max(0.0, t - last)
        last = max(last, t)
    for name, start, end in HANDOFF_STAGES:
        if start in marks and end in marks:
            out[name] = max(0.0, marks[end] - marks[start])
    if FIRST_TOKEN in marks:
        ttft = max(0.0, marks[FIRST_TOKEN] - marks[RECEIVED])
        out[OVERHEAD] = max(0.0, ttft - out["prefill_forward"])
    return out
