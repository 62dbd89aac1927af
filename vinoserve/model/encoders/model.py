"""An encoder ready to run: a Hugging Face / sentence-transformers directory -> its OpenVINO graph
(built here from the safetensors, cached by the weights' hash like GGUF conversions) -> compiled,
with its tokenizer. `run` takes a ragged batch and returns pooled vectors or classifier scores."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from vinoserve.model.encoders.config import EncoderConfig, read_encoder_config
from vinoserve.model.encoders.gguf import read_gguf_encoder
from vinoserve.model.encoders.graph import build_encoder
from vinoserve.model.encoders.packing import Layout, Sequence, pack
from vinoserve.model.encoders.safetensors import SafeTensors
from vinoserve.model.encoders.tokenizer import EncoderTokenizer
from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.storage import atomic_dir, cache_root, sha256_file

# Bump when the graph or the cached directory's layout changes, so stale conversions are not reused.
ENCODER_VERSION = 3
_PREFIXES = ("", "bert.", "roberta.", "model.")  # BertModel saves bare names, *ForSequenceClassification prefixed
CONFIG_JSON = "vinoserve_encoder.json"


@dataclass(frozen=True)
class EncoderOptions:
    device: str = "CPU"
    inference_precision: str | None = None  # None: the device's fastest (bf16 on CPUs with AMX or AVX512-BF16)
    num_threads: int | None = None  # None: all cores

    def properties(self) -> dict[str, str]:
        props = {"NUM_STREAMS": "1", "PERFORMANCE_HINT": "LATENCY"}
        # Nearly every encoder batch is a new shape: the plugin's shape cache (5000 entries, ~140 kB
        # each) grew resident memory for hours (docs/reliability.md); 64 keep a steady client's shapes.
        if self.device == "CPU":
            props["CPU_RUNTIME_CACHE_CAPACITY"] = "64"
        if self.inference_precision:
            props["INFERENCE_PRECISION_HINT"] = self.inference_precision
        if self.inference_precision == "f32":  # as for the LLM (model/paged.py): f32 means no int8 activations
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = "0"
        if self.num_threads:
            props["INFERENCE_NUM_THREADS"] = str(self.num_threads)
        return props


class EncoderModel:
    """One compiled encoder; `run` is thread-safe (one infer request, locked)."""

    def __init__(self, path: Path, config: EncoderConfig, tokenizer: EncoderTokenizer, compiled: ov.CompiledModel,
                 weight_bytes: int) -> None:
        self.path, self.config, self.tokenizer, self.weight_bytes = path, config, tokenizer, weight_bytes
        self._request = compiled.create_infer_request()
        self._lock = threading.Lock()
        self.inference_precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    def run(self, seqs: list[Sequence], layout: Layout = "auto") -> np.ndarray:
        """[N, H] pooled vectors (L2-normalised if the model says so) or [N, num_labels] logits."""
        inputs = pack(seqs, self.config, layout)
        with self._lock:
            out = self._request.infer(inputs, share_inputs=True)
            result = np.array(next(iter(out.values())), np.float32)
        if self.config.normalize and not self.config.is_classifier:
            result /= np.maximum(np.linalg.norm(result, axis=1, keepdims=True), 1e-12)
        return result


def load_encoder(model_dir: Path, options: EncoderOptions = EncoderOptions(), log=print) -> EncoderModel:
    cached = converted_encoder_dir(model_dir, log)
    config = EncoderConfig(**json.loads((cached / CONFIG_JSON).read_text()))
    tokenizer = EncoderTokenizer.from_dir(cached)
    core = ov.Core()
    try:
        compiled = core.compile_model(cached / "openvino_model.xml", options.device, options.properties())
    except RuntimeError as e:
        raise ModelLoadError(f"{model_dir}: the encoder graph does not compile: {last_line(e)}") from e
    weight_bytes = (cached / "openvino_model.bin").stat().st_size
    return EncoderModel(model_dir, config, tokenizer, compiled, weight_bytes)


def converted_encoder_dir(model_dir: Path, log=print) -> Path:
    """The cached graph + tokenizer + config for this directory or GGUF, built first if missing."""
    gguf_file = model_dir.suffix == ".gguf"
    digest = sha256_file(model_dir) if gguf_file else _digest(model_dir)
    name = display_name(model_dir)
    target = cache_root() / "encoders" / f"{name}-{digest[:16]}-v{ENCODER_VERSION}"
    if (target / "openvino_model.xml").is_file():
        return target
    if gguf_file:
        config, tensor, tokenizer = read_gguf_encoder(model_dir)
    else:
        config, tokenizer = read_encoder_config(model_dir), EncoderTokenizer.from_dir(model_dir)
        tensor = _resolver(SafeTensors.of_dir(model_dir), model_dir)
    log(f"building the encoder graph of {model_dir} into {target} ...")
    start = time.perf_counter()
    with atomic_dir(target) as tmp:
        save_encoder(tmp, config, tensor, tokenizer)
    log(f"built in {time.perf_counter() - start:.1f} s")
    return target


def display_name(path: Path) -> str:
    """A model's name for logs and the cache: a GGUF's stem, a directory's name, or its parent's
    where the directory is only called "model" (as inside a wheel)."""
    if path.suffix == ".gguf":
        return path.stem
    return path.parent.name if path.name == "model" else path.name


def save_encoder(out: Path, config: EncoderConfig, tensor, tokenizer: EncoderTokenizer) -> None:
    """The cached layout: openvino_model.xml/.bin, tokenizer.json and our config."""
    ov.save_model(build_encoder(config, tensor), out / "openvino_model.xml", compress_to_fp16=False)
    tokenizer.save(out / "tokenizer.json")
    (out / CONFIG_JSON).write_text(json.dumps(dataclasses.asdict(config), indent=2))


def _resolver(tensors: SafeTensors, model_dir: Path):
    def tensor(name: str) -> np.ndarray:
        for prefix in _PREFIXES:
            if prefix + name in tensors:
                return tensors.get(prefix + name)
        raise ModelLoadError(f"{model_dir}: tensor {name} is missing from the safetensors")
    return tensor


def _digest(model_dir: Path) -> str:
    """Of the files that shape the graph: weights, configs, tokenizer."""
    h = hashlib.sha256()
    names = ["config.json", "modules.json", "sentence_bert_config.json", "tokenizer.json", "tokenizer_config.json"]
    files = sorted(model_dir.glob("*.safetensors")) + [model_dir / n for n in names]
    files += sorted(model_dir.glob("*_Pooling/config.json"))
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            with f.open("rb") as src:
                while block := src.read(1 << 20):
                    h.update(block)
    return h.hexdigest()
