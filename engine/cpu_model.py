"""The CPU's vendor, family and model as the operating system reports them (Linux's ``/proc/cpuinfo``), for the
few policies that differ between generations of one instruction set (``engine.skinny_rows``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

AMD = "AuthenticAMD"
# AMD family 17h: Zen and Zen+ at models 00h-2Fh, Zen 2 from 30h on (Rome 31h, Renoir 60h, Matisse 71h, ...).
AMD_FAMILY_17H = 23
ZEN2_FIRST_MODEL = 0x30


@dataclass(frozen=True)
class CpuModel:
    vendor: str  # "AuthenticAMD", "GenuineIntel"; "" where the system does not say
    family: int  # 0 where unknown
    model: int

    @property
    def amd_zen2(self) -> bool:
        return self.vendor == AMD and self.family == AMD_FAMILY_17H and self.model >= ZEN2_FIRST_MODEL


UNKNOWN = CpuModel("", 0, 0)


def parse_cpuinfo(text: str) -> CpuModel:
    """The first processor's vendor, family and model in ``/proc/cpuinfo``'s text (decimal fields)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: the cores of one socket agree
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    try:
        return CpuModel(
            fields.get("vendor_id", ""), int(fields.get("cpu family", 0)), int(fields.get("model", 0))
        )
    except ValueError:
        return UNKNOWN


@functools.cache
def host_cpu() -> CpuModel:
    """This host's CPU (``UNKNOWN`` where there is no ``/proc/cpuinfo`` to read: then no generation's rule
    applies)."""
    path = Path("/proc/cpuinfo")
    try:
        return parse_cpuinfo(path.read_text())
    except OSError:
        return UNKNOWN
