"""Compile lowbit_matmul.cpp (and the headers it includes) into an OpenVINO extension library for
one instruction set's path, and find it again: once per source, OpenVINO, path and compiler.

Built on the machine that runs it rather than shipped: an extension must be built against the
OpenVINO it is loaded into, and the headers and libraries come with the openvino wheel. Where a
library is looked for, in order: `$VINOSERVE_KERNEL_DIR` (built ahead, e.g. by the Docker image's
build with `python -m vinoserve.model.lowbit.build DIR`, where no volume hides it), then the cache
(built on first use). Where no C++ compiler is found, the CPU has none of the paths' instructions,
or a library does not load, the plugin's own matmuls run; `Unavailable` says why, in one line.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openvino as ov

from vinoserve.model.cpu_class import cpu_flags
from vinoserve.model.storage import cache_root

SOURCE = Path(__file__).with_name("lowbit_matmul.cpp")
HEADERS = sorted(SOURCE.parent.glob("*.hpp"))  # included by SOURCE: part of what a build is keyed on
NAME = "liblowbit_matmul.so"
KERNEL_DIR = "VINOSERVE_KERNEL_DIR"  # libraries built ahead of time, looked for before the cache
ISA_VARIABLE = "VINOSERVE_LOWBIT_ISA"  # forces one path (tests; measuring one path on another CPU)
# No contraction of a * b + c into one fma where the source does not ask for one: the gather's
# q * scale + offset rounds twice, as the graph's Multiply and Add (and numpy) do.
_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off"]


class Unavailable(RuntimeError):
    """Why the kernel cannot be used here (one line)."""


@dataclass(frozen=True)
class Isa:
    """One instruction set's path of the kernel: the CPU flags it needs and its compiler flags."""

    name: str
    needs: frozenset[str]
    flags: tuple[str, ...]


# In order of preference. AVX-512 VNNI: Cascade Lake and later Xeons, Zen 4 and later; AVX-512
# without VNNI: Skylake-SP; AVX-VNNI on ymm: Alder Lake and later, Zen 5; AVX2: every x86-64 CPU
# since Haswell and Zen 1.
ISAS = (
    Isa("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"}),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma")),
    Isa("avx512bw", frozenset({"avx512f", "avx512bw", "avx512vl", "f16c", "fma"}),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c", "-mfma")),
    Isa("avxvnni", frozenset({"avx2", "avx_vnni", "f16c", "fma"}),
        ("-mavx2", "-mavxvnni", "-mf16c", "-mfma", "-DVINOSERVE_LOWBIT_AVX2")),
    Isa("avx2", frozenset({"avx2", "f16c", "fma"}), ("-mavx2", "-mf16c", "-mfma", "-DVINOSERVE_LOWBIT_AVX2")),
)
NEEDED_FLAGS = ISAS[-1].needs  # the least any path needs


def isa(flags: frozenset[str] | None = None) -> Isa:
    """The path this CPU runs: `$VINOSERVE_LOWBIT_ISA`'s where set, else the first it has the
    instructions of; raises Unavailable."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get(ISA_VARIABLE)
    if forced:
        chosen = next((i for i in ISAS if i.name == forced), None)
        if chosen is None:
            raise Unavailable(f"{ISA_VARIABLE}={forced!r} is none of {', '.join(i.name for i in ISAS)}")
        if not chosen.needs <= flags:
            raise Unavailable(f"{ISA_VARIABLE}={forced}: this CPU lacks {', '.join(sorted(chosen.needs - flags))}")
        return chosen
    chosen = next((i for i in ISAS if i.needs <= flags), None)
    if chosen is None:
        raise Unavailable(f"this CPU lacks {', '.join(sorted(NEEDED_FLAGS - flags))}")
    return chosen


def _ov_dirs() -> tuple[Path, Path, str, str]:
    root = Path(ov.__file__).parent
    libs = root / "libs"
    core = next(libs.glob("libopenvino.so.*"), None)
    tbb = next(libs.glob("libtbb.so.*"), None)
    if not (root / "include" / "openvino").is_dir() or core is None or tbb is None:
        raise Unavailable(f"the openvino package at {root} has no headers or libraries to build against")
    return root / "include", libs, core.name, tbb.name


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++")


@functools.cache
def _compiler_key(cxx: str) -> str:
    """The compiler's own words for what it is (its --version's first line), and where it is."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    return hashlib.sha256(f"{os.path.realpath(cxx)}\0{version.partition(chr(10))[0]}".encode()).hexdigest()[:8]


def source_key(path: Isa) -> str:
    """What a library's code is a function of, but the compiler: source, OpenVINO, flags, path."""
    texts = [p.read_text() for p in (SOURCE, *HEADERS)]
    digest = hashlib.sha256("\0".join([*texts, ov.__version__, *_FLAGS, *path.flags]).encode()).hexdigest()[:16]
    return f"{path.name}-{digest}"


def _ahead(path: Isa) -> Path | None:
    ahead = os.environ.get(KERNEL_DIR)
    target = Path(ahead) / source_key(path) / NAME if ahead else None
    return target if target is not None and target.is_file() else None


def _cached(path: Isa) -> Path | None:
    """One built into the cache by any compiler (e.g. one since removed)."""
    return next(iter(sorted((cache_root() / "lowbit").glob(f"{source_key(path)}-*/{NAME}"))), None)


_LOADED: list[ov.Core] = []  # the Core that loaded library()'s, kept: the library stays loaded


@functools.cache
def library() -> Path:
    """The library of this CPU's path, found or built, loaded to check it and kept loaded; raises
    Unavailable."""
    path = isa()
    target = _ahead(path)
    if target is None:
        cxx = _compiler()
        target = build(path, cache_root() / "lowbit" / f"{source_key(path)}-{_compiler_key(cxx)}", cxx) if cxx \
            else _cached(path)
    if target is None:
        raise Unavailable("no C++ compiler (c++ or g++, or $CXX) to build the low-bit matmul kernel")
    core = ov.Core()
    try:
        core.add_extension(str(target))
    except RuntimeError as e:
        raise Unavailable(f"the low-bit kernel at {target} does not load: {str(e).strip().splitlines()[-1]}") from e
    # Loaded for the life of the process: a graph's kernel nodes may outlive every Core and NodeFactory
    # that loaded the library, and freeing them once OpenVINO had unloaded it called into unmapped code
    # (a segfault compiling a decode model with the AVX2 class's settings, torch imported).
    _LOADED.append(core)
    return target


def build(path: Isa, directory: Path, cxx: str | None = None) -> Path:
    """`path`'s library in `directory`, built if it is not there yet (whatever this CPU)."""
    target = directory / NAME
    if target.is_file():
        return target
    cxx = cxx or _compiler()
    if not cxx:
        raise Unavailable("no C++ compiler (c++ or g++, or $CXX) to build the low-bit matmul kernel")
    _compile(path, cxx, target)
    return target


def _compile(path: Isa, cxx: str, target: Path) -> None:
    include, libs, core, tbb = _ov_dirs()
    cmd = [cxx, *_FLAGS, *path.flags, "-shared", "-fPIC", str(SOURCE), f"-I{include}", f"-L{libs}",
           f"-l:{core}", f"-l:{tbb}", f"-Wl,-rpath,{libs}", "-o"]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                lines = done.stderr.splitlines()
                error = next((x for x in lines if "error" in x), lines[-1] if lines else "?")
                raise Unavailable(f"building the low-bit matmul kernel failed: {error}")
            os.replace(out, target)  # atomic: servers starting at once each build, one file wins
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"cannot build the low-bit matmul kernel into {target.parent}: {e}") from e


def main(argv: list[str]) -> int:
    """`python -m vinoserve.model.lowbit.build DIR`: every path built into DIR, for
    $VINOSERVE_KERNEL_DIR (the Docker image's build)."""
    if len(argv) != 1:
        print("usage: python -m vinoserve.model.lowbit.build DIR", file=sys.stderr)
        return 2
    # one compiler a core: each compile is one process (the four paths took 53 s one at a time on 2 cores)
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        for target in pool.map(lambda path: build(path, Path(argv[0]) / source_key(path)), ISAS):
            print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
