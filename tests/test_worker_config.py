"""The worker config's checks and the layer-streaming rule (no model, no Ray)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from worker.config import WorkerConfig, layer_streaming


@pytest.mark.parametrize(
    ("setting", "device", "threads", "expected"),
    [
        (None, "cpu", 1, False),  # one core computes and would send: nothing to overlap
        (None, "cpu", 2, True),
        (None, "cuda", 1, True),  # the accelerator computes while the host thread sends
        (None, "hpu", 1, True),
        (True, "cpu", 1, True),  # an explicit setting wins
        (False, "cuda", 4, False),
    ],
)
def test_layer_streaming_auto_and_explicit(setting, device, threads, expected) -> None:
    assert layer_streaming(setting, device, threads) is expected


def test_stream_kv_layers_is_a_bool_or_auto() -> None:
    for ok in (True, False, None):
        assert WorkerConfig(worker_id="p", role="prefill", engine=EngineConfig(), stream_kv_layers=ok)
    with pytest.raises(ValueError, match="WorkerConfig.stream_kv_layers must be a bool or None"):
        WorkerConfig(worker_id="p", role="prefill", engine=EngineConfig(), stream_kv_layers="auto")


def test_cpu_step_tokens_replaces_the_budget_on_a_cpu_only() -> None:
    from worker.colocated import with_step_budget

    base = WorkerConfig(worker_id="c", role="colocated", engine=EngineConfig(), cpu_step_tokens=512)
    assert base.engine.scheduler.max_num_batched_tokens == 4096
    on_cpu = with_step_budget(base, "cpu")
    assert on_cpu.engine.scheduler.max_num_batched_tokens == 512
    assert on_cpu.engine.scheduler.max_model_len == base.engine.scheduler.max_model_len  # nothing else moves
    for device in ("cuda", "hpu"):  # accelerators keep the engine's budget
        assert with_step_budget(base, device) is base
    unset = WorkerConfig(worker_id="c", role="colocated", engine=EngineConfig())
    assert with_step_budget(unset, "cpu") is unset
    for bad in (0, -1, True, 1.5, "512"):
        with pytest.raises(ValueError, match="WorkerConfig.cpu_step_tokens must be an int >= 1 or None"):
            WorkerConfig(worker_id="c", role="colocated", engine=EngineConfig(), cpu_step_tokens=bad)


@pytest.mark.parametrize(("device", "expected"), [("cpu", 64), ("cuda", 16), ("hpu", 128)])
def test_block_size_defaults_per_device_and_an_explicit_one_wins(device, expected) -> None:
    from dataclasses import replace

    from engine.config import CacheConfig, block_size_for, resolve_engine_config

    cfg = EngineConfig()
    assert block_size_for(cfg, device) == expected
    assert resolve_engine_config(cfg, device, 4096).cache.block_size == expected
    pinned = replace(cfg, cache=CacheConfig(block_size=32))
    assert block_size_for(pinned, device) == 32
    assert resolve_engine_config(pinned, device, 4096).cache.block_size == 32


def test_neighbour_cores_are_core_and_worker_pairs() -> None:
    ok = WorkerConfig(
        worker_id="c", role="colocated", engine=EngineConfig(), neighbour_cores=((1, "x:colocated-1"),)
    )
    assert ok.neighbour_cores == ((1, "x:colocated-1"),)
    for bad in ((1,), ((1, ""),), ((-1, "w"),), [(1, "w")]):
        with pytest.raises(ValueError, match="WorkerConfig.neighbour_cores must be a tuple of"):
            WorkerConfig(worker_id="c", role="colocated", engine=EngineConfig(), neighbour_cores=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="WorkerConfig.pause_neighbours_ms must be an int >= 0"):
            WorkerConfig(worker_id="c", role="colocated", engine=EngineConfig(), pause_neighbours_ms=bad)
