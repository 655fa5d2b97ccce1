"""The controller's dispatch socket to a same-node prefill worker: whole frames in order, all-or-nothing writes, and
batches that hold an object reference refused (they go by Ray)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from bucket_manager.dispatch_socket import DispatchChannel, DispatchListener, encode_frame


class Received:
    def __init__(self) -> None:
        self.batches: list[tuple] = []
        self.cond = threading.Condition()

    def __call__(self, batch_id, items, dispatched_at, cores) -> None:
        with self.cond:
            self.batches.append((batch_id, items, dispatched_at, cores))
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> list[tuple]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.batches) >= n, timeout), self.batches
            return list(self.batches)


@pytest.fixture
def listener():
    got = Received()
    lis = DispatchListener(got, "test")
    yield lis, got
    lis.close()


def test_batches_arrive_whole_and_in_order(listener):
    lis, got = listener
    ch = DispatchChannel(lis.path)
    sent = []
    for i in range(50):
        # Prompts of growing size, some frames far larger than one recv.
        batch = (
            i,
            [({"request_id": f"r{i}", "tokens": list(range(i * 500))}, "decode-0")],
            1.5 + i,
            (i % 2,),
        )
        assert ch.send(encode_frame(batch))
        sent.append(batch)
    assert got.wait_for(50) == sent
    assert lis.batches == 50
    ch.close()


def test_a_batch_holding_an_object_reference_is_not_encoded(ray_session):
    ref = ray_session.put([1, 2, 3])
    assert encode_frame((1, [({"ref": ref}, "decode-0")], 0.0, ())) is None
    assert encode_frame((1, [({"tokens": [1, 2, 3]}, "decode-0")], 0.0, ())) is not None


def test_a_send_to_a_closed_worker_fails_and_closes_the_channel(listener):
    lis, got = listener
    ch = DispatchChannel(lis.path)
    assert ch.send(encode_frame((1, [], 0.0, ())))
    got.wait_for(1)
    lis.close()
    frame = encode_frame((2, [], 0.0, ()))
    deadline = time.monotonic() + 5
    # The first write after the peer closed may still land in the kernel's buffer; a later one must fail.
    while ch.send(frame):
        assert time.monotonic() < deadline, "writes to a closed worker kept succeeding"
        time.sleep(0.01)
    assert not ch.open
    assert not ch.send(frame)  # closed for good: the caller goes by Ray
    with pytest.raises(OSError):
        DispatchChannel(lis.path)  # nobody listens any more


def test_a_frame_cut_short_runs_nothing_and_the_next_connection_is_served(listener):
    lis, got = listener
    frame = encode_frame((7, [({"tokens": [1] * 1000}, "decode-0")], 0.0, ()))
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(lis.path)
    raw.sendall(frame[: len(frame) // 2])
    raw.close()
    ch = DispatchChannel(lis.path)
    assert ch.send(encode_frame((8, [], 0.0, ())))
    assert [b[0] for b in got.wait_for(1)] == [8]
    time.sleep(0.1)
    assert [b[0] for b in got.batches] == [8]
    ch.close()


def test_a_full_socket_takes_nothing_rather_than_part_of_a_frame(listener):
    lis, got = listener
    blocked = threading.Event()
    release = threading.Event()

    def slow(*args) -> None:  # the worker's reader stuck (waiting for its interpreter lock, say)
        blocked.set()
        release.wait(10)
        got(*args)

    lis._run = slow
    ch = DispatchChannel(lis.path)
    big = encode_frame((0, [({"tokens": list(range(200_000))}, "d")], 0.0, ()))
    sends = 0
    while ch.send(big):
        sends += 1
        assert sends < 1000, "the socket never filled"
    assert not ch.open
    release.set()
    # Every frame the channel reported sent is run whole; the one it refused is not (the caller sends it by Ray).
    assert len(got.wait_for(sends)) == sends
    time.sleep(0.2)
    assert len(got.batches) == sends
