"""Attention layers of the flat-token runner with their projections fused and their glue in one kernel, on CPU.

transformers' Llama-family attention runs, per layer: three linears (Q, K, V), a view and a transpose of each,
the rotary embedding (two slices, a negation, a concatenation, four multiplies, two adds), then our attention
function's transposes back to token-major rows and its two cache writes: about thirty eager calls, most of them
costing more in dispatch than in arithmetic on a decode step's few rows. The fused forward runs one linear over
the concatenated Q/K/V weights, one kernel (``bucketserve_cpu::rope_write_kv``, ``engine/kernels/rotary_cpu.cpp``)
that rotates queries and keys exactly as transformers does and writes keys and values into their cache slots,
the device's paged attention, and the output projection.

The model classes stay transformers' own: only each attention module's ``forward`` is replaced, on the instance,
and only where the fused forward reproduces the module's own on a probe (a prompt on a scratch cache, through
the same attention operator; outputs and cache contents compared to the dtype's rounding). A module that
computes anything else (per-head norms of Q and K, another rotary, biases the fused linear would miss) keeps its
own forward. Eager CPU steps only: a compiled forward fuses the same glue itself, and our kernel reads the
forward context, which a traced graph cannot.

The Q, K and V weights become views into the concatenated weight (no second copy), and their own packed copies
are released.
"""

from __future__ import annotations

import logging
from types import MethodType

import torch

from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION, attend_rotated
from engine.forward_context import AttendFn, ForwardContext, current_context, forward_context
from engine.linear_prepack import prepack_linear, probe_rows, skinny_rows_lowered, unpack_linear
from engine.swapped_forward import runs_forward

logger = logging.getLogger(__name__)

_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
# How far the probe's outputs may lie from the module's: the rotation and the cache writes are exact, but the
# fused linear may sum in another order than three separate ones (oneDNN's blocking depends on the width).
_PROBE_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (4 * 2**-8, 1e-2)}
_PROBE_BLOCK = 16


def _fused_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    # hidden_states [1, T, hidden]; cos/sin [1, T, D]
    if torch.compiler.is_compiling():
        # A runner that compiles this model after all traces transformers' own forward: the compiler fuses its
        # glue, and this one reads the forward context, which a graph cannot.
        return type(self).forward(
            self,
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
    shape = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    d = self.head_dim
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, hidden]
    out = fused_attention_rows(self, rows, cos.view(-1, d), sin.view(-1, d), current_context())  # [T, hidden]
    return out.view(*shape, -1), None  # [1, T, hidden]


def fused_attention_rows(
    module: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
) -> torch.Tensor:
    """A fused attention layer on token rows: x [T, hidden], cos/sin [T, D] -> [T, hidden]. The linears are
    called by their ``forward`` (what ``Module.__call__`` would run, less its hook handling)."""
    qkv = module.qkv_linear.forward(x)  # [T, (H + 2 KVH) D]
    rope_write = torch.ops.bucketserve_cpu.rope_write_kv
    out = attend_rotated(ctx, module.layer_idx, rope_write, qkv, cos, sin, module.fused_heads, module.scaling)
    return module.o_proj.forward(out.view(out.shape[0], -1))  # [T, hidden]


def is_fused(module: torch.nn.Module) -> bool:
    """Whether ``fuse_attention_layers`` swapped this attention layer's forward."""
    return runs_forward(module, _fused_forward)


def _candidate(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    parts = [getattr(module, name, None) for name in _PARTS]
    if not all(type(p) is torch.nn.Linear and getattr(p, "packed_index", None) is not None for p in parts):
        return False
    q, k, v, _ = parts
    return (
        getattr(getattr(module, "config", None), "_attn_implementation", None) == FLAT_ATTN_IMPLEMENTATION
        and isinstance(getattr(module, "layer_idx", None), int)
        and isinstance(getattr(module, "head_dim", None), int)
        and isinstance(getattr(module, "scaling", None), float)
        and q.weight.dtype == dtype
        and dtype in _PROBE_TOLERANCE
        and q.in_features == k.in_features == v.in_features
        and k.out_features == v.out_features
        and q.out_features % module.head_dim == 0
        and k.out_features % module.head_dim == 0
        and (q.bias is None) == (k.bias is None) == (v.bias is None)
    )


def _fused_linear(module: torch.nn.Module) -> torch.nn.Linear:
    """One prepacked linear over the Q, K and V weights (and biases), side by side in that order."""
    q, k, v = module.q_proj, module.k_proj, module.v_proj
    weight = torch.cat([q.weight.detach(), k.weight.detach(), v.weight.detach()])  # [(H + 2 KVH) D, hidden]
    bias = None if q.bias is None else torch.cat([q.bias.detach(), k.bias.detach(), v.bias.detach()])
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    # The skinny kernel where the model's own layers use it.
    prepack_linear(linear, panels=q.panel_weight is not None)
    return linear


def probe_context(
    module: torch.nn.Module, tokens: int, attend: AttendFn, layers: int | None = None
) -> ForwardContext:
    """One fresh prompt of ``tokens`` tokens on a scratch cache of its own, shaped for attention layer ``module``:
    every layer index (up to ``layers``, else the module's own) maps to the same cache. Each layer writes the
    prompt's K/V before it attends over them, so layers sharing the cache never read each other's. On the
    module's device."""
    k = module.k_proj
    kvh, d = k.out_features // module.head_dim, module.head_dim
    dev = k.weight.device
    blocks = -(-tokens // _PROBE_BLOCK)
    cache = torch.zeros(1, 2, blocks + 1, _PROBE_BLOCK, kvh, d, dtype=k.weight.dtype, device=dev)
    kv_data = cache.expand(layers or module.layer_idx + 1, *cache.shape[1:])  # [L, 2, blocks + 1, BS, KVH, D]
    return ForwardContext(
        kv_data=kv_data,
        slot_mapping=torch.arange(tokens, device=dev) + _PROBE_BLOCK,  # block 0 stays the null block
        block_table=torch.arange(1, blocks + 1, dtype=torch.int32, device=dev)[None],
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
        attend=attend,
    )


def probe_rope(
    tokens: int, head_dim: int, gen: torch.Generator, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rotary cos/sin [1, T, D] for a probe of an attention layer, laid out as transformers lays its
    frequencies (each half the same angles), at angles large enough to turn every pair."""
    angles = torch.rand(1, tokens, head_dim // 2, generator=gen) * 100.0
    angles = torch.cat((angles, angles), dim=-1)  # [1, T, D]
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _agrees(module: torch.nn.Module, attend: AttendFn, gen: torch.Generator) -> bool:
    """The fused forward against the module's own, on a short prompt (skinny linears) and a longer one (oneDNN, the
    linears' row limits lowered meanwhile)."""
    q = module.q_proj
    dtype, d = q.weight.dtype, module.head_dim
    rtol, atol = _PROBE_TOLERANCE[dtype]
    limit = probe_rows(dtype)
    linears = [getattr(module, name) for name in _PARTS] + [module.__dict__["qkv_linear"]]
    for tokens in (3, limit + 1):
        x = torch.randn(1, tokens, q.in_features, generator=gen).to(dtype)
        rope = probe_rope(tokens, d, gen, dtype)
        results = []
        for forward in (type(module).forward, _fused_forward):
            ctx = probe_context(module, tokens, attend)
            try:
                with forward_context(ctx), skinny_rows_lowered(linears, limit):
                    out, _ = forward(module, hidden_states=x, position_embeddings=rope, attention_mask=None)
            # A module this forward cannot stand in for may fail on the probe (a partial rotary cannot take
            # full-width cos/sin): it keeps its own forward.
            except Exception as e:
                logger.debug("attention layer %d: probe failed (%s)", module.layer_idx, e)
                return False
            results.append((out.float(), ctx.kv_data[0].float()))
        (want, want_kv), (got, got_kv) = results
        if not (
            torch.allclose(got, want, rtol=rtol, atol=atol)
            and torch.allclose(got_kv, want_kv, rtol=rtol, atol=atol)
        ):
            return False
    return True


def _rotary_kernel() -> bool:
    from engine.kernels.build import load_rotary

    return load_rotary() is not None


@torch.inference_mode()
def fuse_attention_layers(model: torch.nn.Module, attend: AttendFn, cache_dtype: torch.dtype) -> int:
    """Swap the forward of every attention layer that the fused one reproduces (see the module's docstring), for a
    model already running the flat attention implementation with a cache of ``cache_dtype``; returns how many."""
    candidates = [m for m in model.modules() if _candidate(m, cache_dtype)]
    if not candidates or not _rotary_kernel():
        return 0
    gen = torch.Generator().manual_seed(0)
    fused = kept = 0
    for module in candidates:
        k = module.k_proj
        module.fused_heads = (
            module.q_proj.out_features // module.head_dim,
            k.out_features // module.head_dim,
        )
        # Not a submodule: the model's parameters(), state_dict() and modules() stay as loaded.
        module.__dict__["qkv_linear"] = _fused_linear(module)
        if not _agrees(module, attend, gen):
            del module.__dict__["qkv_linear"]
            del module.fused_heads
            kept += 1
            continue
        module.forward = MethodType(_fused_forward, module)
        _share_weights(module)
        fused += 1
    logger.info(
        "fused %d attention layers (QKV, rotary and cache writes); %d keep their own forward", fused, kept
    )
    return fused


def _share_weights(module: torch.nn.Module) -> None:
    """Q, K and V weights as views into the fused linear's (one copy), their own packed copies released."""
    fused = module.__dict__["qkv_linear"]
    start = 0
    for name in _PARTS[:3]:
        part = getattr(module, name)
        n = part.out_features
        part.weight.data = fused.weight.data[start : start + n]
        if part.bias is not None:
            part.bias.data = fused.bias.data[start : start + n]
        unpack_linear(part)
        start += n
