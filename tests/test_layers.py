"""The one-way import rule of the layout (docs/lifecycle.md, README "Layout"), checked by parsing every
module of the repository: no import runs up a layer, the two worker roles never import each other,
nothing of the product imports bench/, and no two modules import each other, directly or round a circle.

Every import counts, also one inside a function: a lazy import still ties two modules together."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom. A package may import the packages below it, never one above it or beside it.
LAYERS: list[tuple[str, ...]] = [
    ("bench",),
    ("gateway",),
    ("prefill_worker", "decode_worker"),
    ("worker",),
    ("kv_transfer",),
    ("engine",),
    ("bucket_manager",),
]
# Beside the stack: imported by those that use it, importing nothing of ours.
MONITOR_USERS = {"bench", "gateway", "prefill_worker", "decode_worker", "worker"}
PROTO_USERS = {"bench", "kv_transfer"}
PACKAGES = {p for layer in LAYERS for p in layer} | {"monitor", "proto"}
# Policy code works on ints and lists: no tensors, no actors, no I/O (the controller actor shell aside).
PURE = {"bucket_manager"}
# The controller actor shell, its socket to the prefill workers (they import it from below: one wire format) and
# the local listener that socket and the workers' output sockets stand on.
PURE_EXEMPT = {"bucket_manager.controller", "bucket_manager.dispatch_socket", "bucket_manager.local_socket"}
IMPURE = {"torch", "ray", "numpy", "grpc", "redis", "httpx", "asyncio", "socket", "subprocess"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in sorted(PACKAGES):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports (absolute names; relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import module` names the module; `from pkg import name` the package itself.
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.add(sub if sub in MODULES else mod)
    return out


def _ours(mod: str) -> str | None:
    """The project module that `mod` names (a package counts as its __init__), or None if not ours."""
    while mod:
        if mod in MODULES:
            return mod
        mod = mod.rpartition(".")[0]
    return None


GRAPH = {
    name: {o for m in _imports(name, path) if (o := _ours(m)) and o != name} for name, path in MODULES.items()
}


def _top(mod: str) -> str:
    return mod.split(".")[0]


def _layer(pkg: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if pkg in layer)


def _violation(src: str, dst: str) -> str | None:
    a, b = _top(src), _top(dst)
    if a == b:
        return None
    if b == "bench":
        return "nothing of the product imports bench/"
    if a == "monitor":
        return "monitor imports nothing of ours"
    if b == "monitor":
        return None if a in MONITOR_USERS else f"{a} does not report to the monitor by import"
    if a == "proto":
        return "proto imports nothing of ours"
    if b == "proto":
        return None if a in PROTO_USERS else f"only kv_transfer speaks the KV wire format ({a} imports proto)"
    la, lb = _layer(a), _layer(b)
    if la == lb:
        return f"{a} and {b} are siblings and never import each other"
    if lb < la:
        return f"{a} sits below {b}: imports run top to bottom"
    return None


def test_every_package_is_parsed() -> None:
    # A rename that left a package out of the check would make every other test here pass vacuously.
    assert {_top(m) for m in MODULES} == PACKAGES
    assert len(MODULES) > 60


def test_no_import_runs_up_or_sideways() -> None:
    bad = [
        f"{src} -> {dst}: {why}"
        for src, deps in sorted(GRAPH.items())
        for dst in sorted(deps)
        if (why := _violation(src, dst))
    ]
    assert not bad, "imports against the one-way rule:\n" + "\n".join(bad)


def test_policy_code_is_pure() -> None:
    bad = []
    for name, path in MODULES.items():
        if _top(name) in PURE and name not in PURE_EXEMPT:
            third = {m.split(".")[0] for m in _imports(name, path)} & IMPURE
            if third:
                bad.append(f"{name} imports {sorted(third)}")
    assert not bad, "policy modules must stay pure Python:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ("prefill_worker.worker", "decode_worker.worker", "siblings"),
        ("gateway.cli", "bench.cli", "imports bench"),
        ("engine.llm_engine", "worker.actor", "below"),
        ("monitor.monitor", "engine.config", "imports nothing"),
        ("bucket_manager.controller", "monitor.monitor", "does not report"),
        ("worker.actor", "engine.llm_engine", None),
        ("bench.sweep", "gateway.cli", None),
    ],
)
def test_the_rule_itself(src: str, dst: str, expected: str | None) -> None:
    # The checker must be able to fail: known bad edges are named, known good ones pass.
    why = _violation(src, dst)
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why


def test_a_circle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_nothing_reads_outside_the_repository() -> None:
    # A fresh clone has nothing beside it: no module or test may reach for the folder beside the repository
    # where development material lives. (The needle is built here so that this file does not name it.)
    needle = "/".join((os.pardir, "sha" + "red"))
    here = Path(__file__).resolve()
    files = [*MODULES.values(), *(p for p in (ROOT / "tests").rglob("*.py") if p.resolve() != here)]
    bad = [str(p.relative_to(ROOT)) for p in files if needle in p.read_text(errors="ignore")]
    assert not bad, f"files reading outside the repository: {bad}"


def test_worker_actor_modules_load_without_torch() -> None:
    # Every process that receives a worker's actor handle (the controller, each gateway replica) imports the
    # actor's class module: it must not pull in torch and transformers (seconds of the controller's start).
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import prefill_worker.worker, decode_worker.worker, worker.colocated\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
