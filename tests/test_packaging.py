"""The package's own module-level imports are all runtime dependencies: CI installs the test extra,
which would hide a serving dependency declared only there (the README's first command would fail)."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_AT_RUNTIME = {"torch", "transformers", "openvino_genai", "matplotlib"}  # test/export/plot extras


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported at module level (not inside functions: those are lazy)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_runtime_imports_are_declared_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~; \[]", d)[0].lower().replace("_", "-") for d in project["dependencies"]}
    dists = packages_distributions()
    imported = set().union(*(_module_level_imports(p) for p in (ROOT / "vinoserve").rglob("*.py")))
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "vinoserve"}
    assert not third_party & NOT_AT_RUNTIME, "serving must not import test or export extras at module level"
    missing = {m for m in third_party
               if not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & declared}
    assert not missing, f"imported by vinoserve but not runtime dependencies: {sorted(missing)}"


def test_wheel_carries_the_chat_page_and_the_kernel_source(tmp_path):
    """The page and the low-bit kernel's C++ (built where it runs) are package data: a wheel
    (what `pip install` builds) must hold them."""
    src = tmp_path / "src"  # building writes build/ and egg-info next to the sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("vinoserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        page = zf.read("vinoserve/server/static/chat.html").decode()
        assert b"OPENVINO_CREATE_EXTENSIONS" in zf.read("vinoserve/model/lowbit/lowbit_matmul.cpp")
        for header in ("layout", "multiply", "kernels_avx512", "kernels_avx2", "activations_avx512", "activations_avx2"):
            assert b"namespace vinoserve" in zf.read(f"vinoserve/model/lowbit/lowbit_{header}.hpp")  # the source includes them
        assert b"LowBitGather" in zf.read("vinoserve/model/lowbit/lowbit_gather.hpp")  # and this
    assert "v1/chat/completions" in page and "http://" not in page and "https://" not in page  # nothing remote
