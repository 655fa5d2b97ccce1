"""The direct walk through the decoder layers (engine/decoder_stack.py): the flat eager CPU engine runs it, other
engines do not; it computes what the model's own forward computes, bit for bit (fp32 greedy tokens against Hugging
Face in test_engine_greedy.py run through it; here its hidden states against the model's, and bf16 tokens
against the engine without it); it reports every layer's write to a streaming hook; a model whose layers compute
anything else, or whose attention kept its own forward, keeps its forward. Where every part runs our kernels the
walk is in C++ (``bucketserve_cpu::decoder_layers``), returning what the Python walk returns, bit for bit, on
skinny and oneDNN rows; a step with a streaming hook, or a model with a part on another forward, walks in Python."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy_tokens, needs_bf16_prepack, random_prompts, small_config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

import engine.llm_engine as llm_engine
from engine import linear_prepack
from engine.decoder_stack import _layers, _make_forward, decoder_stack
from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION
from engine.forward_context import forward_context
from engine.fused_attention import fuse_attention_layers
from engine.kernels import build, cpu_paged_attention
from engine.linear_prepack import prepack_linears, skinny_max_rows
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model
from engine.request import Request, SamplingParams
from engine.skinny_rows import DEFAULT_ROWS


@pytest.fixture(scope="module")
def kernels():
    assert build.load_rotary() is not None, "the rotary kernel did not build"
    assert build.load() is not None, "the paged attention kernel did not build"


def _fused_model(odd_layer: type | None = None, odd_attention: type | None = None) -> torch.nn.Module:
    """The tiny model as the flat eager CPU engine prepares it, with layer 1 (or its attention) of another class."""
    model = load_model("tiny", torch.device("cpu"), "float32").model
    model.set_attn_implementation(FLAT_ATTN_IMPLEMENTATION)
    prepack_linears(model)
    if odd_layer is not None:
        model.model.layers[1].__class__ = odd_layer
    if odd_attention is not None:
        model.model.layers[1].self_attn.__class__ = odd_attention
    fuse_attention_layers(model, cpu_paged_attention(), torch.float32)
    return model


def _decoding_and_fresh(
    engine: LLMEngine, lengths: list[int], fresh_len: int
) -> tuple[list[Request], Request]:
    """Prompts of ``lengths`` prefilled and ready to decode, and a fresh prompt of ``fresh_len`` with its blocks."""
    first = [Request(f"p{i}", p, SamplingParams(max_tokens=8)) for i, p in enumerate(random_prompts(lengths))]
    engine.allocate_prompts(first)
    engine.runner.prefill(first)
    for r in first:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(5)
    fresh = Request("f", random_prompts([fresh_len], seed=1)[0], SamplingParams(max_tokens=4))
    engine.allocate_prompts([fresh])
    return first, fresh


def test_the_flat_eager_engine_runs_the_stack(kernels) -> None:
    assert LLMEngine(small_config(shape_policy="flat")).runner._stack is not None


def test_the_flat_eager_engine_walks_the_layers_in_cpp(kernels) -> None:
    assert build.load_decoder_stack() is not None, "the decoder stack kernel did not build"
    assert LLMEngine(small_config(shape_policy="flat")).runner._stack.native


def test_a_mixed_step_walked_in_cpp_equals_the_python_walk_and_the_models_forward(
    kernels, monkeypatch
) -> None:
    # The fresh prompt below outgrows the row limit so that its linears run on oneDNN. Where the host's limit is
    # longer than the model's context (fp32 on an AMD Zen 2: 4096), the engine is built under the default one.
    if skinny_max_rows(torch.float32) > DEFAULT_ROWS:
        monkeypatch.setattr(linear_prepack, "skinny_max_rows", lambda dtype: DEFAULT_ROWS)
    engine = LLMEngine(small_config(shape_policy="flat"))
    runner = engine.runner
    assert runner._stack.native
    body = runner.model.model
    python_walk = _make_forward(body, _layers(body))
    assert not python_walk.native
    # Two decodes (skinny rows), then with a fresh prompt long enough that the linears run on oneDNN.
    fresh_len = linear_prepack.skinny_max_rows(torch.float32) + 6
    assert runner.model.model.layers[0].self_attn.o_proj.skinny_max_rows == fresh_len - 6
    first, fresh = _decoding_and_fresh(engine, [9, 23], fresh_len)
    for items in ([(r, 1) for r in first], [(first[0], 1), (fresh, fresh_len), (first[1], 1)]):
        batch = runner.prepare(items)
        with torch.inference_mode(), forward_context(batch.ctx):
            native = runner._stack(batch.input_ids, batch.positions)
            python = python_walk(batch.input_ids, batch.positions)
            model = body(input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False)
        assert native.shape == (sum(n for _, n in items), runner.model.config.hidden_size)
        assert torch.equal(native, python)
        assert torch.equal(native, model.last_hidden_state[0])


def test_a_model_with_a_part_on_another_forward_walks_in_python(kernels) -> None:
    # The norms and MLPs of this model keep transformers' forwards: the C++ walk would not call what they do.
    stack = decoder_stack(_fused_model(), cpu_paged_attention())
    assert stack is not None and not stack.native


def test_without_our_attention_operator_the_walk_is_in_python(kernels) -> None:
    engine = LLMEngine(small_config(shape_policy="flat"))
    body = engine.runner.model.model
    assert _make_forward(body, _layers(body), cpu_paged_attention()).native
    assert not _make_forward(body, _layers(body), lambda *args: None).native


def test_a_compiled_engine_runs_the_models_forward(kernels) -> None:
    # (The buckets policy's runner has no stack to take.)
    assert LLMEngine(small_config(shape_policy="flat", compile=True)).runner._stack is None


def test_a_mixed_step_through_the_stack_equals_the_models_forward_and_reports_every_layer(kernels) -> None:
    engine = LLMEngine(small_config(shape_policy="flat"))
    runner = engine.runner
    # Two prompts prefilled, then a step of one decode and a fresh 30-token prompt.
    first, fresh = _decoding_and_fresh(engine, [7, 19], 30)
    batch = runner.prepare([(first[0], 1), (fresh, 30)])
    written: list[int] = []
    batch.ctx.on_layer_written = written.append
    with torch.inference_mode(), forward_context(batch.ctx):
        got = runner._stack(batch.input_ids, batch.positions)
        want = runner.model.model(
            input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False
        ).last_hidden_state[0]
    assert got.shape == (31, runner.model.config.hidden_size)
    assert torch.equal(got, want)
    layers = runner.model.config.num_hidden_layers
    assert written == list(range(layers)) * 2  # the stack's pass, then the model's


@needs_bf16_prepack
def test_in_bf16_the_engine_generates_what_it_does_without_the_stack(kernels, monkeypatch) -> None:
    prompts = random_prompts([1, 5, 17, 40, 90], seed=4)
    fast = LLMEngine(small_config(shape_policy="flat", dtype="bfloat16"))
    assert fast.runner._stack is not None
    monkeypatch.setattr(llm_engine, "decoder_stack", lambda *args: None)
    plain = LLMEngine(small_config(shape_policy="flat", dtype="bfloat16"))
    assert plain.runner._stack is None
    assert greedy_tokens(fast, prompts, 12) == greedy_tokens(plain, prompts, 12)


class _ScaledLayer(LlamaDecoderLayer):
    """A decoder layer with the same parts that computes something else with them."""

    def forward(self, hidden_states, *args, **kwargs):
        return 0.5 * super().forward(hidden_states, *args, **kwargs)


class _DoubledAttention(LlamaAttention):
    """An attention the fuser leaves alone (its output is not Llama's)."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 2 * out, weights


def test_the_fused_tiny_model_gets_a_stack(kernels) -> None:
    assert decoder_stack(_fused_model(), cpu_paged_attention()) is not None


@pytest.mark.parametrize(
    "odd", [dict(odd_layer=_ScaledLayer), dict(odd_attention=_DoubledAttention)], ids=["layer", "attention"]
)
def test_a_model_that_computes_something_else_keeps_its_forward(kernels, odd) -> None:
    assert decoder_stack(_fused_model(**odd), cpu_paged_attention()) is None


@pytest.mark.parametrize("part", ["stack", "native-stack"])
def test_the_paired_benchmark_times_the_stack_against_the_models_forward(
    kernels, tmp_path, capsys, part
) -> None:
    import json

    from gateway.cli import main

    out = tmp_path / "stack"
    args = [
        "bench",
        "fused-attention",
        "--part",
        part,
        "--model",
        "tiny",
        "--skip-warmup",
        "--batches",
        "2",
    ]
    assert main(args + ["--context", "20", "--steps", "4", "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["part"] == part
    [row] = result["rows"]
    assert row["batch"] == 2 and row["identical_tokens"] and row["fused_ms"] > 0 and row["unfused_ms"] > 0
    assert "Decoder stack" in (tmp_path / "stack.md").read_text()
