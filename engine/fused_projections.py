"""Linears that read the same input, fused into one GEMM on accelerators: each attention layer's Q, K and V
projections, and each gated MLP's gate and up projections.

A batch-1 decode step on a GPU is bound by how fast its GEMMs read the weights, and a small GEMM reads its weight
slower than a large one: its thread blocks ramp up and drain as a large one's do, over less data, and a narrow
weight gives too few blocks to fill the GPU (a Llama-3-8B-shaped layer's K and V projections are 1,024 rows of
4,096; on an H100 the three projections together read their 48 MB at about 1.6 TB/s, where a plain copy moves
2.9). One GEMM over the concatenated weights reads them as one, and launches one kernel instead of three (two).

The model classes stay transformers' own: only each fused module's ``forward`` is replaced, on the instance, by
one that runs the module's own steps with the fused linear (the attention interface the model is configured
with, transformers' ``apply_rotary_pos_emb`` of the module's family, its ``act_fn``), and only where it
reproduces the module's own forward on a probe (outputs compared to the dtype's rounding: one GEMM may sum in
another order than two or three). A module that computes anything else (per-head norms of Q and K, a partial
rotary, another MLP formula under the same names) keeps its own forward.

The fused linear is kept outside the module tree (in the instance's ``__dict__``), and the separate weights become
views into it, so the model's parameters, ``state_dict`` and weight bytes stay as loaded. Which device fuses is
decided once, at start-up (``Device.fuse_projections``); the CPU's prepacked path has fusions of its own.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType

import torch

from engine.fused_attention import probe_rope

logger = logging.getLogger(__name__)

_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj")
_MLP_PARTS = ("gate_proj", "up_proj")
# How far a fused forward's probe output may lie from the module's own, as a fraction of the output's largest
# magnitude: one GEMM over the concatenated weight may block its sums differently from separate ones (cuBLAS picks
# its kernel by the weight's shape), which moves a bf16 result by a few units in its last place (2**-8), and
# attention's softmax passes that on. What the probe is for, a forward that computes something else, is off by
# the order of the output itself.
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2**-5, torch.float16: 2**-7}
# The attention the probe runs both forwards with: transformers' own eager attention (the family's
# eager_attention_forward), which needs no cache or context, whatever the model is configured with.
_PROBE_ATTENTION = "eager"
_PROBE_ROWS = (3, 33)  # a decode-sized and a prefill-sized row count (kernels may differ by rows)


def fused_linear_of(module: torch.nn.Module) -> torch.nn.Linear | None:
    """The fused linear that replaced some of ``module``'s linears, if any."""
    return module.__dict__.get("fused_linear")


def is_fused_part(linear: torch.nn.Module) -> bool:
    """Whether ``linear`` is one of the linears a fused one replaced (its forward is no longer called)."""
    return bool(linear.__dict__.get("fused_part", False))


def _linears(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    parts = [getattr(module, name, None) for name in names]
    if not all(type(p) is torch.nn.Linear for p in parts):
        return None
    first = parts[0]
    same = all(
        p.in_features == first.in_features
        and p.weight.dtype == first.weight.dtype
        and p.weight.device == first.weight.device
        and (p.bias is None) == (first.bias is None)
        for p in parts
    )
    return parts if same and first.weight.dtype in _PROBE_TOLERANCE else None


def _concatenate(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One linear over ``parts``' weights (and biases) stacked in order; each part's weight (bias) becomes a view
    into it, so the old tensors are freed and nothing is held twice."""
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum(N_i), K]
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    return fused


def _share_storage(fused: torch.nn.Linear, parts: list[torch.nn.Linear]) -> None:
    start = 0
    for p in parts:
        end = start + p.out_features
        p.weight = torch.nn.Parameter(fused.weight[start:end], requires_grad=False)
        if fused.bias is not None:
            p.bias = torch.nn.Parameter(fused.bias[start:end], requires_grad=False)
        p.__dict__["fused_part"] = True
        start = end


def _attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The module's own steps (transformers' Llama-family attention), with one linear for Q, K and V.
    # hidden_states [B, T, hidden]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    qkv = self.fused_linear(hidden_states)  # [B, T, (H + 2 KVH) D]
    q, k, v = qkv.split(self.fused_widths, dim=-1)
    query = q.view(hidden_shape).transpose(1, 2)  # [B, H, T, D]
    key = k.view(hidden_shape).transpose(1, 2)  # [B, KVH, T, D]
    value = v.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = self.fused_rotary(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    interface = self.fused_attention_functions.get_interface(
        self.config._attn_implementation, self.fused_eager_attention
    )
    out, weights = interface(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=self.fused_sliding_window,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()  # [B, T, H * D]
    return self.o_proj(out), weights


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # x [..., hidden]; gate and up side by side in one GEMM: [..., 2 * intermediate]
    gate, up = self.fused_linear(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _attention_extras(module: torch.nn.Module) -> dict | None:
    """What the fused attention forward needs besides the fused linear, or None where the module is no
    Llama-family attention layer."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    family = sys.modules.get(type(module).__module__)
    parts = _linears(module, _ATTENTION_PARTS)
    if parts is None or family is None or not hasattr(module, "config"):
        return None
    if not all(hasattr(family, f) for f in ("apply_rotary_pos_emb", "eager_attention_forward")):
        return None
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or not isinstance(getattr(module, "layer_idx", None), int):
        return None
    if not isinstance(getattr(module, "scaling", None), float):
        return None
    if any(getattr(module, name, None) is not None for name in ("q_norm", "k_norm")):
        return None  # per-head norms between the projection and the rotary (Qwen3, Gemma 3)
    if not all(p.out_features % head_dim == 0 for p in parts):
        return None
    # What the family passes to its attention function as the window (Qwen2 its own attribute, Mistral its
    # config's; Llama nothing, which every attention function reads as None).
    window = getattr(module, "sliding_window", getattr(module.config, "sliding_window", None))
    return {
        "fused_sliding_window": window,
        "fused_widths": [p.out_features for p in parts],
        "fused_rotary": family.apply_rotary_pos_emb,
        "fused_eager_attention": family.eager_attention_forward,
        "fused_attention_functions": ALL_ATTENTION_FUNCTIONS,
    }


def _mlp_candidate(module: torch.nn.Module) -> bool:
    parts = _linears(module, _MLP_PARTS)
    down = getattr(module, "down_proj", None)
    return (
        parts is not None
        and parts[0].out_features == parts[1].out_features
        and isinstance(down, torch.nn.Module)
        and callable(getattr(module, "act_fn", None))
    )


def _probe_inputs(module: torch.nn.Module, rows: int, gen: torch.Generator) -> dict:
    first = getattr(module, _ATTENTION_PARTS[0], None) or getattr(module, _MLP_PARTS[0])
    dtype, device = first.weight.dtype, first.weight.device
    x = torch.randn(1, rows, first.in_features, generator=gen).to(device, dtype)
    if not hasattr(module, "fused_widths"):
        return {"x": x}
    rope = probe_rope(rows, module.head_dim, gen, dtype, device)
    return {"hidden_states": x, "position_embeddings": rope, "attention_mask": None}


def _first(out) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float()


@contextmanager
def _probe_attention(module: torch.nn.Module) -> Iterator[None]:
    """Both forwards of an attention layer's probe run transformers' eager attention: the model's configured one
    (the engine's paged operators) reads a per-step context that a probe has not got."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "fused_widths"):
        yield
        return
    configured = config._attn_implementation
    config._attn_implementation = _PROBE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = configured


def _disagreement(module: torch.nn.Module, fused_forward, gen: torch.Generator) -> str | None:
    """Why the fused forward cannot stand in for the module's own, on a short and a longer probe; None if it
    can."""
    tolerance = _PROBE_TOLERANCE[fused_linear_of(module).weight.dtype]
    for rows in _PROBE_ROWS:
        inputs = _probe_inputs(module, rows, gen)
        try:
            with _probe_attention(module):
                want = _first(type(module).forward(module, **inputs))
                got = _first(fused_forward(module, **inputs))
        # A module this forward cannot stand in for may fail on the probe (a partial rotary cannot take
        # full-width cos/sin): it keeps its own forward.
        except Exception as e:
            return f"the probe failed: {type(e).__name__}: {e}"
        error = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        if not error <= tolerance:
            return f"outputs differ by {error:.3g} of their largest magnitude at {rows} rows (at most {tolerance:.3g})"
    return None


@torch.inference_mode()
def fuse_projections(model: torch.nn.Module) -> dict[str, int]:
    """Fuse Q/K/V and gate/up in every module whose fused forward reproduces its own (see the module docstring);
    returns how many of each kind were fused and kept."""
    gen = torch.Generator().manual_seed(0)
    counts = {"attention": 0, "mlp": 0, "kept": 0}
    for module in list(model.modules()):
        if type(module).forward is not getattr(module.forward, "__func__", None):
            continue  # its forward was already replaced (by another fusion)
        extras = _attention_extras(module)
        if extras is not None:
            kind, names, forward = "attention", _ATTENTION_PARTS, _attention_forward
        elif _mlp_candidate(module):
            kind, names, forward, extras = "mlp", _MLP_PARTS, _mlp_forward, {}
        else:
            continue
        parts = [getattr(module, n) for n in names]
        try:
            with torch.inference_mode(False), torch.no_grad():
                # Normal tensors, as the loaded weights are (a compiled forward guards on the kind of its tensors).
                extras["fused_linear"] = _concatenate(parts)
        except torch.OutOfMemoryError:
            # The concatenation needs one more copy of this module's weights for a moment; a model that fills
            # the device runs its linears apart rather than failing to start.
            logger.warning(
                "%s keeps its own forward: no device memory for its fused weights", type(module).__name__
            )
            counts["kept"] += 1
            continue
        module.__dict__.update(extras)
        why = _disagreement(module, forward, gen)
        if why is not None:
            for name in extras:
                del module.__dict__[name]
            logger.info("%s keeps its own forward: %s", type(module).__name__, why)
            counts["kept"] += 1
            continue
        with torch.inference_mode(False), torch.no_grad():
            _share_storage(extras["fused_linear"], parts)
        module.forward = MethodType(forward, module)
        counts[kind] += 1
    if any(counts.values()):
        logger.info(
            "fused Q/K/V in %d attention layers and gate/up in %d MLPs into one GEMM each (%d kept their forward)",
            counts["attention"],
            counts["mlp"],
            counts["kept"],
        )
    return counts


def model_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linears a forward of ``model`` calls: its own, less the fused parts, plus the fused ones."""
    out = []
    for m in model.modules():
        if type(m) is torch.nn.Linear and not is_fused_part(m):
            out.append(m)
        fused = fused_linear_of(m)
        if fused is not None:
            out.append(fused)
    return out
