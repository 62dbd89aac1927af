"""Encoders exported by `optimum-cli export openvino --task feature-extraction` (or
text-classification for cross-encoders): the graph as exported, any architecture it holds (MPNet,
GTE, Nomic...), run on right-padded batches. Pooling and normalisation: an export of a
sentence-transformers model has them in the graph (`sentence_embedding`); otherwise they are done
here from the directory's modules.json / 1_Pooling, over `last_hidden_state` or `token_embeddings`."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import openvino as ov

from vinoserve.model.encoders.config import EncoderConfig, declared_max_length, sentence_transformers_head
from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.encoders.packing import Sequence, right_padded
from vinoserve.model.encoders.tokenizer import EncoderTokenizer
from vinoserve.model.errors import ModelLoadError, last_line

STATES = ("sentence_embedding", "last_hidden_state", "token_embeddings", "logits")  # by preference


def is_encoder_ir(path: Path) -> bool:
    """An optimum IR directory whose config names an encoder (not a decoder for the paged engine)."""
    if not (path / "openvino_model.xml").is_file() or not (path / "config.json").is_file():
        return False
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = hf.get("architectures") or []
    return not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs) and not hf.get("is_decoder")


class IREncoder:
    """EncoderModel's interface (config, tokenizer, run) over an exported IR."""

    def __init__(self, path: Path, options: EncoderOptions = EncoderOptions()) -> None:
        core = ov.Core()
        try:
            model = core.read_model(path / "openvino_model.xml")
            compiled = core.compile_model(model, options.device, options.properties())
        except RuntimeError as e:
            raise ModelLoadError(f"{path}/openvino_model.xml cannot be loaded: {last_line(e)}") from e
        names = {n for o in compiled.outputs for n in o.get_names()}
        self._output = next((n for n in STATES if n in names), None)
        if self._output is None:
            raise ModelLoadError(f"{path}: the IR has none of the outputs {', '.join(STATES)} (outputs: {sorted(names)})")
        self._inputs = {n for i in compiled.inputs for n in i.get_names()}
        self.config = _config(path, classifier=self._output == "logits")
        self.tokenizer = EncoderTokenizer.from_dir(path)
        self._request = compiled.create_infer_request()
        self._lock = threading.Lock()
        self.path = path
        self.weight_bytes = (path / "openvino_model.bin").stat().st_size
        self.inference_precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    def run(self, seqs: list[Sequence], layout: str = "auto") -> np.ndarray:
        feed = right_padded(seqs)
        with self._lock:
            out = np.array(self._request.infer({k: v for k, v in feed.items() if k in self._inputs})[self._output],
                           np.float32)
        if self._output in ("sentence_embedding", "logits"):
            return out
        pooled = _pool(out, feed["attention_mask"], feed["lengths"], self.config.pooling)
        if self.config.normalize:
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled


def _pool(states: np.ndarray, mask: np.ndarray, lengths: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "cls":
        return states[:, 0].copy()
    if pooling == "last":
        return states[np.arange(len(lengths)), lengths - 1].copy()
    summed = (states * mask[..., None]).sum(1)
    return summed / (lengths[:, None] if pooling == "mean" else np.sqrt(lengths)[:, None])


def _config(path: Path, classifier: bool) -> EncoderConfig:
    hf = json.loads((path / "config.json").read_text())
    pooling, normalize = sentence_transformers_head(path)
    max_pos = hf.get("max_position_embeddings", 512)
    offset = (hf.get("pad_token_id") or 0) + 1 if hf.get("model_type") in ("roberta", "xlm-roberta", "mpnet") else 0
    declared = declared_max_length(path) or max_pos - offset
    return EncoderConfig(
        model_type=hf.get("model_type", "ir"), vocab_size=hf.get("vocab_size", 0), hidden_size=hf.get("hidden_size", 0),
        num_layers=hf.get("num_hidden_layers", 0), num_heads=hf.get("num_attention_heads", 1),
        intermediate_size=hf.get("intermediate_size", 0), hidden_act=hf.get("hidden_act", ""), layer_norm_eps=0.0,
        max_position_embeddings=max_pos, type_vocab_size=hf.get("type_vocab_size", 0), position_offset=offset,
        pooling=pooling, normalize=normalize, max_length=min(int(declared), max_pos - offset),
        num_labels=len(hf.get("id2label") or {}) or 1 if classifier else 0,
    )

