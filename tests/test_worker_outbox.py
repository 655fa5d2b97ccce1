"""The workers' per-gateway output buffers: drained with acknowledgement, and forgotten once their gateway stops
draining (it crashed or was redeployed), so a worker does not buffer for it for ever."""

from __future__ import annotations

import time

from engine.request import RequestOutput
from worker.outbox import OutputBuffers


def out(rid: str, n: int) -> RequestOutput:
    return RequestOutput(rid, [n], [0.0], False, None, 3, n + 1)


def test_unacknowledged_outputs_come_again_until_acknowledged():
    b = OutputBuffers()
    b.put("gw", [out("a", 0)])
    seq, got = b.drain("gw", 0.0)
    assert [o.new_token_ids for o in got] == [[0]]
    b.put("gw", [out("a", 1)])
    again, got = b.drain("gw", 0.0, ack=-1)  # the first answer was lost: it comes with the new one
    assert [o.new_token_ids for o in got] == [[0], [1]]
    _, got = b.drain("gw", 0.0, ack=again)
    assert got == []


def test_a_consumer_that_stops_draining_is_forgotten_and_one_that_drains_is_kept():
    b = OutputBuffers(consumer_ttl_s=0.3)
    b.put_many([("gone", out("x", 0)), ("live", out("y", 0))])
    deadline = time.monotonic() + 5
    while "gone" in b.consumers():
        assert time.monotonic() < deadline, "the silent consumer was never dropped"
        b.drain("live", 0.05)  # the live gateway keeps polling
        b.put_many([("gone", out("x", 1)), ("live", out("y", 1))])
    assert b.consumers() == ["live"]
    _, got = b.drain("live", 0.0)
    assert got and all(o.request_id == "y" for o in got)
