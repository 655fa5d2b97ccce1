"""Build (once) and load the C++ CPU kernels; ``None`` for a kernel that cannot be had.

Each kernel source is compiled into its own library under ``$BUCKETSERVE_CACHE/extensions/<hash>``, the hash
covering the source, the headers beside it, the torch version, the compiler flags and the CPU capability torch
detected, so a cache folder shared between machines or torch upgrades never loads a stale or foreign binary.
Loading is once per process; each library registers its operator under ``torch.ops.bucketserve_cpu``:
``paged_attention`` (``paged_attention_cpu.cpp``), ``skinny_linear`` (``skinny_linear_cpu.cpp``), ``rms_norm``
(``rms_norm_cpu.cpp``), ``rope_write_kv`` (``rotary_cpu.cpp``), ``decoder_layers`` (``decoder_stack_cpu.cpp``,
which calls the four before it) and ``fresh_attention_amx`` (``fresh_attention_amx.cpp``).

``python -m engine.kernels.build`` prebuilds them (``make install`` does), so a server start only loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.model_builder import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
SKINNY_LINEAR_SOURCE = Path(__file__).with_name("skinny_linear_cpu.cpp")
RMS_NORM_SOURCE = Path(__file__).with_name("rms_norm_cpu.cpp")
ROTARY_SOURCE = Path(__file__).with_name("rotary_cpu.cpp")
DECODER_STACK_SOURCE = Path(__file__).with_name("decoder_stack_cpu.cpp")
FRESH_ATTENTION_SOURCE = Path(__file__).with_name("fresh_attention_amx.cpp")
OP_NAMESPACE = "bucketserve_cpu"

# Vector ISA flags per capability torch itself detected on this CPU (what its own kernels dispatch to),
# not -march=native: native also tunes for and may emit instructions of this exact CPU model, and the
# capability (part of the hash) then would not describe the binary. ATen's Vectorized<float> picks its
# 512- or 256-bit implementation from the CPU_CAPABILITY_* macro; with neither it is a portable scalar
# version (still correct). The inline namespace is renamed so our instantiations never collide with
# the ones inside libtorch.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"],
}

_loaded: dict[str, Callable[..., Any] | None] = {}
_fakes_registered: set[str] = set()


def _flags() -> list[str]:
    cap = torch.backends.cpu.get_cpu_capability()
    isa = _ISA_FLAGS.get(cap, [])
    return ["-O3", "-DCPU_CAPABILITY=bucketserve_" + (cap.lower() if isa else "default"), *isa, *_openmp()]


def _openmp() -> list[str]:
    # With torch's OpenMP backend, at::parallel_for is an inline `#pragma omp parallel`: without -fopenmp it
    # silently runs on one thread. libgomp.so.1 is then the one torch already loaded (same soname), so the
    # kernel and torch's own operators share one thread pool.
    return ["-fopenmp"] if torch._C.has_openmp else []


def build_dir(source: Path = SOURCE) -> Path:
    h = hashlib.sha256()
    for path in [source, *sorted(source.parent.glob("*.h"))]:  # the source and the headers beside it
        h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_flags()).encode())
    h.update(sys.version.split()[0].encode())
    return cache_root() / "extensions" / h.hexdigest()[:16]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _warn(msg: str) -> None:
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def load(source: Path = SOURCE, op: str = "paged_attention") -> Callable[..., Any] | None:
    """The compiled operator ``op`` of ``source``, or None (with a warning) when no compiler is found or the
    build fails."""
    key = str(source)
    if key in _loaded:
        return _loaded[key]
    compiled = _build_and_load(source, op)
    _loaded[key] = compiled
    return compiled


def load_skinny_linear() -> Callable[..., Any] | None:
    """``skinny_linear(x, panels, bias, n)``, or None: callers then keep oneDNN for every linear."""
    return load(SKINNY_LINEAR_SOURCE, "skinny_linear")


def load_rms_norm() -> Callable[..., Any] | None:
    """``rms_norm(x, weight, eps)``, or None: RMSNorm layers then keep ``F.rms_norm``."""
    return load(RMS_NORM_SOURCE, "rms_norm")


def load_rotary() -> Callable[..., Any] | None:
    """``rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)``, or None:
    attention layers then keep their own forward."""
    return load(ROTARY_SOURCE, "rope_write_kv")


def load_decoder_stack() -> Callable[..., Any] | None:
    """``decoder_layers(hidden, cos, sin, kv_data, ..., tensors, ints, floats, max_rows)``, or None: the decoder
    stack then walks the layers in Python."""
    return load(DECODER_STACK_SOURCE, "decoder_layers")


def load_fresh_attention() -> Callable[..., Any] | None:
    """``fresh_attention_amx(out, q, k_cache, v_cache, blocks, start, n, scale)``, or None: fresh bf16 prompts
    then attend through torch's SDPA (``engine.kernels.fresh_prefill``)."""
    return load(FRESH_ATTENTION_SOURCE, "fresh_attention_amx")


# Every kernel: (source, the operator its library registers).
KERNELS = (
    (SOURCE, "paged_attention"),
    (SKINNY_LINEAR_SOURCE, "skinny_linear"),
    (RMS_NORM_SOURCE, "rms_norm"),
    (ROTARY_SOURCE, "rope_write_kv"),
    (DECODER_STACK_SOURCE, "decoder_layers"),
    (FRESH_ATTENTION_SOURCE, "fresh_attention_amx"),
)


def prebuild(stop: threading.Event | None = None) -> int:
    """Compile every kernel not yet built for this source, torch and CPU, side by side, each in a process of its
    own (which loads nothing into this one), so that the loads which follow find them built; returns how many
    were compiled. Loaded one after another, the four took 67 s on one core of a 2-core Xeon, and both workers of
    a fresh ``serve`` waited for them in turn; side by side, 41.5 s. Setting ``stop`` stops the compilers and
    returns at once (a server whose start-up failed does not wait for them)."""
    missing = [op for source, op in KERNELS if source.is_file() and not _library_path(source).is_file()]
    if not missing or _compiler() is None:
        return 0
    import atexit

    t0 = time.perf_counter()
    # Each in a process group of its own, so that stopping it stops its compiler too.
    children = [
        subprocess.Popen([sys.executable, "-m", "engine.kernels.build", "--only", op], start_new_session=True)
        for op in missing
    ]
    # A caller that exits first (a server stopped during start-up) takes its compilers with it.
    atexit.register(_stop_children, children)
    while stop is not None and any(child.poll() is None for child in children):
        if stop.wait(0.2):
            _stop_children(children)
            log.info("stopped compiling the CPU kernels")
            return 0
    built = sum(child.wait() == 0 for child in children)
    log.info("compiled %d of %d CPU kernels in %.1f s", built, len(missing), time.perf_counter() - t0)
    return built


def _stop_children(children: list) -> None:
    """Stop the compiling children still running, and their compilers (each child leads its process group)."""
    import signal

    running = [child for child in children if child.poll() is None]
    for child in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
    for child in running:
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)


def _what(op: str) -> str:
    return op.replace("_", " ") + " kernel"


def _library_name(source: Path) -> str:
    return "bucketserve_" + source.stem.removesuffix("_cpu")


def _build_and_load(source: Path, op: str) -> Callable[..., Any] | None:
    if not source.is_file():
        _warn(f"{_what(op)}: source {source} is missing; using its fallback")
        return None
    target = build_dir(source)
    t0 = time.perf_counter()
    if not _load_built(source, op) and not _build(source, target, op):
        return None
    _register_fakes(op)
    log.info("%s loaded from %s in %.1f s", _what(op), target, time.perf_counter() - t0)
    return getattr(getattr(torch.ops, OP_NAMESPACE), op)


def _library_path(source: Path) -> Path:
    """Where the library of ``source`` built for this source, torch and flags lies."""
    return build_dir(source) / f"{_library_name(source)}.so"


def _load_built(source: Path, op: str) -> bool:
    """A binary already built for this exact source, torch and flags loads without compiler or ninja."""
    library = _library_path(source)
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except Exception as e:  # e.g. a build interrupted mid-link: build again (which warns if it fails too)
        log.warning("%s: cannot load %s (%s); rebuilding", _what(op), library, e)
        return False
    return True


def _build(source: Path, target: Path, op: str) -> bool:
    if _compiler() is None:
        _warn(f"{_what(op)}: no C++ compiler found; using its fallback")
        return False
    try:
        from torch.utils import cpp_extension

        target.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=_library_name(source),
            sources=[str(source)],
            extra_cflags=_flags(),
            extra_ldflags=_openmp(),
            build_directory=str(target),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # a compiler error, a missing header, a linker failure: all mean "fall back"
        _warn(f"{_what(op)}: build failed ({type(e).__name__}: {str(e)[-500:]}); using the fallback")
        return False
    return True


def _register_fakes(op: str) -> None:
    # Lets torch.compile trace the operators as opaque: their output shapes, no data.
    if op in _fakes_registered:
        return
    _fakes_registered.add(op)
    lib = f"{OP_NAMESPACE}::"
    if op == "paged_attention":

        @torch.library.register_fake(lib + "paged_attention")
        def _attention(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale) -> None:
            return None  # it only writes ``out``

    elif op == "skinny_linear":

        @torch.library.register_fake(lib + "skinny_linear")
        def _skinny(x, panels, bias, n):
            return x.new_empty(x.shape[0], n)

        @torch.library.register_fake(lib + "skinny_silu_mul")
        def _skinny_silu_mul(x, panels, n):
            return x.new_empty(x.shape[0], n)

        @torch.library.register_fake(lib + "packed_linear")
        def _packed(x, panels, bias, n, index, max_rows):
            return x.new_empty(x.shape[0], n)

        @torch.library.register_fake(lib + "gated_linear")
        def _gated(x, panels, n, gate_index, up_index, max_rows):
            return x.new_empty(x.shape[0], n)

    elif op == "fresh_attention_amx":

        @torch.library.register_fake(lib + "fresh_attention_amx")
        def _fresh(out, q, k_cache, v_cache, blocks, start, n, scale) -> None:
            return None  # it only writes ``out``

    elif op == "rms_norm":

        @torch.library.register_fake(lib + "rms_norm")
        def _rms_norm(x, weight, eps):
            return torch.empty_like(x, memory_format=torch.contiguous_format)

    elif op == "rope_write_kv":

        @torch.library.register_fake(lib + "rope_write_kv")
        def _rope(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
            return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[-1])


def main(argv: list[str] | None = None) -> int:
    """Prebuild; exit 0 either way, since the engine runs (slower) on the fallback. ``--only OP``: build that
    one kernel here (``prebuild``'s child processes), exit 1 if it fails."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine.kernels.build")
    parser.add_argument("--only", choices=[op for _, op in KERNELS], help="build this kernel only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.only:
        source = next(src for src, op in KERNELS if op == args.only)
        return 0 if _build(source, build_dir(source), args.only) else 1
    prebuild()
    for source, op in KERNELS:
        load(source, op)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
