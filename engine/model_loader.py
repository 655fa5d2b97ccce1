"""One loading path for every model: built-in names, local folders, Hugging Face ids (offline)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model_builder import builtin_name, ensure_builtin

if TYPE_CHECKING:
    import torch

    from engine.kv_cache import KVCacheSpec

# torch and transformers are imported by load_model only: a command line that reads a checkpoint's facts (`serve`
# checks its flags against them before anything starts) should not spend 3 s importing them first.

logger = logging.getLogger(__name__)

# Decoder-only families whose modeling code calls the attention interface with K/V after rotary.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(model: str) -> Path:
    """'default'/'tiny'/'small' -> built (once) into the cache; a folder -> itself; else an HF id,
    looked up in the local Hugging Face cache only (no network at run time)."""
    if builtin_name(model):
        return ensure_builtin(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"--model {model}: folder has no config.json (not a Hugging Face checkpoint)"
            )
        return path
    if model.startswith((".", "/", "~")) or os.sep in model and not _looks_like_hf_id(model):
        raise ModelNotFoundError(f"--model {model}: no such folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as e:  # the hub raises several types for "not cached"
        raise ModelNotFoundError(
            f"--model {model}: not a built-in model (default, tiny, small), not a local folder, and not in the "
            f"local Hugging Face cache; this server never downloads at run time: fetch it beforehand or pass "
            f"its folder ({type(e).__name__})"
        ) from None


@dataclass(frozen=True)
class ModelFacts:
    """What a checkpoint's config file says, read without loading any weight (a second at most)."""

    path: Path
    architecture: str
    max_position_embeddings: int
    # The checkpoint's own dtype ("float32" when its config names none): what ``--dtype auto`` runs in.
    dtype: str


_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def read_model_facts(model: str) -> ModelFacts:
    """Resolve ``model`` and read its limits from ``config.json``; errors name ``--model``."""
    path = resolve_model_path(model)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"--model {model}: cannot read {path / 'config.json'} ({e})") from None
    archs = tuple(config.get("architectures") or ())
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ModelNotFoundError(
            f"--model {model}: architecture {archs or '(none)'} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
        )
    raw_dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return ModelFacts(
        path=path,
        architecture=supported[0],
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        dtype=_DTYPE_NAMES.get(raw_dtype, raw_dtype),
    )


def _looks_like_hf_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts)


@dataclass
class LoadedModel:
    path: Path
    model: torch.nn.Module  # a transformers *ForCausalLM using our paged attention
    tokenizer: object
    kv_spec_base: dict  # KVCacheSpec fields except block_size
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    def kv_spec(self, block_size: int) -> KVCacheSpec:
        from engine.kv_cache import KVCacheSpec

        return KVCacheSpec(block_size=block_size, **self.kv_spec_base)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


def load_model(model: str, device: torch.device, dtype: str = "float32") -> LoadedModel:
    """Load weights and tokenizer; ``dtype`` is concrete (``fit_to_model`` resolves "auto" first)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from engine.attention import ATTN_IMPLEMENTATION
    from engine.kv_cache import torch_dtype

    facts = read_model_facts(model)
    path = facts.path
    config = AutoConfig.from_pretrained(path)
    archs = (facts.architecture,)
    hf_model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), attn_implementation=ATTN_IMPLEMENTATION
    ).to(device)
    hf_model.eval()
    hf_model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids = (*eos_ids, tokenizer.eos_token_id)
    loaded = LoadedModel(
        path=path,
        model=hf_model,
        tokenizer=tokenizer,
        kv_spec_base={
            "architecture": archs[0],
            "num_layers": config.num_hidden_layers,
            "num_kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "head_dim": head_dim,
            "dtype": dtype,
        },
        max_position_embeddings=facts.max_position_embeddings,
        eos_token_ids=eos_ids,
    )
    logger.info("loaded %s (%s, %.1fM parameters) from %s", model, archs[0], loaded.num_params / 1e6, path)
    return loaded
