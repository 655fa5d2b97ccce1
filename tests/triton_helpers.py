"""Where the Triton kernel tests run: on an NVIDIA GPU, or on the CPU under Triton's interpreter (Triton installed
and ``TRITON_INTERPRET=1`` in the environment, which makes every ``@triton.jit`` kernel run in Python); the CI host
has neither, so there those tests are skipped with that reason."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if torch.cuda.is_available():
    TRITON_DEVICE: str | None = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    TRITON_DEVICE = "cpu"
else:
    TRITON_DEVICE = None

needs_triton = pytest.mark.skipif(
    TRITON_DEVICE is None,
    reason="needs an NVIDIA GPU, or Triton installed and TRITON_INTERPRET=1 (its interpreter runs the kernel on "
    "the CPU)",
)
