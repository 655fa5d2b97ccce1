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
    # The flat runner's per-device choices: a K/V writer that writes what two index_copy_ write, a greedy split
    # that divides the vocabulary (or 1) and picks what argmax picks, and inductor options as a dict.
    from engine.attention import write_slots
    from engine.sampler import greedy_tokens

    kv = torch.randn(2, 2, 5, 4, 2, 8, device=dev.torch_device)  # [L, 2, NB + 1, BS, KVH, D]
    slots = torch.tensor([3, 17, 9], device=dev.torch_device)
    k, v = torch.randn(2, 3, 2, 8, device=dev.torch_device)
    want, got = kv.clone(), kv.clone()
    write_slots(want, 1, slots, k, v)
    dev.kv_writer()(got, 1, slots, k, v)
    assert torch.equal(got, want)
    for vocab in (1000, 128256):
        splits = dev.greedy_splits(vocab)
        assert splits >= 1 and vocab % splits == 0
        logits = torch.randn(3, vocab, device=dev.torch_device)
        assert torch.equal(greedy_tokens(logits, splits), logits.argmax(-1))
    assert isinstance(dev.compile_options(), dict)
    # Rotary and K/V writes in one kernel: a count of the layers that took it, each of them marked.
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION
    from engine.fused_rope_write import is_rope_write

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2
    )
    model = LlamaForCausalLM(LlamaConfig(**sizes, num_hidden_layers=2)).to(dev.torch_device).eval()
    dev.fuse_projections(model)
    model.set_attn_implementation(FLAT_ATTN_IMPLEMENTATION)
    layers = dev.fuse_rope_writes(model)
    assert 0 <= layers <= 2 and layers == sum(is_rope_write(m) for m in model.modules())


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
