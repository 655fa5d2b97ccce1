"""Sampling: greedy, seeded reproducibility, top-k/top-p limits, logprobs."""

from __future__ import annotations

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
