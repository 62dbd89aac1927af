"""Which CPU class this machine is, from /proc/cpuinfo's flags: the key of the CPU-dependent
defaults (cpu_defaults.py) and what the low-bit kernel's build checks (lowbit/build.py). Its own
module so that both read it without importing each other.
"""
from __future__ import annotations

import enum
import functools
from pathlib import Path


class CpuClass(enum.Enum):
    AMX = "AMX"  # Sapphire, Emerald, Granite Rapids: AMX tiles, AVX512_BF16, VNNI
    AVX512_BF16 = "AVX512_BF16"  # Zen 4, Zen 5, Cooper Lake: bf16 and VNNI without AMX
    AVX512 = "AVX-512"  # Skylake-SP to Ice Lake: no bf16 arithmetic
    AVX2 = "AVX2"  # Zen 2, Zen 3, Haswell to Alder Lake
    OTHER = "other"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        with cpuinfo.open() as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return frozenset()


def classify(flags: frozenset[str]) -> CpuClass:
    if {"amx_tile", "amx_bf16"} <= flags:
        return CpuClass.AMX
    if "avx512_bf16" in flags:
        return CpuClass.AVX512_BF16
    if "avx512f" in flags:
        return CpuClass.AVX512
    if "avx2" in flags:
        return CpuClass.AVX2
    return CpuClass.OTHER


@functools.cache
def this_cpu() -> CpuClass:
    return classify(cpu_flags())
