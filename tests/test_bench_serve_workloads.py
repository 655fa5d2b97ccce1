"""Benchmark prompts: exact token lengths with the model's tokenizer, real and synthetic text, and
reproducible requests (lengths, text, arrival times, classes) from a seed."""

from __future__ import annotations

import pytest

from bench.workload_requests import assign_priorities, make_requests, parse_priority_mix
from bench.workloads import (
    DEFAULT_DATASET,
    SHORT_LIMIT,
    WORKLOADS,
    build_prompts,
    cut_to_tokens,
    load_alpaca_texts,
    sample_arrivals,
    sample_lengths,
)


@pytest.fixture(scope="module")
def tokenizer():
    from engine.model_loader import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def alpaca_texts():
    return load_alpaca_texts(DEFAULT_DATASET)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_prompts_have_exact_token_lengths(workload, tokenizer, alpaca_texts):
    lengths = sample_lengths(workload, 30, seed=5, max_model_len=2048)
    prompts = build_prompts(workload, lengths, tokenizer, seed=5, alpaca_texts=alpaca_texts)
    assert [(p.input_len, p.output_len) for p in prompts] == lengths
    for p in prompts:
        ids = tokenizer.encode(p.text, add_special_tokens=False)
        assert len(ids) == p.input_len, (workload, p.input_len, len(ids))
        assert list(ids) == p.token_ids
    # Different requests get different text, not one prompt cut many ways.
    assert len({p.text[:200] for p in prompts}) >= 25


def test_alpaca_prompts_are_the_seed_tasks_and_long_ones_synthetic(tokenizer, alpaca_texts):
    lengths = [(40, 4), (SHORT_LIMIT + 900, 4)]
    short, long = build_prompts("mixed", lengths, tokenizer, seed=1, alpaca_texts=alpaca_texts)
    assert any(t.startswith(short.text[:60]) for t in alpaca_texts)
    assert not any(long.text[:60] in t for t in alpaca_texts)
    with pytest.raises(ValueError, match="Alpaca"):
        build_prompts("alpaca", [(10, 2)], tokenizer, seed=1, alpaca_texts=None)
    # longbench needs no dataset
    (p,) = build_prompts("longbench", [(3000, 2)], tokenizer, seed=1)
    assert len(tokenizer.encode(p.text, add_special_tokens=False)) == 3000


def test_missing_dataset_has_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--dataset"):
        load_alpaca_texts(tmp_path / "missing.jsonl")


def test_cut_to_tokens_retries_when_a_cut_does_not_round_trip():
    class Chars:
        """Characters are tokens, except "ab", which always tokenizes as one."""

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            out, i = [], 0
            while i < len(text):
                if text.startswith("ab", i):
                    out.append(1000)
                    i += 2
                else:
                    out.append(ord(text[i]))
                    i += 1
            return out

        def decode(self, ids: list[int], **kwargs) -> str:
            return "".join("ab" if i == 1000 else chr(i) for i in ids)

    tok = Chars()
    ids = [ord(c) for c in "xab"] + [ord(c) for c in "cd"]  # "x","a","b","c","d": a cut of 3 merges "ab"
    text, got = cut_to_tokens(tok, ids, 3)
    assert len(tok.encode(text)) == 3 and got == tok.encode(text)
    with pytest.raises(ValueError, match="at least"):
        cut_to_tokens(tok, ids, 9)


def test_requests_are_reproducible_from_the_seed(tokenizer, alpaca_texts):
    def make(seed: int):
        return make_requests(
            "mixed",
            20,
            4.0,
            tokenizer,
            seed=seed,
            burstiness=0.5,
            online_share=0.7,
            alpaca_texts=alpaca_texts,
        )

    a, b, c = make(11), make(11), make(12)
    assert a == b
    assert [r.send_at for r in a] != [r.send_at for r in c]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert a[0].send_at > 0 and all(x.send_at < y.send_at for x, y in zip(a, a[1:], strict=False))
    assert {r.priority for r in a} == {"online", "offline"}


def test_arrivals_follow_the_rate_and_burstiness():
    n, rate = 4000, 8.0
    for burstiness in (1.0, 0.25):
        times = sample_arrivals(n, rate, seed=2, burstiness=burstiness)
        assert times == sample_arrivals(n, rate, seed=2, burstiness=burstiness)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        mean = sum(gaps) / n
        cv2 = sum((g - mean) ** 2 for g in gaps) / n / mean**2
        assert mean == pytest.approx(1 / rate, rel=0.08)
        # A gamma gap's squared coefficient of variation is 1 / shape.
        assert cv2 == pytest.approx(1 / burstiness, rel=0.2)
    assert sample_arrivals(5, float("inf"), seed=0) == [0.0] * 5


def test_priority_mix_parsing_and_shares():
    assert parse_priority_mix(None) is None
    assert parse_priority_mix("3:1") == 0.75
    assert parse_priority_mix("0:1") == 0.0
    for bad in ("3", "a:b", "0:0", "-1:2", "1:2:3"):
        with pytest.raises(ValueError, match="priority-mix"):
            parse_priority_mix(bad)
    classes = assign_priorities(2000, 0.75, seed=4)
    assert classes == assign_priorities(2000, 0.75, seed=4)
    assert classes.count("online") / 2000 == pytest.approx(0.75, abs=0.04)
    assert assign_priorities(3, None, seed=0) == [None] * 3
