"""Regenerate the Python stubs of every ``proto/*.proto`` (run as ``python -m proto.generate``).

The generated modules import each other as top-level modules (``import kv_transfer_pb2``); they
are rewritten to package-relative imports so they load as ``proto.kv_transfer_pb2`` wherever the
package is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for each .proto into ``out_dir``."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(grpc_tools.__file__).resolve().parent / "_proto")
    written: list[Path] = []
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_DIR}",
                f"-I{include}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(proto),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto.name} (exit {rc})")
        stem = proto.stem
        for path in (out_dir / f"{stem}_pb2_grpc.py", out_dir / f"{stem}_pb2.py"):
            text = path.read_text()
            text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
            path.write_text(text)
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi", out_dir / f"{stem}_pb2_grpc.py"]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="where to write the stubs")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
