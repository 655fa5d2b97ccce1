"""Prepacked oneDNN linears on CPU: same results as transformers' own linears at fp32 accuracy, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from engine.linear_prepack import can_prepack, prepack_linears, skinny_rows_lowered
from engine.model_loader import load_model


def test_the_cpu_build_can_prepack():
    # The engine takes this path on every CPU start; a torch build without oneDNN must fail here, not skip.
    assert can_prepack(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("length", [5, 37])  # the skinny kernel, and oneDNN (under a row limit lowered to 8)
def test_every_linear_is_packed_and_the_model_output_is_unchanged(length: int):
    plain = load_model("tiny", torch.device("cpu"), "float32").model
    packed = load_model("tiny", torch.device("cpu"), "float32").model
    for m in (plain, packed):  # transformers' own attention: only the linears differ
        m.set_attn_implementation("sdpa")
    n = prepack_linears(packed)
    assert n == sum(1 for m in packed.modules() if type(m) is torch.nn.Linear) > 0
    ids = torch.randint(10, 4000, (1, length))
    linears = [m for m in packed.modules() if type(m) is torch.nn.Linear]
    with torch.inference_mode(), skinny_rows_lowered(linears, 8):
        a = plain(input_ids=ids).logits
        b = packed(input_ids=ids).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_packed_linear_runs_inside_a_compiled_graph():
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = lin(x)
        prepack_linears(lin)
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(lin, dynamic=True)
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(x[:3]), want[:3], rtol=1e-5, atol=1e-5)
