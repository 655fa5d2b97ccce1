"""Shared fixtures.

- ``ray_session``: one small local Ray cluster for every cluster test of the session.
- ``hf_reference``: Hugging Face ``generate``, greedy, on the same checkpoint with its stock attention: the
  outside reference every token-exactness test compares with (one loaded model per checkpoint and device).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import TEST_DEVICE


@pytest.fixture(scope="session")
def ray_session():
    # Imported here, not at the top, so the engine tests can also run where only torch is installed
    # (BUCKETSERVE_TEST_DEVICE=cuda on a GPU machine); a missing Ray still fails every cluster test.
    import ray

    # Small on purpose: the box is shared; workers take fractional CPUs.
    ray.init(num_cpus=4, include_dashboard=False, namespace="bucketserve-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


class HFReference:
    """One checkpoint under transformers' own model class and attention, fp32, unbatched."""

    def __init__(self, path: str, device: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
        """The greedy continuation of one prompt: up to ``max_new_tokens`` (stopping at EOS), or exactly that
        many with ``ignore_eos`` (as requests that ask to ignore EOS get)."""
        ids = torch.tensor([prompt_ids], device=self.device)  # [1, P]
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else None,
                do_sample=False,
                pad_token_id=self.tokenizer.eos_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def hf_reference() -> Callable[..., HFReference]:
    """``hf_reference(model="tiny", device=None)``: the reference for a built-in model name or a checkpoint
    folder, on ``device`` (default: the engine tests' device, ``BUCKETSERVE_TEST_DEVICE``)."""
    from engine.model_loader import resolve_model_path

    loaded: dict[tuple[str, str], HFReference] = {}

    def get(model: str | Path = "tiny", device: str | None = None) -> HFReference:
        path = str(resolve_model_path(str(model)))
        key = (path, device or TEST_DEVICE)
        if key not in loaded:
            loaded[key] = HFReference(*key)
        return loaded[key]

    return get
