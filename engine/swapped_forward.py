"""Whether a module runs one of our forwards: the fusions swap ``forward`` on the instance (a bound method in its
``__dict__``), never on the class, so a module of transformers' class keeps its own unless swapped."""

from __future__ import annotations

from collections.abc import Callable

import torch


def runs_forward(module: torch.nn.Module, fn: Callable) -> bool:
    """Whether ``module``'s forward was swapped for ``fn`` (bound to it, on the instance)."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is fn
