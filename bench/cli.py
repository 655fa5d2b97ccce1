"""``bucketserve bench <kind>``: benchmarks. Each kind lives in ``bench/<kind>.py`` with ``register``.

The product's command line reaches this module by name (``gateway/cli.py``); nothing of the product imports it.
"""

from __future__ import annotations

import importlib

from gateway.cli import add_unavailable

# kind -> module exposing register(subparsers)
_KINDS = {
    "offline": "bench.offline",
    "kv": "bench.kv",
    "serve": "bench.serve",
    "sweep": "bench.sweep",
    "monitor": "bench.monitor_overhead",
    "latency": "bench.latency",
    "roofline": "bench.roofline",
    "gpu": "bench.gpu",
    "soak": "bench.soak",
    "prefill-memory": "bench.prefill_memory",
    "fused-attention": "bench.fused_attention",
}
# Libraries of the ``bench`` extra: a kind that needs a missing one says so when it is run.
_EXTRA = {"httpx", "matplotlib"}


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: offline, kv, serve, sweep, monitor, latency, roofline, gpu, soak, prefill-memory, "
        "fused-attention",
    )
    kinds = p.add_subparsers(dest="bench_kind", metavar="KIND")
    for kind, module in _KINDS.items():
        try:
            importlib.import_module(module).register(kinds)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            if (e.name or "").split(".")[0] not in _EXTRA:
                raise
            message = f"`bucketserve bench {kind}` needs {e.name}: pip install 'bucketserve[bench]'"
            add_unavailable(kinds, kind, f"(unavailable: needs {e.name})", message)
