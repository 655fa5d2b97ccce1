"""One contract for every device backend present on this machine (CPU always; CUDA, HPU where found)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.device import device_class, device_names, get_device


def _present() -> list[str]:
    names = []
    for name in device_names():
        try:
            if device_class(name).is_available():
                names.append(name)
        except ImportError:
            pass
    return names


@pytest.mark.parametrize("name", _present())
def test_device_contract(name: str) -> None:
    dev = get_device(name)
    free, total = dev.mem_get_info()
    assert 0 < free <= total
    assert dev.dist_backend in ("gloo", "nccl", "hccl")
    x = torch.ones(4, device=dev.torch_device)
    dev.synchronize()
    dev.mark_step()
    assert float(x.sum()) == 4.0
    static = {"a": torch.ones(3, device=dev.torch_device)}
    replay = dev.capture_graph(lambda a: a * 2, static)
    assert (replay is not None) == dev.supports_graphs
    if replay is not None:
        static["a"].fill_(3.0)
        assert replay().tolist() == [6.0, 6.0, 6.0]
    # A copy to the host that does not wait for the queued work: valid once wait() returns, and it is the
    # value the queued work produced (a large product queued first, so an early read would see stale data).
    big = torch.randn(512, 512, device=dev.torch_device)
    product = (big @ big).sum(0)[:8]
    host, wait = dev.to_host_async(product)
    wait()
    assert host.device.type == "cpu" and torch.equal(host, product.cpu())


def test_auto_picks_a_present_device_and_absent_ones_fail_clearly() -> None:
    assert get_device("auto").name in _present()
    if importlib.util.find_spec("habana_frameworks") is None:
        with pytest.raises(RuntimeError, match="not installed"):
            get_device("hpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="not available"):
            get_device("cuda")
    with pytest.raises(ValueError, match="unknown"):
        device_class("tpu")
