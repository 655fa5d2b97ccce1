"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds; logprobs of chosen tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` for any temperature > 0, however small: shifted so the largest is 0 and divided
    in float64, so a tiny temperature sends the others to -inf instead of every value to inf or NaN (a float32
    temperature below ~1e-45 is 0), and sampling tends to greedy as it should."""
    shifted = logits.double() - logits.max().double()
    return (shifted / temperature).to(logits.dtype)


def split_count(vocab: int) -> int:
    """Parts a split greedy argmax cuts ``vocab`` logits into: the most of 64, 32, 16 or 8 that divide it into
    parts of at least 1,024; 1 (one reduction) when none does."""
    for splits in (64, 32, 16, 8):
        if vocab % splits == 0 and vocab // splits >= 1024:
            return splits
    return 1


def greedy_tokens(logits: torch.Tensor, splits: int = 1) -> torch.Tensor:
    """``logits.argmax(-1)`` [N] of logits [N, V], ties to the first index as argmax's, in ``splits`` parts: the
    argmax of each part, then of the parts' maxima (a GPU runs one block per row in a plain argmax: 29 us over
    128,256 logits on an H200, against a few for the split one). ``splits`` must divide V."""
    if splits <= 1:
        if logits.device.type == "cpu":
            # The same first-maximum index (NaN counting as the maximum, as argmax's), from ATen's max reduction:
            # 3-4x faster on the CPU (2-core Xeon, [128, 4096] fp32: 109 against 332 us; [8, 4096]: 10 against 42).
            return logits.max(-1).indices
        return logits.argmax(-1)
    n, v = logits.shape
    parts = logits.view(n, splits, v // splits)  # [N, S, V / S]
    local = parts.argmax(-1)  # [N, S]: first maximum within each part
    best = parts.gather(-1, local.unsqueeze(-1)).squeeze(-1)  # [N, S]: each part's maximum
    part = best.argmax(-1, keepdim=True)  # [N, 1]: the first part holding the maximum
    return part.squeeze(-1) * (v // splits) + local.gather(-1, part).squeeze(-1)  # [N]


class Sampler:
    def __init__(self, default_seed: int = 0, greedy_splits: int = 1) -> None:
        """``greedy_splits``: parts of the greedy argmax (``greedy_tokens``), the device's choice."""
        self.default_seed = default_seed
        self.greedy_splits = greedy_splits
        # One generator per seeded request, so its samples do not depend on its batch neighbours.
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            seed = (
                req.sampling.seed
                if req.sampling.seed is not None
                else hash((self.default_seed, req.request_id))
            )
            gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF)
            self._generators[req.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> tuple[list[int], list[float] | None]:
        """logits: [N, vocab] fp32. Returns the chosen token per request and, if any asks, logprobs."""
        greedy = greedy_tokens(logits, self.greedy_splits)  # [N]
        tokens = greedy.tolist()
        for i, r in enumerate(reqs):
            if not r.sampling.greedy:
                tokens[i] = self._sample_one(logits[i], r)
        want_logprobs = any(r.sampling.logprobs for r in reqs)
        logprobs = None
        if want_logprobs:
            lp = torch.log_softmax(logits, dim=-1)  # [N, vocab]
            logprobs = lp.gather(1, torch.tensor(tokens, device=lp.device).view(-1, 1)).view(-1).tolist()
        return tokens, logprobs

    def _sample_one(self, logits: torch.Tensor, req: Request) -> int:
        sp = req.sampling
        x = _scaled(logits.cpu(), sp.temperature)  # [vocab]
        if sp.top_k > 0 and sp.top_k < x.numel():
            kth = torch.topk(x, sp.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = cum - sorted_p > sp.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self._generator(req)).item())
