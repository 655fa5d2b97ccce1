"""The controller's planning core on its own: queue, block ledgers, dispatches, and how requests leave it.
Pure Python: no Ray, no model, no clock."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bucket_manager.dispatcher import Dispatcher, DispatcherConfig
from bucket_manager.memory_budget import blocks_for
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.shape_buckets import ShapeBucketConfig

BS, MAX_LEN = 16, 2048


def config(**kw) -> DispatcherConfig:
    shapes = ShapeBucketConfig.from_serving(
        block_size=BS, max_model_len=MAX_LEN, max_num_prefill_seqs=4, max_num_batched_tokens=2048
    )
    fields = {
        "block_size": BS,
        "max_model_len": MAX_LEN,
        "max_num_batched_tokens": 2048,
        "shape_config": shapes,
    }
    return DispatcherConfig(**(fields | kw))


def dispatcher(prefill: int = 1, decode: int = 1, blocks: int = 10_000, **kw) -> Dispatcher:
    d = Dispatcher(config(**kw))
    d.set_workers({f"p{i}": blocks for i in range(prefill)}, {f"d{i}": blocks for i in range(decode)})
    return d


def req(i: int, prompt: int = 100, out: int = 20, **kw) -> RequestSummary:
    return RequestSummary(f"r{i}", prompt, out, arrival=kw.pop("arrival", float(i)), **kw)


def test_a_dispatch_reserves_prompt_blocks_on_prefill_and_prompt_plus_output_on_decode() -> None:
    d = dispatcher()
    d.submit(req(0, prompt=100, out=2000), "payload-0")
    [batch] = d.plan(now=1.0)
    assert (batch.batch_id, batch.prefill_id, batch.decode_id) == (1, "p0", "d0")
    assert batch.request_ids == ("r0",) and batch.payloads == ("payload-0",)
    assert d.prefill["p0"].reserved == {"r0": blocks_for(100, BS)}
    # Capped at the model's length: a request never holds more than max_model_len tokens.
    assert d.decode["d0"].reserved == {"r0": blocks_for(MAX_LEN, BS)}
    assert d.prefill["p0"].outstanding == {1: ("r0",)}
    assert d.placement == {"r0": ("p0", "d0")}
    assert len(d.queue) == 0 and d.plan(now=2.0) == []


def test_batch_done_frees_the_prompt_blocks_and_forget_the_decode_blocks() -> None:
    d = dispatcher()
    d.submit(req(0))
    [batch] = d.plan(0.0)
    d.forget("r0")  # finished before its batch left the prefill worker: the prompt blocks are still in use
    assert d.decode["d0"].reserved == {} and "r0" not in d
    assert d.prefill["p0"].reserved == {"r0": blocks_for(100, BS)}
    d.batch_done("p0", batch.batch_id)
    assert d.prefill["p0"].reserved == {} and d.prefill["p0"].outstanding == {}
    d.batch_done("p9", 99)  # unknown worker or batch: nothing happens


def test_prefill_workers_report_their_pace_and_late_requests_go_last() -> None:
    d = dispatcher()
    assert d.pace.seconds_per_token == 0.0 and d.state()["prefill_s_per_token"] == 0.0
    d.submit(req(0, prompt=500))
    [batch] = d.plan(0.0)
    d.batch_done("p0", batch.batch_id, forward_s=0.5)  # 500 tokens in 0.5 s
    assert d.pace.seconds_per_token == pytest.approx(0.001)
    assert d.state()["prefill_s_per_token"] == pytest.approx(0.001)
    d.batch_done("p0", batch.batch_id, forward_s=9.0)  # reported twice: counted once
    assert d.pace.seconds_per_token == pytest.approx(0.001)
    # With that pace, a 400-token prompt due in 0.3 s can no longer make it; a 50-token one queued after it can.
    d.submit(req(1, prompt=400, arrival=0.9, ttft_slo_ms=400))
    d.submit(req(2, prompt=50, arrival=0.95, ttft_slo_ms=400))
    first, *rest = d.plan(1.0)
    assert first.request_ids[0] == "r2"
    # The FCFS baseline serves by arrival whatever the deadlines.
    f = dispatcher(scheduling="fcfs")
    f.pace.observe(500, 0.5)
    f.submit(req(1, prompt=400, arrival=0.9, ttft_slo_ms=400))
    f.submit(req(2, prompt=50, arrival=0.95, ttft_slo_ms=400))
    assert f.plan(1.0)[0].request_ids[0] == "r1"


def test_a_prefill_worker_holds_at_most_its_batch_limit() -> None:
    d = dispatcher(max_batches_per_prefill_worker=2, policy=PriorityPolicy(online_order="arrival"))
    # Prompts of very different lengths never share a batch (no common warmed shape).
    for i, n in enumerate([10, 1500, 300]):
        d.submit(req(i, prompt=n))
    first = d.plan(0.0)
    assert len(first) == 2 and len(d.queue) == 1
    d.batch_done("p0", first[0].batch_id)
    [third] = d.plan(0.0)
    assert third.batch_id == 3


def test_workers_are_chosen_by_queue_and_free_blocks_and_reports_cap_the_ledger() -> None:
    d = dispatcher(prefill=2, decode=2, blocks=1000)
    d.submit(req(0, prompt=10))
    d.submit(req(1, prompt=1500))
    a, b = d.plan(0.0)
    assert {a.prefill_id, b.prefill_id} == {"p0", "p1"}  # shortest queue first
    assert a.decode_id != b.decode_id  # the second goes where more blocks are free
    # The monitor sees fewer free blocks than the ledger (another tenant, a lagging release): it wins.
    d.update_stats({"d0": 0, "d1": 0}, down=())
    d.submit(req(2))
    assert d.plan(0.0) == []
    d.update_stats({}, down={"d0", "d1"})
    assert d.plan(0.0) == []  # no usable decode worker
    d.update_stats({}, down=())
    [c] = d.plan(0.0)
    assert c.request_ids == ("r2",)


def test_requeue_plans_again_then_gives_up() -> None:
    d = dispatcher(max_attempts=2)
    d.submit(req(0))
    d.plan(0.0)
    assert d.requeue("r0") is True
    assert "r0" in d.queue and d.decode["d0"].reserved == {} and "r0" not in d.placement
    d.plan(0.0)
    assert d.requeue("r0") is False  # second failed attempt of two: forgotten
    assert "r0" not in d and len(d.queue) == 0
    assert d.requeue("r0") is False and d.requeue("unknown") is False


def test_a_refusal_as_full_holds_that_decode_worker_and_costs_no_attempt() -> None:
    d = dispatcher(max_attempts=2, full_hold_s=0.5)
    d.submit(req(0))
    [batch] = d.plan(0.0)
    for t in (1.0, 2.0, 3.0):  # refused as full again and again: back-pressure, never given up for it
        assert d.requeue("r0", full_on="d0", now=t) is True
        d.batch_done("p0", batch.batch_id)
        assert d.plan(t + 0.4) == []  # d0 is held, and it is the only decode worker
        [batch] = d.plan(t + 0.5)
        assert batch.request_ids == ("r0",) and batch.decode_id == "d0"
    assert d.attempts["r0"] == 0
    assert d.requeue("r0") is True and d.attempts["r0"] == 1  # a failure (not full) still counts


def test_a_held_decode_worker_leaves_the_requests_to_the_others() -> None:
    d = dispatcher(decode=2, full_hold_s=0.5)
    d.submit(req(0))
    [first] = d.plan(0.0)
    d.requeue("r0", full_on=first.decode_id, now=0.0)
    [second] = d.plan(0.1)
    assert second.decode_id != first.decode_id


def test_worker_loss_strands_its_requests_and_everything_once_a_pool_is_empty() -> None:
    d = dispatcher(prefill=2, decode=2)
    for i, n in enumerate([10, 1500]):
        d.submit(req(i, prompt=n))
    a, b = d.plan(0.0)
    assert d.mark_down(b.decode_id) is True and d.mark_down(b.decode_id) is False
    on_decode, in_batches = d.stranded_by(b.decode_id)
    assert on_decode == list(b.request_ids) and in_batches == []
    assert d.give_up(on_decode) == list(b.request_ids)
    d.mark_down(a.prefill_id)
    on_decode, in_batches = d.stranded_by(a.prefill_id)
    assert on_decode == [] and in_batches == list(a.request_ids)
    assert d.prefill[a.prefill_id].outstanding == {} and d.prefill[a.prefill_id].reserved == {}
    d.submit(req(5))
    d.mark_down(a.decode_id)  # no decode worker left: every request still in the cluster is lost
    assert sorted(d.give_up(in_batches)) == ["r0", "r5"]
    assert d.state()["in_cluster"] == 0 and d.state()["queued"] == 0


def test_fcfs_queues_every_request_as_online_priority_zero_but_keeps_its_summary() -> None:
    d = dispatcher(scheduling="fcfs", max_batches_per_prefill_worker=64)
    late_urgent = req(1, prompt=10, priority=-5, priority_class=PriorityClass.ONLINE)
    early_offline = req(0, prompt=1500, priority_class=PriorityClass.OFFLINE)
    d.submit(late_urgent)
    d.submit(early_offline)
    assert d.queue.get("r0").priority_class is PriorityClass.ONLINE
    assert d.summaries["r0"].priority_class is PriorityClass.OFFLINE
    order = [rid for b in d.plan(10.0) for rid in b.request_ids]
    assert order == ["r0", "r1"]  # arrival order
    assert d.max_request_buckets == 1 and d.bucket_splits == 0


def test_buckets_split_under_load_and_the_listener_hears_each_round() -> None:
    seen = []
    d = Dispatcher(config(), on_buckets=lambda q: seen.append(q.num_buckets))
    d.set_workers({"p0": 400}, {"d0": 400})
    for i in range(200):  # most prompts below the middle cut: Algorithm 1 splits the single bucket
        d.submit(req(i, prompt=20 + 5 * i, out=200))
    d.plan(0.0)
    assert seen and d.bucket_splits > 0 and d.max_request_buckets == max(seen) > 1


def test_state_and_duplicates() -> None:
    d = dispatcher()
    d.submit(req(0))
    with pytest.raises(ValueError, match="already in the cluster"):
        d.submit(req(0))
    d.plan(0.0)
    state = d.state()
    assert state["batches"] == 1 and state["in_cluster"] == 1 and state["queued"] == 0
    assert state["prefill"] == {"p0": {"reserved": blocks_for(100, BS), "outstanding": 1, "alive": True}}
    want = {
        "reserved": blocks_for(120, BS),
        "requests": 1,
        "lent_batches": 0,
        "cores_lent": False,
        "alive": True,
    }
    assert state["decode"] == {"d0": want} and state["lent_batches"] == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("scheduling", "sjf"), ("block_size", 0), ("max_attempts", 0), ("theta", 1.0), ("shape_config", None)],
)
def test_config_is_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"DispatcherConfig.{field}"):
        config(**{field: value})


def test_the_dispatcher_is_pure() -> None:
    code = (
        "import sys, bucket_manager.dispatcher; print(sorted({'ray', 'torch', 'asyncio'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_restarted_dispatcher_adopts_what_the_workers_hold_and_frees_it_as_they_finish():
    """The ledger of a fresh dispatcher rebuilt from the workers (as a restarted controller does) reserves exactly
    what the old one had reserved for those requests, and gives every block back as they end."""
    old = dispatcher(decode=2, blocks=200)
    for i in range(6):
        old.submit(req(i, prompt=40 + i, out=30))
    batches = old.plan(now=10.0)
    assert batches
    held_batches = [
        (b.prefill_id, b.batch_id, [(old.summaries[r], f"payload-{r}", b.decode_id) for r in b.request_ids])
        for b in batches
    ]
    # The first batch has reached its decode worker (announced there); the prefill worker still holds them all.
    first = batches[0]
    decoding = {first.decode_id: {r: old.decode[first.decode_id].reserved[r] for r in first.request_ids}}

    new = dispatcher(decode=2, blocks=200)
    for pid, bid, items in held_batches:
        new.adopt_batch(pid, bid, items)
    for did, held in decoding.items():
        new.adopt_decoding(did, held)
    assert new.state()["prefill"] == old.state()["prefill"]
    assert new.state()["decode"] == old.state()["decode"]
    assert new.state()["in_cluster"] == old.state()["in_cluster"] == 6
    assert all(r in new for b in batches for r in b.request_ids)
    # A request decoding on a worker no prefill worker holds any more is adopted by placement alone.
    new.adopt_decoding("d1", {"gone-from-prefill": 5})
    assert "gone-from-prefill" in new and new.decode["d1"].reserved["gone-from-prefill"] == 5
    new.forget("gone-from-prefill")
    # New batches number after the adopted ones: a late batch_done of an old batch never ends a new one.
    new.submit(req(99, prompt=20, out=5))
    for b in batches:
        new.batch_done(b.prefill_id, b.batch_id)
    (after,) = new.plan(now=11.0)
    assert after.batch_id > max(b.batch_id for b in batches)
    new.batch_done(after.prefill_id, after.batch_id)
    for rid in [r for b in batches for r in b.request_ids] + ["r99"]:
        new.forget(rid)
    state = new.state()
    assert state["in_cluster"] == 0
    assert all(w["reserved"] == 0 and w["outstanding"] == 0 for w in state["prefill"].values()), state
    assert all(w["reserved"] == 0 for w in state["decode"].values()), state
    # Adopted requests can be given back for another prefill (their payload came with them).
    again = dispatcher(blocks=200)
    again.adopt_batch("p0", 7, [(req(1), "payload-r1", "d0")])
    assert again.requeue("r1") and again.payloads["r1"] == "payload-r1"
    (redo,) = again.plan(now=12.0)
    assert redo.payloads == ("payload-r1",) and redo.batch_id == 8
