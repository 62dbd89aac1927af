"""Compile lowbit_matmul.cpp (and the lowbit_kernels.hpp it includes) into an OpenVINO extension
library, once per source, OpenVINO and compiler, into the cache directory (the first load takes a
few seconds; later ones reuse it).

Built on the machine that runs it rather than shipped: an extension must be built against the
OpenVINO it is loaded into, and the headers and libraries come with the openvino wheel. Where no
C++ compiler is found, or the CPU lacks the instructions the kernel uses, the decode model keeps
the plugin's own matmuls; `unavailable()` says why, in one line.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import openvino as ov

from vinoserve.model.cpu_class import cpu_flags
from vinoserve.model.storage import cache_root

SOURCE = Path(__file__).with_name("lowbit_matmul.cpp")
HEADERS = sorted(SOURCE.parent.glob("*.hpp"))  # included by SOURCE: part of what a build is keyed on
# AVX-512 with VNNI (vpdpbusd) and the f16 conversions: Ice Lake and later Xeons, Zen 4 and later.
NEEDED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"})
_ISA = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]
# No contraction of a * b + c into one fma where the source does not ask for one: the gather's
# q * scale + offset rounds twice, as the graph's Multiply and Add (and numpy) do.
_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", *_ISA]


class Unavailable(RuntimeError):
    """Why the kernel cannot be used here (one line)."""


def _ov_dirs() -> tuple[Path, Path, str, str]:
    root = Path(ov.__file__).parent
    libs = root / "libs"
    core = next(libs.glob("libopenvino.so.*"), None)
    tbb = next(libs.glob("libtbb.so.*"), None)
    if not (root / "include" / "openvino").is_dir() or core is None or tbb is None:
        raise Unavailable(f"the openvino package at {root} has no headers or libraries to build against")
    return root / "include", libs, core.name, tbb.name


def _compiler() -> str:
    cxx = shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++")
    if not cxx:
        raise Unavailable("no C++ compiler (c++ or g++, or $CXX) to build the low-bit matmul kernel")
    return cxx


def built_path() -> Path:
    """Where the library for this source and this OpenVINO is (or will be) built."""
    texts = [p.read_text() for p in (SOURCE, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, ov.__version__, *_FLAGS]).encode()).hexdigest()[:16]
    return cache_root() / "lowbit" / key / "liblowbit_matmul.so"


@functools.cache
def library() -> Path:
    """The library, built if it is not yet, where this CPU can run it; raises Unavailable."""
    missing = NEEDED_FLAGS - cpu_flags()
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(sorted(missing))}")
    return compile_library()


def compile_library() -> Path:
    """The library for this source and OpenVINO, built if it is not yet (whatever this CPU: the
    Docker image builds it where its compiler is, then drops the compiler)."""
    target = built_path()
    if target.is_file():  # built earlier, maybe where a compiler was (the Docker image's build)
        return target
    include, libs, core, tbb = _ov_dirs()
    cxx = _compiler()
    cmd = [cxx, *_FLAGS, "-shared", "-fPIC", str(SOURCE), f"-I{include}", f"-L{libs}",
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
    return target
