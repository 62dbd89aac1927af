"""What an encoder directory says about its model: the BERT-family shape (config.json), its head
(a bare encoder or a sequence classifier), and how sentence-transformers pools and normalises its
output (modules.json, 1_Pooling/config.json, sentence_bert_config.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vinoserve.model.errors import ModelLoadError

# model_type -> the first position id of a sequence. RoBERTa's tables keep rows 0..pad for padding,
# so its positions start at pad_token_id + 1 (XLM-R, bge-m3, multilingual-e5 are RoBERTa-shaped).
FAMILIES = {"bert": None, "roberta": "pad+1", "xlm-roberta": "pad+1"}
Pooling = Literal["cls", "mean", "last", "mean_sqrt_len"]
_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_cls": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean": "mean", "pooling_mode_lasttoken": "last",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    position_offset: int  # the position id of a sequence's first token
    pooling: Pooling = "cls"
    normalize: bool = False
    max_length: int = 512  # tokens per sequence, special tokens included
    num_labels: int = 0  # > 0: a sequence classifier (cross-encoder) with this many logits
    sigmoid: bool = True  # a one-logit classifier's score is sigmoid(logit) (sentence-transformers' default)
    # nomic-bert (from GGUF): rotary positions of this base instead of a position table, q/k/v in
    # one matrix, a gated FFN down(silu(gate(x)) * up(x)), and projections without biases
    rope_base: float = 0.0
    linear_bias: bool = True

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


def is_encoder_dir(path: Path) -> bool:
    """A Hugging Face directory of a BERT-family model in safetensors (not an optimum IR export)."""
    if not (path / "config.json").is_file() or (path / "openvino_model.xml").is_file():
        return False
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") in FAMILIES
    except (OSError, ValueError):
        return False


def read_encoder_config(path: Path) -> EncoderConfig:
    hf = _json(path / "config.json")
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not an encoder vinoserve builds "
                             f"(supported: {', '.join(FAMILIES)})")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{path}: position_embedding_type {hf['position_embedding_type']!r} is not supported")
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"{path}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    archs = hf.get("architectures") or []
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    num_labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2) if classifier else 0
    pad = hf.get("pad_token_id") or 0
    max_pos = hf["max_position_embeddings"]
    offset = pad + 1 if FAMILIES[model_type] == "pad+1" else 0
    pooling, normalize = sentence_transformers_head(path)
    max_length = min(declared_max_length(path) or max_pos, max_pos - offset)
    return EncoderConfig(
        model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], hidden_act=act, layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        max_position_embeddings=max_pos, type_vocab_size=hf.get("type_vocab_size", 2), position_offset=offset,
        pooling=pooling, normalize=normalize, max_length=max_length, num_labels=num_labels,
        sigmoid=_classifier_sigmoid(hf),
    )


def sentence_transformers_head(path: Path) -> tuple[Pooling, bool]:
    """Pooling mode and whether vectors are L2-normalised. Without modules.json (a plain HF
    encoder): CLS pooling, unnormalised, as transformers' feature-extraction pipelines do."""
    modules = _json(path / "modules.json", [])
    pooling: Pooling = "cls"
    normalize = False
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            cfg = _json(path / module.get("path", "1_Pooling") / "config.json", {})
            modes = [mode for key, mode in _POOLING_KEYS.items() if cfg.get(key)]
            if "pooling_mode" in cfg:  # sentence-transformers 5+ names one mode
                modes = [_POOLING_KEYS.get(f"pooling_mode_{cfg['pooling_mode']}", cfg["pooling_mode"])]
            if len(modes) != 1 or modes[0] not in _POOLING_KEYS.values() or cfg.get("include_prompt") is False:
                raise ModelLoadError(f"{path}: pooling {cfg} is not supported (one of CLS, mean, last token)")
            pooling = modes[0]
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer", ""):
            raise ModelLoadError(f"{path}: sentence-transformers module {module.get('type')} is not supported")
    return pooling, normalize


def declared_max_length(path: Path) -> int | None:
    """Where sentence-transformers truncates: max_seq_length (before 5) or the tokenizer's
    model_max_length (a huge number there means none)."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        value = _json(path / name, {}).get(key)
        if isinstance(value, int) and value < 1_000_000:
            return value
    return None


def _classifier_sigmoid(hf: dict) -> bool:
    """sentence-transformers' CrossEncoder applies sigmoid to one logit unless its config says
    another activation (Identity: the raw logit is the score)."""
    fn = (hf.get("sentence_transformers") or {}).get("activation_fn") or ""
    return not fn or fn.endswith("Sigmoid")


def _json(path: Path, default=None):
    if not path.is_file():
        if default is not None:
            return default
        raise ModelLoadError(f"{path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
