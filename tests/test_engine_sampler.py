"""Sampling: greedy, seeded reproducibility, top-k/top-p limits, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler


def _req(rid: str, **kw) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**kw))


def test_greedy_and_degenerate_filters_pick_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    reqs = [_req("g"), _req("k", temperature=1.0, top_k=1), _req("p", temperature=1.0, top_p=1e-6), _req("t")]
    tokens, lp = Sampler()(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()
    assert lp is None


def test_seeded_sampling_is_reproducible_and_respects_top_k() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(logits[0], 5).indices.tolist())

    def draw(seed: int) -> list[int]:
        s, r = Sampler(), _req("s", temperature=1.5, top_k=5, seed=seed)
        return [s(logits, [r])[0][0] for _ in range(30)]

    a, b, c = draw(7), draw(7), draw(8)
    assert a == b and a != c
    assert set(a) <= allowed and len(set(a)) > 1


def test_logprobs_of_chosen_tokens() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(2))
    tokens, lp = Sampler()(logits, [_req("a", logprobs=True), _req("b")])
    expected = torch.log_softmax(logits, -1)[torch.arange(2), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(lp), expected)


def test_a_tiny_temperature_samples_the_argmax_instead_of_failing() -> None:
    """A temperature just above 0 (valid API input) once overflowed the scaled logits to NaN and failed the step."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3)) * 30
    reqs = [_req(str(t), temperature=t, seed=1) for t in (1e-300, 5e-324, 1e-40)]
    reqs.append(_req("p", temperature=5e-324, top_p=5e-324, top_k=3))
    tokens, _ = Sampler()(torch.cat([logits, logits[:1]]), reqs)
    assert tokens == torch.cat([logits, logits[:1]]).argmax(-1).tolist()


@pytest.mark.parametrize(("vocab", "parts"), [(128256, 64), (151936, 64), (65536, 64), (8200, 8), (4096, 1)])
def test_split_greedy_is_argmax_ties_and_nan_included(vocab: int, parts: int) -> None:
    """The split argmax picks what ``argmax`` picks, the first index among equal maxima and a NaN as argmax does,
    in as many parts as ``split_count`` makes (none under 1,024 logits) or forced into 8."""
    from engine.sampler import greedy_tokens, split_count

    assert split_count(vocab) == parts
    splits = max(parts, 8)
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    logits[1, [7, vocab // 2, vocab - 1]] = 50.0  # ties across parts: the first wins
    logits[2, [vocab - 3, vocab - 2]] = 50.0  # ties within the last part
    logits[3] = 0.0  # every logit equal: index 0
    logits[4, vocab // 3] = float("nan")
    want = logits.argmax(-1)
    assert want[1] == 7 and want[2] == vocab - 3 and want[3] == 0
    assert torch.equal(greedy_tokens(logits, splits), want)
    assert torch.equal(greedy_tokens(logits.bfloat16(), splits), logits.bfloat16().argmax(-1))
    # unsplit, as the CPU runs it (a max reduction, not argmax): the same indices
    assert torch.equal(greedy_tokens(logits), want)
    assert torch.equal(greedy_tokens(logits.bfloat16()), logits.bfloat16().argmax(-1))
    lead_nan = logits[:1].clone()
    lead_nan[0, [3, 9]] = float("nan")  # the first NaN wins, as argmax's
    assert greedy_tokens(lead_nan).item() == lead_nan.argmax(-1).item() == 3
    with pytest.raises(RuntimeError):
        greedy_tokens(logits[:, : vocab - 1], 64)  # a split that does not divide V is refused, not rounded
