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
