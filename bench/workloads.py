"""Synthetic workloads: request lengths and arrival times with the statistics the BucketServe paper reports for
Alpaca, LongBench and their mix (Fig. 2 and 3), and the uniform ``random`` of common serving benchmarks.

Every function is pure and seeded: the same arguments give the same numbers. Lengths are in tokens.

* ``alpaca`` -- instruction prompts: input log-normal with mean ~83 and a long right tail (about 1-2% above
  256); output log-normal with mean ~150 (inside the 60-300 range reported), capped by ``max_output_len``.
* ``longbench`` -- long documents: input log-normal with median 41,417, truncated to what the model accepts;
  short outputs (summaries, median 64).
* ``mixed`` -- mostly short (alpaca-like, below 256) with a long tail of long prompts above 1024 (a share
  ``long_fraction``); long prompts are ``1025 +`` a log-normal excess, truncated to the model. When the model
  cannot take more than 1024 input tokens the long ones are simply the longest it takes.
* ``random`` -- input uniform in ``input_len * (1 +- range_ratio)``, output fixed.

Each request satisfies ``input_len >= 1``, ``output_len >= 1`` and ``input_len + output_len <= max_model_len``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

WORKLOADS = ("alpaca", "longbench", "mixed", "random")

ALPACA_INPUT_MEAN = 83.0
ALPACA_INPUT_SIGMA = 0.6
ALPACA_OUTPUT_MEAN = 150.0
ALPACA_OUTPUT_SIGMA = 0.8
LONGBENCH_INPUT_MEDIAN = 41_417.0
LONGBENCH_INPUT_SIGMA = 1.0
LONGBENCH_OUTPUT_MEDIAN = 64.0
LONGBENCH_OUTPUT_SIGMA = 0.5
SHORT_LIMIT = 256  # "short" prompts are below this
LONG_FLOOR = 1024  # "long" prompts are above this
LONG_EXCESS_MEDIAN = 400.0
LONG_EXCESS_SIGMA = 0.9


def _lognormal_with_mean(rng: random.Random, mean: float, sigma: float) -> float:
    # A log-normal's mean is exp(mu + sigma^2 / 2): solve for mu so the stated mean holds.
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)


def _fit(input_len: float, output_len: float, max_model_len: int, max_output_len: int) -> tuple[int, int]:
    """Round and truncate so the pair fits the model, the output first (as a server caps max_tokens)."""
    out = max(1, min(round(output_len), max_output_len, max_model_len - 1))
    inp = max(1, min(round(input_len), max_model_len - out))
    return inp, out


def _alpaca(rng: random.Random, max_model_len: int, max_output_len: int, short_only: bool) -> tuple[int, int]:
    inp = _lognormal_with_mean(rng, ALPACA_INPUT_MEAN, ALPACA_INPUT_SIGMA)
    if short_only:
        inp = min(inp, SHORT_LIMIT - 1)
    out = _lognormal_with_mean(rng, ALPACA_OUTPUT_MEAN, ALPACA_OUTPUT_SIGMA)
    return _fit(inp, out, max_model_len, max_output_len)


def _summary_len(rng: random.Random) -> float:
    return rng.lognormvariate(math.log(LONGBENCH_OUTPUT_MEDIAN), LONGBENCH_OUTPUT_SIGMA)


def _longbench(rng: random.Random, max_model_len: int, max_output_len: int) -> tuple[int, int]:
    inp = rng.lognormvariate(math.log(LONGBENCH_INPUT_MEDIAN), LONGBENCH_INPUT_SIGMA)
    return _fit(inp, _summary_len(rng), max_model_len, max_output_len)


def _long(rng: random.Random, max_model_len: int, max_output_len: int) -> tuple[int, int]:
    inp = LONG_FLOOR + 1 + rng.lognormvariate(math.log(LONG_EXCESS_MEDIAN), LONG_EXCESS_SIGMA)
    return _fit(inp, _summary_len(rng), max_model_len, max_output_len)


def sample_lengths(
    workload: str,
    n: int,
    seed: int,
    max_model_len: int = 4096,
    max_output_len: int = 1024,
    long_fraction: float = 0.2,
    random_input_len: int = 256,
    random_output_len: int = 64,
    random_range_ratio: float = 0.9,
) -> list[tuple[int, int]]:
    """``n`` pairs ``(input_len, output_len)`` of a workload, reproducible from ``seed``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_output_len < 1:
        raise ValueError(f"max_output_len must be >= 1, got {max_output_len}")
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    if not 0.0 <= random_range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {random_range_ratio}")
    if random_input_len < 1 or random_output_len < 1:
        raise ValueError("random_input_len and random_output_len must be >= 1")
    rng = random.Random(seed)
    if workload == "alpaca":
        return [_alpaca(rng, max_model_len, max_output_len, short_only=False) for _ in range(n)]
    if workload == "longbench":
        return [_longbench(rng, max_model_len, max_output_len) for _ in range(n)]
    if workload == "mixed":
        return [
            _long(rng, max_model_len, max_output_len)
            if rng.random() < long_fraction
            else _alpaca(rng, max_model_len, max_output_len, short_only=True)
            for _ in range(n)
        ]
    low = max(1, round(random_input_len * (1 - random_range_ratio)))
    high = max(low, round(random_input_len * (1 + random_range_ratio)))
    return [_fit(rng.randint(low, high), random_output_len, max_model_len, max_output_len) for _ in range(n)]


def sample_arrivals(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Arrival times in seconds from 0: gamma-distributed gaps with mean ``1 / rate``; ``burstiness`` 1 is
    Poisson, below 1 burstier, above 1 more regular. ``rate`` infinite: everything arrives at 0."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    t = 0.0
    times = []
    for _ in range(n):
        t += rng.gammavariate(burstiness, scale)
        times.append(t)
    return times


# --------------------------------------------------------------------------- prompt text

# Prompts are real text cut to an exact number of tokens of the model's own tokenizer. Short prompts
# (alpaca, and the short part of mixed) come from the Alpaca seed tasks; long documents (longbench, the
# long part of mixed, random) are synthetic prose, because no long-document corpus ships with the product.

ALPACA_DATASET_NAME = "alpaca_seed_tasks.jsonl"
# The copy shipped with bench (licence and attribution beside it in bench/data/).
DEFAULT_DATASET = Path(__file__).resolve().parent / "data" / ALPACA_DATASET_NAME

# Common English words for synthetic documents: frequent words tokenize like ordinary prose, so the
# server does the same work per token as on real text.
_WORD_LIST = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their has been if more when will would who so no time people "
    "year way day man thing woman life child world school state family student group country problem hand "
    "part place case week company system program question work government number night point home water "
    "room mother area money story fact month lot right study book eye job word business issue side kind "
    "head house service friend father power hour game line end member law car city community name team "
    "minute idea body information back parent face others level office door health person art war history "
    "party result change morning reason research girl guy moment air teacher force education river light "
    "small large early young important few public bad same able long great little own other old big high "
    "different local new good first last next open clear simple careful quick quiet strong warm green "
    "build make take give find think tell become show leave feel bring begin keep hold write stand hear "
    "learn read carry follow stop create speak allow grow offer remember consider appear serve send expect"
)
_WORDS = tuple(_WORD_LIST.split())


def load_alpaca_texts(path: str | Path) -> list[str]:
    """One text per Alpaca seed task (instruction, its input and its answer), in file order."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"Alpaca seed tasks not found at {p}: the alpaca and mixed workloads take their short prompts from "
            f"{ALPACA_DATASET_NAME} (pass its location with --dataset)"
        )
    texts = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not a JSON line ({e.msg})") from None
        parts = [task.get("instruction", "")]
        for inst in task.get("instances", []):
            parts += [inst.get("input", ""), inst.get("output", "")]
        text = "\n".join(s.strip() for s in parts if s and s.strip())
        if text:
            texts.append(text)
    if not texts:
        raise ValueError(f"{p}: no tasks with text")
    return texts


def synthetic_text(rng: random.Random, num_words: int) -> str:
    """Seeded prose-like text: sentences of 6-20 common words, paragraphs of 3-7 sentences."""
    sentences: list[str] = []
    words = 0
    paragraph: list[str] = []
    while words < num_words:
        n = rng.randint(6, 20)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        paragraph.append(sentence[0].upper() + sentence[1:] + ".")
        words += n
        if len(paragraph) >= rng.randint(3, 7):
            sentences.append(" ".join(paragraph))
            paragraph = []
    if paragraph:
        sentences.append(" ".join(paragraph))
    return "\n\n".join(sentences)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """A prompt of exactly ``input_len`` tokens: ``token_ids`` and ``text``, which tokenizes (without special
    tokens) back to exactly ``token_ids``'s length."""

    text: str
    token_ids: list[int]
    input_len: int
    output_len: int


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _decode(tok: Tokenizer, ids: list[int]) -> str:
    # No clean-up of spaces: the text must tokenize back to the same count, not read prettier.
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def cut_to_tokens(tok: Tokenizer, ids: list[int], n: int, max_tries: int = 32) -> tuple[str, list[int]]:
    """Text of exactly ``n`` tokens taken from ``ids`` (the tokens of some text, at least ``n`` of them).

    Decoding a cut and re-tokenizing it usually gives the same ``n`` tokens, but a cut inside a word or
    a multi-byte character can merge differently; then nearby cuts (one token longer or shorter, or
    starting one token later) are tried until the text re-tokenizes to exactly ``n``. Returns the text
    and its own token ids (those the server will see)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(ids) < n:
        raise ValueError(f"need at least {n} tokens of source text, got {len(ids)}")
    tries = 0
    for start in range(0, len(ids) - n + 1):
        for k in (n, n - 1, n + 1, n - 2, n + 2):
            if k < 1 or start + k > len(ids):
                continue
            text = _decode(tok, ids[start : start + k])
            again = _encode(tok, text)
            if len(again) == n:
                return text, again
            tries += 1
            if tries >= max_tries:
                raise ValueError(f"no cut of the source text re-tokenizes to exactly {n} tokens")
    raise ValueError(f"no cut of the source text re-tokenizes to exactly {n} tokens")


def _alpaca_text(rng: random.Random, texts: list[str]) -> Callable[[int], str]:
    """A text maker: a random task first, then the others in a random order (cycling if more words
    are asked for), so requests rarely share a long common prefix and a server's prefix cache does
    not flatter its numbers."""
    first = rng.randrange(len(texts))
    rest = [i for i in range(len(texts)) if i != first]
    rng.shuffle(rest)
    order = [first, *rest]

    def make(num_words: int) -> str:
        parts: list[str] = []
        words = 0
        i = 0
        while words < num_words:
            text = texts[order[i % len(order)]]
            parts.append(text)
            words += len(text.split())
            i += 1
        return "\n\n".join(parts)

    return make


def _source_ids(tok: Tokenizer, make_text: Callable[[int], str], n: int) -> list[int]:
    """Tokens of generated text, asking for more words until it has a few more than ``n`` tokens
    (a few spare, so :func:`cut_to_tokens` can try a longer cut)."""
    words = max(16, n)
    while True:
        ids = _encode(tok, make_text(words))
        if len(ids) >= n + 4:
            return ids
        words *= 2


def build_prompts(
    workload: str,
    lengths: list[tuple[int, int]],
    tokenizer: Tokenizer,
    seed: int,
    alpaca_texts: list[str] | None = None,
) -> list[Prompt]:
    """One prompt per ``(input_len, output_len)`` pair, each exactly ``input_len`` tokens long.

    Text source: the Alpaca seed tasks for ``alpaca`` and for the short prompts of ``mixed`` (below
    ``SHORT_LIMIT`` tokens); synthetic prose for ``longbench``, ``random`` and the long prompts of
    ``mixed``. Reproducible from ``seed``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    rng = random.Random(f"prompts:{seed}")
    prompts = []
    for input_len, output_len in lengths:
        use_alpaca = workload == "alpaca" or (workload == "mixed" and input_len < SHORT_LIMIT)
        if use_alpaca:
            if not alpaca_texts:
                raise ValueError(f"the {workload} workload needs the Alpaca seed tasks (alpaca_texts)")
            make_text = _alpaca_text(rng, alpaca_texts)
        else:
            text_seed = rng.random()

            def make_text(num_words: int, text_seed: float = text_seed) -> str:
                return synthetic_text(random.Random(text_seed), num_words)

        ids = _source_ids(tokenizer, make_text, input_len)
        text, token_ids = cut_to_tokens(tokenizer, ids, input_len)
        prompts.append(Prompt(text=text, token_ids=token_ids, input_len=input_len, output_len=output_len))
    return prompts
