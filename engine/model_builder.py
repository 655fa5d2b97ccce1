"""Builds the built-in models: deterministic random-weight Llamas in Hugging Face format.

No network is ever used: the tokenizer is a byte-level BPE trained here on a text we ship
(``assets/tokenizer_corpus.txt``) and the weights come from seeded generators, one per tensor name,
so the same name always gets the same bytes whatever the module construction order. The result is
written to ``$BUCKETSERVE_CACHE/models/<name>`` (default ``~/.cache/bucketserve``) and then loaded
through the same code path as any checkpoint given with ``--model PATH``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the recipe changes, so an old cached folder is never mistaken for a new build.
BUILD_VERSION = 1
_ASSETS = Path(__file__).parent / "assets"

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class BuiltinModelSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    seed: int = 0
    # Rows of the embedding and the LM head, where a real model's shape has more than our tokenizer's vocabulary
    # (the extra ids are never produced by the tokenizer); 0: the tokenizer's.
    model_vocab_size: int = 0
    dtype: str = "float32"  # of the saved weights


BUILTIN_MODELS: dict[str, BuiltinModelSpec] = {
    # ~5M parameters: fast enough for the test suite on two CPU cores.
    "tiny": BuiltinModelSpec("tiny", 256, 688, 4, 4, 2),
    # ~28M parameters: the benchmark model.
    "small": BuiltinModelSpec("small", 512, 1408, 8, 8, 4),
    # Llama 3 8B's shapes (hidden 4096, MLP 14336, 32 heads over 8 KV heads, 128256-row embedding and head) with
    # 8 of its 32 layers, bf16: 2.8B parameters, 5.6 GB. The accelerator benchmark's model.
    "llama3-8b-l8": BuiltinModelSpec(
        "llama3-8b-l8", 4096, 14336, 8, 32, 8, 4096, 8192, 0, model_vocab_size=128256, dtype="bfloat16"
    ),
}
ALIASES = {"default": "tiny"}


def cache_root() -> Path:
    return Path(os.environ.get("BUCKETSERVE_CACHE", Path.home() / ".cache" / "bucketserve"))


def builtin_name(model: str) -> str | None:
    name = ALIASES.get(model, model)
    return name if name in BUILTIN_MODELS else None


def _corpus() -> str:
    return (_ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int):
    """A byte-level BPE trained on the shipped corpus (deterministic: one thread, fixed input order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on fixed-size chunks in order; the trainer is deterministic for the same input.
    text = _corpus()
    chunks = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    tok.train_from_iterator(chunks, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _init_weights(model, seed: int, std: float) -> None:
    """Seeded per tensor name: weights ~ N(0, std), norms = 1, biases = 0."""
    import torch

    for name, param in sorted(model.named_parameters()):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def build_model(spec: BuiltinModelSpec, out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(spec.vocab_size)
    vocab = max(len(tokenizer), spec.model_vocab_size)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    # Built on the meta device and allocated once in the saved dtype: transformers' own initialisation would
    # fill every tensor a first time in fp32 (minutes and twice the memory for a multi-billion-parameter shape),
    # and every parameter is overwritten by ours anyway.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, spec.dtype)).to_empty(device="cpu")
    _init_weights(model, spec.seed, std=0.02)
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "BUCKETSERVE_BUILD").write_text(f"{spec}\nversion={BUILD_VERSION}\n")


def ensure_builtin(name: str) -> Path:
    """Return the folder of a built-in model, building it on first use (atomically)."""
    resolved = builtin_name(name)
    if resolved is None:
        raise KeyError(
            f"not a built-in model: {name!r}; built-ins are {sorted(BUILTIN_MODELS) + sorted(ALIASES)}"
        )
    spec = BUILTIN_MODELS[resolved]
    digest = hashlib.sha256(f"{spec}|{BUILD_VERSION}|{_corpus()}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"bucketserve-{resolved}-{digest}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the built-in %r model into %s (first use only)", resolved, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_model(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first; theirs is identical.
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
