"""``bucketserve bench <kind>``: benchmarks. Each kind lives in ``bench/<kind>.py`` with ``register``."""

from __future__ import annotations

import importlib

# kind -> module exposing register(subparsers)
_KINDS = {
    "offline": "bench.offline",
    "kv": "bench.kv",
    "serve": "bench.serve",
    "sweep": "bench.sweep",
    "monitor": "bench.monitor_overhead",
    "latency": "bench.latency",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: offline, kv, serve, sweep, monitor, latency")
    kinds = p.add_subparsers(dest="bench_kind", metavar="KIND")
    for module in _KINDS.values():
        try:
            importlib.import_module(module).register(kinds)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
