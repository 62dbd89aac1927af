"""Where converted and downloaded models live, and how they get there without half-written files."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    root = os.environ.get("VINOSERVE_CACHE")
    return Path(root) if root else Path(platformdirs.user_cache_dir("vinoserve"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yields a scratch dir beside `final`; renames it into place only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():  # another process finished the same conversion first
            shutil.rmtree(tmp)
        else:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be a shared volume
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
