"""GGUF file -> a model directory in optimum-cli's layout, cached by the file's content hash."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import openvino as ov

from vinoserve.model.constant_store import ConstantStore
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.gguf_tokenizer import build_tokenizer_models, read_tokenizer_metadata
from vinoserve.model.graph import build_model
from vinoserve.model.mapped_pages import drop_mapped_pages
from vinoserve.model.storage import atomic_dir, cache_root, sha256_file
from vinoserve.model.weights import WeightFormat, Weights

# Bump when the graph or the directory layout changes, so stale conversions are not reused.
CONVERTER_VERSION = 6


def converted_dir(gguf_path: Path, weight_format: WeightFormat, log=print) -> Path:
    """The converted directory for this GGUF, converting it first if the cache lacks it."""
    if not gguf_path.is_file():
        raise ModelLoadError(f"model file not found: {gguf_path}")
    digest = sha256_file(gguf_path)
    target = cache_root() / "converted" / f"{gguf_path.stem}-{digest[:16]}-{weight_format}-v{CONVERTER_VERSION}"
    if (target / "openvino_model.xml").is_file():
        return target
    log(f"converting {gguf_path.name} to OpenVINO ({weight_format} weights) into {target} ...")
    start = time.perf_counter()
    try:
        with atomic_dir(target) as tmp:
            _convert(gguf_path, tmp, weight_format, digest)
    except OSError as e:  # a full disk, most often: one line, and atomic_dir left nothing behind
        free = shutil.disk_usage(target.parent).free
        raise ModelLoadError(f"converting {gguf_path.name} into {target.parent} failed: {e.strerror or e} "
                             f"({free / 2**30:.1f} GiB free there; the conversion takes about the file's size "
                             f"again, K-quants up to 1.4x)") from e
    log(f"converted in {time.perf_counter() - start:.1f} s")
    return target


def _convert(gguf_path: Path, out: Path, weight_format: WeightFormat, digest: str) -> None:
    src = GGUFModel.open(gguf_path)
    cfg = src.config
    store = ConstantStore(out / "constants.tmp")  # tensor by tensor: the weights never all in memory
    try:
        model = build_model(cfg, src.tensor, Weights(weight_format, store))
        drop_mapped_pages(gguf_path)  # read: the GGUF's pages need not stay beside the store's while saving
        store.save(model, out / "openvino_model.xml")
        del model  # its constants map the store's file
    finally:
        store.close()
    meta = read_tokenizer_metadata(src.reader)
    tokenizer, detokenizer = build_tokenizer_models(src.reader)
    ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")
    (out / "config.json").write_text(json.dumps(src.family.hf_config(cfg), indent=2))
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if meta.chat_template:
        (out / "chat_template.jinja").write_text(meta.chat_template)
    source = {"gguf": str(gguf_path.resolve()), "sha256": digest, "weight_format": weight_format}
    (out / "vinoserve_source.json").write_text(json.dumps(source, indent=2))
