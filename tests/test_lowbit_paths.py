"""The kernel's instruction-set paths (model/lowbit/build.py: AVX-512 VNNI, AVX-512 without VNNI,
AVX-VNNI, AVX2) compute the same float steps per row, so each gives every other's outputs bit for
bit: every weight layout, in one and two planes, at the row counts each path takes its own way.
Run on every path this CPU has (a Sapphire Rapids or Zen 5 has all four)."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from vinoserve.model.cpu_class import cpu_flags
from vinoserve.model.lowbit import build

HERE = Path(__file__).parent


def _outputs(isa: str, out: Path) -> dict[str, np.ndarray]:
    env = {**os.environ, build.ISA_VARIABLE: isa, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(HERE / "lowbit_path_outputs.py"), str(out)], check=True, env=env, timeout=600)
    return dict(np.load(out))


def test_every_path_this_cpu_has_gives_the_same_outputs(kernel, tmp_path):
    paths = [i.name for i in build.ISAS if i.needs <= cpu_flags()]
    assert paths and paths[-1] == "avx2"  # the kernel runs here, so AVX2 does
    if len(paths) == 1:
        pytest.skip("only the AVX2 path runs on this CPU: nothing to compare it with")
    # a process a path, one a core: each builds its path's library first where CI's cache is empty
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        first, *others = pool.map(lambda isa: _outputs(isa, tmp_path / f"{isa}.npz"), paths)
    assert len(first) == 11 * 7 * 2 and all(np.abs(y).max() > 0 for y in first.values())
    for isa, other in zip(paths[1:], others):
        for key, y in first.items():
            np.testing.assert_array_equal(other[key], y, err_msg=f"{isa} against {paths[0]}: {key}")


def test_the_variable_forces_a_path_and_refuses_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setenv(build.ISA_VARIABLE, "avx2")
    assert build.isa(frozenset({"avx2", "fma", "f16c", "avx512f"})).name == "avx2"
    with pytest.raises(build.Unavailable, match="lacks avx512_vnni"):
        monkeypatch.setenv(build.ISA_VARIABLE, "avx512")
        build.isa(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}))
    monkeypatch.setenv(build.ISA_VARIABLE, "neon")
    with pytest.raises(build.Unavailable, match="is none of avx512, avx512bw, avxvnni, avx2"):
        build.isa(frozenset())
    monkeypatch.delenv(build.ISA_VARIABLE)
    assert build.isa(frozenset({"avx2", "fma", "f16c"})).name == "avx2"  # Zen 2 / 3, Haswell to Skylake client
    assert build.isa(frozenset({"avx2", "fma", "f16c", "avx_vnni"})).name == "avxvnni"  # Alder Lake
    assert build.isa(frozenset({"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                                "avx512_vnni"})).name == "avx512"  # Zen 5, Sapphire Rapids
    assert build.isa(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})).name == "avx512bw"  # Skylake-SP
    with pytest.raises(build.Unavailable, match="lacks avx2"):
        build.isa(frozenset({"sse4_2", "avx", "fma", "f16c"}))


def test_a_library_built_ahead_is_found_without_a_compiler(kernel, tmp_path, monkeypatch):
    """The Docker image's way: every path built into a directory ($VINOSERVE_KERNEL_DIR) where no
    volume hides it; the server then needs no compiler, and an empty cache is not built into."""
    done = subprocess.run([sys.executable, "-m", "vinoserve.model.lowbit.build", str(tmp_path / "ahead")],
                          capture_output=True, text=True, check=True, timeout=900)
    assert len(done.stdout.split()) == len(build.ISAS)
    monkeypatch.setenv(build.KERNEL_DIR, str(tmp_path / "ahead"))
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))
    build.library.cache_clear()
    try:
        assert build.library().is_relative_to(tmp_path / "ahead")
        assert not (tmp_path / "cache").exists()
    finally:
        build.library.cache_clear()


def test_a_library_that_does_not_load_is_unavailable_with_the_reason(kernel, tmp_path, monkeypatch):
    """A file where the library should be that is none (or another OpenVINO's build): Unavailable,
    naming it, so the model falls back to the plugin's matmuls with that reason."""
    broken = tmp_path / "ahead" / build.source_key(build.isa()) / build.NAME
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a shared library\n" * 64)
    monkeypatch.setenv(build.KERNEL_DIR, str(tmp_path / "ahead"))
    build.library.cache_clear()
    try:
        with pytest.raises(build.Unavailable, match=f"the low-bit kernel at {broken} does not load"):
            build.library()
    finally:
        build.library.cache_clear()
