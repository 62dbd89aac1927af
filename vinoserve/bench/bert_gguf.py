"""A sentence-transformers BERT directory written as a GGUF the way llama.cpp's
convert_hf_to_gguf.py writes one (architecture `bert`, WordPiece vocabulary with its phantom-space
spelling, pooling type from 1_Pooling), so that llama.cpp and vinoserve can be compared on the same
file without torch or llama.cpp's converter on the machine."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from vinoserve.model.encoders.config import read_encoder_config
from vinoserve.model.encoders.safetensors import SafeTensors

_POOLING = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "last": gguf.PoolingType.LAST}
_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
          "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
          "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}


def phantom_space(token: str) -> str:
    """llama.cpp's spelling: "##ing" -> "ing", "word" -> "\u2581word", "[CLS]" as is."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def write_bert_gguf(model_dir: Path, out: Path, dtype: str = "f32") -> Path:
    cfg = read_encoder_config(model_dir)
    if cfg.model_type != "bert" or cfg.is_classifier:
        raise ValueError(f"{model_dir}: only BERT embedders are written here")
    tensors = SafeTensors.of_dir(model_dir)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_name(model_dir.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_causal_attention(False)
    w.add_pooling_type(_POOLING[cfg.pooling])
    w.add_tokenizer_model("bert")
    w.add_token_list([phantom_space(t) for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_type_count(cfg.type_vocab_size)
    for key, token in (("bos", "[CLS]"), ("sep", "[SEP]"), ("unk", "[UNK]"), ("pad", "[PAD]"), ("mask", "[MASK]")):
        if token in tok["model"]["vocab"]:
            getattr(w, f"add_{key}_token_id")(tok["model"]["vocab"][token])
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    float_type = np.float16 if dtype == "f16" else np.float32

    def put(name: str, hf: str, matrix: bool = False) -> None:
        value = tensors.get(hf)
        w.add_tensor(name, value.astype(float_type if matrix and value.ndim == 2 else np.float32))

    put("token_embd.weight", "embeddings.word_embeddings.weight", True)
    # llama.cpp adds these to the token rows in f32 (its CPU add takes no f16 operand), as its converter keeps them
    put("position_embd.weight", "embeddings.position_embeddings.weight")
    put("token_types.weight", "embeddings.token_type_embeddings.weight")
    put("token_embd_norm.weight", "embeddings.LayerNorm.weight")
    put("token_embd_norm.bias", "embeddings.LayerNorm.bias")
    for i in range(cfg.num_layers):
        for hf, name in _LAYER.items():
            for part in ("weight", "bias"):
                put(f"blk.{i}.{name}.{part}", f"encoder.layer.{i}.{hf}.{part}", part == "weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
