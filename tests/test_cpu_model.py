"""The CPU identity read from /proc/cpuinfo's text (a pure parse), and this host's reading against the system's."""

from __future__ import annotations

import pytest
from engine_helpers import cpuinfo_field

from engine.cpu_model import UNKNOWN, CpuModel, host_cpu, parse_cpuinfo


def _cpuinfo(vendor: str, family: int, model: int, processors: int = 2) -> str:
    block = (
        "processor\t: {n}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        "model name\t: some CPU\nflags\t\t: fpu sse avx2\n"
    )
    return "\n".join(block.format(n=n, vendor=vendor, family=family, model=model) for n in range(processors))


@pytest.mark.parametrize(
    ("vendor", "family", "model", "zen2"),
    [
        ("AuthenticAMD", 23, 49, True),  # EPYC Rome
        ("AuthenticAMD", 23, 113, True),  # Ryzen 3000 (Matisse)
        ("AuthenticAMD", 23, 48, True),  # the first Zen 2 model number
        ("AuthenticAMD", 23, 8, False),  # Zen+
        ("AuthenticAMD", 23, 1, False),  # Zen
        ("AuthenticAMD", 25, 1, False),  # Zen 3
        ("AuthenticAMD", 25, 17, False),  # Zen 4
        ("HygonGenuine", 24, 49, False),
        ("GenuineIntel", 6, 207, False),
    ],
)
def test_zen2_is_amd_family_17h_from_model_30h(vendor, family, model, zen2) -> None:
    cpu = parse_cpuinfo(_cpuinfo(vendor, family, model))
    assert cpu == CpuModel(vendor, family, model)
    assert cpu.amd_zen2 is zen2


def test_the_first_processor_speaks_for_the_host() -> None:
    text = _cpuinfo("AuthenticAMD", 23, 49, processors=1) + "\n\n" + _cpuinfo("GenuineIntel", 6, 207, 1)
    assert parse_cpuinfo(text) == CpuModel("AuthenticAMD", 23, 49)


@pytest.mark.parametrize(
    "text", ["", "processor : 0\n", "vendor_id : AuthenticAMD\ncpu family : x17\nmodel : 49\n"]
)
def test_what_cannot_be_read_is_unknown_and_no_generation(text) -> None:
    cpu = parse_cpuinfo(text)
    assert cpu.family == 0 or cpu == UNKNOWN
    assert not cpu.amd_zen2


def test_this_hosts_reading_is_the_systems() -> None:
    cpu = host_cpu()
    assert cpu.vendor == cpuinfo_field("vendor_id")
    assert cpu.family == int(cpuinfo_field("cpu family") or 0)
    assert cpu.model == int(cpuinfo_field("model") or 0)
