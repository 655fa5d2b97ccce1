"""The workers' per-gateway output buffers: drained with acknowledgement, and forgotten once their gateway stops
draining (it crashed or was redeployed), so a worker does not buffer for it for ever."""

from __future__ import annotations

import threading
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


def test_a_hand_over_returns_once_the_waiting_drain_took_the_outputs():
    b = OutputBuffers()
    took: list[tuple[float, list[RequestOutput]]] = []

    def gateway() -> None:
        _, got = b.drain("gw", 5.0)
        time.sleep(0.05)  # the drain has the outputs; a hand-over must not wait for the rest of its call
        took.append((time.monotonic(), got))

    t = threading.Thread(target=gateway)
    t.start()
    deadline = time.monotonic() + 5
    while not b.parked("gw"):  # the drain call is waiting
        assert time.monotonic() < deadline
        time.sleep(0.001)
    b.put_many([("gw", out("a", 0))], hand_over_s=5.0)
    returned = time.monotonic()
    assert b.parked("gw") == 0, "put_many returned before the waiting drain took the outputs"
    t.join()
    assert [o.new_token_ids for o in took[0][1]] == [[0]]
    assert returned < took[0][0], "the hand-over waited for more than the take"
    # Nobody waiting: nothing to hand over to, so no wait, however long the hand-over may be.
    t0 = time.monotonic()
    b.put_many([("gw", out("a", 1))], hand_over_s=5.0)
    assert time.monotonic() - t0 < 1.0
    _, got = b.drain("gw", 0.0)
    assert [o.new_token_ids for o in got] == [[0], [1]]  # not acknowledged yet: the first comes again


def test_a_hand_over_waits_for_no_other_gateway():
    b = OutputBuffers()
    t = threading.Thread(target=b.drain, args=("other", 1.0))
    t.start()
    deadline = time.monotonic() + 5
    while not b.parked("other"):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    t0 = time.monotonic()
    b.put_many([("gw", out("a", 0))], hand_over_s=5.0)  # "gw" has no drain waiting; "other" gets nothing
    assert time.monotonic() - t0 < 0.5
    t.join()
