"""Text <-> tokens in the gateway: prompt tokenization, chat templates, incremental detokenization
and stop strings for streaming.

The engine never sees text (except to check stop strings), so the gateway owns the tokenizer; it is
loaded from the checkpoint folder the backend names, the same files the workers loaded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback tokens


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's scheme): every byte is written as one printable character; the
    printable Latin-1 bytes stand for themselves, the others for characters from U+0100 on, in byte order."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()

# Text up to this many characters, or a chat of up to INLINE_MESSAGES messages as long, is tokenized on the event
# loop (about half a millisecond); longer goes to a thread, so that one long prompt does not stall every other
# stream of the replica meanwhile (a megabyte takes about a second; the tokenizer releases the GIL as it works).
INLINE_CHARS = 2048
INLINE_MESSAGES = 8
# Threads that tokenize long text, shared by the apps of a process. Few: tokenizing is CPU work, and a queue of
# long prompts must not starve the engine or the loop of cores; short prompts do not wait behind them.
TOKENIZE_THREADS = 2
_POOL = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="tokenize")


# Tokenizer classes that are the tokenizers library's own pipeline, read whole from ``tokenizer.json``: what
# AutoTokenizer would build for them, built without AutoTokenizer's imports.
_PLAIN_BACKENDS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer. One whose config names a plain tokenizers backend (the built-in models', and
    many real checkpoints') is loaded through that class directly: AutoTokenizer's module imports torch, which
    cost a gateway replica about 2 s of a start-up spent beside the workers' own on the same cores, for nothing
    a tokenizer uses. Any other class goes through AutoTokenizer."""
    if _tokenizer_class(path) in _PLAIN_BACKENDS and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_class(path: str) -> str | None:
    """``tokenizer_class`` of a local checkpoint's ``tokenizer_config.json``; None when it has none (or the path
    is not a folder: AutoTokenizer then says what is wrong)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            value = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        decoder = getattr(getattr(hf_tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._special = set(getattr(hf_tokenizer, "all_special_ids", ()))

    async def encode_all(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids; off the event loop when the texts are long. (Tokenizing from several threads
        at once is safe: it only reads the tokenizer, which nothing reconfigures while serving.)"""
        if sum(len(t) for t in texts) <= INLINE_CHARS:
            return [self.encode(t) for t in texts]
        return await asyncio.get_running_loop().run_in_executor(
            _POOL, lambda: [self.encode(t) for t in texts]
        )

    async def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """:meth:`apply_chat_template`, off the event loop when the messages are long."""
        if len(messages) <= INLINE_MESSAGES and sum(len(m["content"]) for m in messages) <= INLINE_CHARS:
            return self.apply_chat_template(messages, add_generation_prompt)
        return await asyncio.get_running_loop().run_in_executor(
            _POOL, self.apply_chat_template, messages, add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=True).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (for logprobs)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw bytes (logprobs' ``bytes``): a byte-level token may hold part of a UTF-8 character,
        which its decoded text would show as U+FFFD."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._special:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
        return self.token_text(token_id).encode()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # The template writes the BOS itself; adding special tokens again would double it.
        return list(self.hf(text, add_special_tokens=False).input_ids)


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas, as the tokens arrive.

    Decodes only a short window (the tokens since the last emitted boundary) instead of the whole
    output each time, and holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD),
    so that multi-byte characters split over tokens are never emitted half-made.

    With ``stop`` strings, the text past the first stop string is never emitted, and the last
    ``len(longest stop) - 1`` characters are held back until more text shows they cannot begin one.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text decoded so far (possibly past a stop string)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found; nothing more will be emitted

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the text now safe to emit (all of it when ``final``)."""
        if self.stopped:
            return ""
        for t in token_ids:
            self.ids.append(t)
            self.text += self._step()
        if final:
            # Flush whatever the windowed decoding still held (an incomplete character at the end).
            rest = self.tok.decode(self.ids[self.prefix_offset :])
            done = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
            if len(rest) > len(done):
                self.text += rest[len(done) :]
                self.read_offset = len(self.ids)
        return self._release(final)

    def _step(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def _release(self, final: bool) -> str:
        if self.stop:
            # A stop string can only begin where one could not have been seen before.
            start = max(0, self.emitted - self.hold)
            cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                out = self.text[self.emitted : cut]
                self.emitted = cut
                return out
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    @property
    def output_text(self) -> str:
        """The text handed out so far (the whole response text once finished)."""
        return self.text[: self.emitted]
