"""An eager CPU step's walk through the decoder layers, calling each part's ``forward`` directly.

Once the attention layers, MLPs and norms run our fused forwards, what is left between the operators of an eager
decode step is Python: ``Module.__call__`` around ~70 modules a step (hook checks, transformers' output capturing
and gradient-checkpointing wrappers), keyword plumbing and the ``[1, T, hidden]`` reshapes. Measured on a
2-core AVX-512 Xeon, ``small`` (8 layers), context 512, paired decode steps with and without the stack
(``bench fused-attention --part stack``): 7.80 against 6.84 ms at batch 1, 13.41 against 12.54 at batch 8,
about 0.7-1 ms a step at every batch size (fp32 and bf16). The stack runs the same parts in the same order
(embedding, rotary table, per layer ``h += attn(norm(h))`` and ``h += mlp(norm(h))``, the final norm) on
``[T, hidden]`` rows.

It stands in for the model's own forward only where it computes exactly the same thing: the decoder layers must
be the pre-norm shape above with every attention layer fused (``engine.fused_attention``), and a probe prompt on
a scratch cache must come out of the stack bit for bit as out of the model's forward. A model built any other
way (extra norms around the MLP, a scaled embedding, its own attention forward) fails one or the other and keeps
its forward. transformers' classes are not changed: the stack only reads the model's modules.

Where every part of every layer runs one of our CPU kernels (the RMSNorm kernel, prepacked linears, the fused
gated MLP and attention, our paged attention operator), the layers are walked in C++ instead
(``bucketserve_cpu::decoder_layers``, ``engine/kernels/decoder_stack_cpu.cpp``): the same operators in the same
order, called through the dispatcher, about ten a layer at ~3 us of Python and dispatch each. Measured on a 2-core
AMD EPYC (Zen 5), ``small``, context 512, paired decode steps against the Python walk (``bench fused-attention
--part native-stack``, two runs): batch 1 3.68 / 3.99 ms against 4.31 / 4.60 (median ratio of pairs 0.87 /
0.89), batch 8 6.90 / 7.35 against 7.53 / 7.94 (0.93 / 0.92), batch 32 18.0 / 19.7 against 20.3 / 21.1 (0.90 /
0.95). A step whose layers report their writes to a streaming hook (a disaggregated prefill) keeps the Python
walk, which calls the hook; both walks must return the model's forward bit for bit on the probe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.forward_context import AttendFn, current_context, forward_context
from engine.fused_attention import fused_attention_rows, is_fused, probe_context
from engine.swapped_forward import runs_forward

logger = logging.getLogger(__name__)

# input_ids [T], positions [T] -> hidden [T, hidden]
StackForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_PROBE_TOKENS = 5


def _layers(body: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]] | None:
    """Each decoder layer's (input norm, attention, post-attention norm, MLP), or None where a layer is not the
    pre-norm shape with a fused attention."""
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return None
    parts = []
    for layer in layers:
        found = tuple(getattr(layer, name, None) for name in _LAYER_PARTS)
        if not all(isinstance(p, torch.nn.Module) for p in found) or not is_fused(found[1]):
            return None
        parts.append(found)
    return parts


def _native_args(
    layers: list[tuple[torch.nn.Module, ...]], attend: AttendFn
) -> tuple[list[torch.Tensor | None], list[int], list[float]] | None:
    """The C++ walk's per-layer arguments (``engine/kernels/decoder_stack_cpu.cpp`` lists them), or None where a
    part of some layer does not run the kernel that walk calls, or the kernel library cannot be had."""
    from engine import fused_mlp, fused_norm, linear_prepack
    from engine.kernels.build import load, load_decoder_stack

    if attend is not load():  # our paged attention operator, not a fallback or a wrapper around it
        return None
    tensors: list[torch.Tensor | None] = []
    ints: list[int] = []
    floats: list[float] = []
    for norm1, attn, norm2, mlp in layers:
        qkv = attn.__dict__.get("qkv_linear")
        linears = (qkv, attn.o_proj, mlp.down_proj)
        if not (
            all(runs_forward(n, fused_norm._kernel_forward) for n in (norm1, norm2))
            and all(
                lin is not None and runs_forward(lin, linear_prepack._dispatched_forward) for lin in linears
            )
            and runs_forward(mlp, fused_mlp._fused_forward)
        ):
            return None
        o, down, gate, up = attn.o_proj, mlp.down_proj, mlp.gate_proj, mlp.up_proj
        tensors += [norm1.weight, qkv.panel_weight, qkv.bias, o.panel_weight, o.bias]
        tensors += [norm2.weight, mlp.gate_up_panels, down.panel_weight, down.bias]
        ints += [qkv.out_features, qkv.packed_index, *attn.fused_heads, o.out_features, o.packed_index]
        ints += [gate.out_features, gate.packed_index, up.packed_index, down.out_features, down.packed_index]
        floats += [norm1.variance_epsilon, norm2.variance_epsilon, attn.scaling]
    if load_decoder_stack() is None:
        return None
    return tensors, ints, floats


def _make_forward(
    body: torch.nn.Module, layers: list[tuple[torch.nn.Module, ...]], attend: AttendFn | None = None
) -> StackForward:
    """The walk over ``layers``: in C++ where ``attend`` is given and every part runs our CPU kernels (and no
    streaming hook waits on the step), else in Python."""
    embed = body.embed_tokens.forward
    rotary = body.rotary_emb.forward
    final_norm = body.norm.forward
    parts = [(n1.forward, attn, n2.forward, mlp.forward) for n1, attn, n2, mlp in layers]
    head_dim = layers[0][1].head_dim
    native = _native_args(layers, attend) if attend is not None else None
    walk = torch.ops.bucketserve_cpu.decoder_layers.default if native is not None else None
    # the row limit its layers' packed linears carry (all of one dtype): the C++ walk passes it to every call
    max_rows = layers[0][1].o_proj.skinny_max_rows if native is not None else 0

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids/positions [T] -> hidden [T, hidden]
        ctx = current_context()
        h = embed(input_ids)  # [T, hidden]
        cos, sin = rotary(h[None], positions[None])  # [1, T, D] each
        cos, sin = cos.view(-1, head_dim), sin.view(-1, head_dim)
        if walk is not None and ctx.on_layer_written is None:
            h = walk(
                h, cos, sin, ctx.kv_data, ctx.slot_mapping, ctx.block_table, ctx.seq_lens, ctx.query_start_loc,
                *native, max_rows,
            )  # fmt: skip
            return final_norm(h)
        for norm1, attn, norm2, mlp in parts:
            h = h + fused_attention_rows(attn, norm1(h), cos, sin, ctx)
            h = h + mlp(norm2(h))
        return final_norm(h)

    forward.native = walk is not None  # type: ignore[attr-defined]
    return forward


@torch.inference_mode()
def _agreeing(
    model: torch.nn.Module, stacks: list[StackForward], attend: AttendFn, attn: torch.nn.Module
) -> list[bool]:
    """For each of ``stacks``, whether it returns the model's own forward bit for bit on one probe prompt (the
    model's forward runs once)."""
    body = model.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (_PROBE_TOKENS,), generator=gen)
    positions = torch.arange(_PROBE_TOKENS)
    layers = len(body.layers)

    def probe(run) -> torch.Tensor | None:
        with forward_context(probe_context(attn, _PROBE_TOKENS, attend, layers)):
            try:
                return run()
            # A model this walk cannot stand in for may fail on it: it keeps its forward.
            except Exception as e:
                logger.debug("decoder stack probe failed (%s)", e)
                return None

    want = probe(
        lambda: body(input_ids=ids[None], position_ids=positions[None], use_cache=False).last_hidden_state[0]
    )
    if want is None:  # nothing to compare with: no walk stands in for it
        return [False] * len(stacks)
    outs = [probe(lambda stack=stack: stack(ids, positions)) for stack in stacks]
    return [got is not None and torch.equal(want, got) for got in outs]


def decoder_stack(model: torch.nn.Module, attend: AttendFn) -> StackForward | None:
    """The direct forward over ``model``'s decoder layers (see the module's docstring), or None where it would not
    compute exactly what the model's own forward does."""
    body = getattr(model, "model", None)
    if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return None
    layers = _layers(body)
    if layers is None:
        return None
    stack = _make_forward(body, layers)
    native = _make_forward(body, layers, attend)
    candidates = [stack, native] if native.native else [stack]
    agree = _agreeing(model, candidates, attend, layers[0][1])
    if not agree[0]:
        logger.info("decoder stack: the probe differs from the model's own forward; the model keeps it")
        return None
    if native.native and agree[1]:
        logger.info("decoder stack: %d layers called directly, walked in C++", len(layers))
        return native
    if native.native:
        logger.warning(
            "decoder stack: the C++ walk differs from the model's own forward on the probe; kept the Python one"
        )
    logger.info("decoder stack: %d layers called directly", len(layers))
    return stack
