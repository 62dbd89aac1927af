"""BERT encoders from GGUF as llama.cpp's converter writes them (architectures `bert` and
`nomic-bert`): the same graph as from safetensors (nomic-bert: rotary positions, fused q/k/v, gated
FFN), its config, pooling and WordPiece vocabulary read from the file.
llama.cpp normalises the vectors its server returns, so these embedders are normalised too."""
from __future__ import annotations

from pathlib import Path

import gguf
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from vinoserve.model.encoders.config import EncoderConfig
from vinoserve.model.encoders.tokenizer import EncoderTokenizer
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import GGUFMeta, field, open_gguf

ARCHITECTURES = ("bert", "nomic-bert")
_POOLING = {gguf.PoolingType.MEAN: "mean", gguf.PoolingType.CLS: "cls", gguf.PoolingType.LAST: "last",
            gguf.PoolingType.RANK: "cls"}
# Hugging Face name (without the model prefix) -> GGUF name; {i} is the layer
_NAMES = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
          "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
          "pooler.dense": "cls", "classifier": "cls.output"}
_LAYER = {"attention.self.qkv": "attn_qkv", "intermediate.gate": "ffn_gate", "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
          "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
          "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}


def is_encoder_gguf(path: Path) -> bool:
    if path.suffix != ".gguf" or not path.is_file():
        return False
    try:
        return field(gguf.GGUFReader(path), "general.architecture") in ARCHITECTURES
    except Exception:  # not readable: the chat loader says why
        return False


def read_gguf_encoder(path: Path):
    """(config, tensor(hf_name) -> float32 array, tokenizer) of a BERT GGUF."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not an encoder vinoserve reads ({', '.join(ARCHITECTURES)})")
    meta = GGUFMeta(path, reader, {t.name: t for t in reader.tensors}, arch)
    pooling = gguf.PoolingType(meta.key("pooling_type", gguf.PoolingType.CLS))
    if pooling == gguf.PoolingType.NONE:
        raise ModelLoadError(f"{path}: pooling type none gives per-token vectors, not one per input")
    ranker = pooling == gguf.PoolingType.RANK
    types = meta.tensors.get("token_types.weight")
    config = EncoderConfig(
        model_type=arch, vocab_size=len(meta.field("tokenizer.ggml.tokens")),
        hidden_size=meta.key("embedding_length"), num_layers=meta.key("block_count"),
        num_heads=meta.key("attention.head_count"), intermediate_size=meta.key("feed_forward_length"),
        hidden_act="gelu", layer_norm_eps=meta.key("attention.layer_norm_epsilon", 1e-12),
        max_position_embeddings=meta.key("context_length"), type_vocab_size=int(types.shape[1]) if types else 0,
        position_offset=0, pooling=_POOLING[pooling], normalize=not ranker, max_length=meta.key("context_length"),
        num_labels=int(meta.tensors["cls.output.weight"].shape[-1]) if ranker else 0,
        rope_base=float(meta.key("rope.freq_base", 1000.0)) if arch == "nomic-bert" else 0.0,
        linear_bias="blk.0.attn_qkv.bias" in meta.tensors if arch == "nomic-bert" else True,
    )

    def tensor(name: str):
        return meta.tensor(_gguf_name(name)).dequantize()

    return config, tensor, EncoderTokenizer(_wordpiece(meta))


def _gguf_name(hf: str) -> str:
    base, _, part = hf.rpartition(".")
    if base.startswith("encoder.layer."):
        i, _, rest = base[len("encoder.layer."):].partition(".")
        return f"blk.{i}.{_LAYER[rest]}.{part}"
    return f"{_NAMES[base]}.{part}"


def _wordpiece(meta: GGUFMeta) -> Tokenizer:
    """The WordPiece tokenizer the vocabulary was: llama.cpp's converter spells word starts with
    a leading U+2581 and continuations without "##"; special tokens are unchanged. llama.cpp
    lower-cases and splits like BERT's basic tokenizer, as does this."""
    tokens = meta.field("tokenizer.ggml.tokens")
    kinds = meta.field("tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)
    vocab = {}
    for i, (t, kind) in enumerate(zip(tokens, kinds)):
        word = t if kind == gguf.TokenType.CONTROL or (t.startswith("[") and t.endswith("]")) else (
            t[1:] if t.startswith("\u2581") else "##" + t)
        vocab.setdefault(word, i)
    cls = meta.field("tokenizer.ggml.bos_token_id", 101)
    sep = meta.field("tokenizer.ggml.seperator_token_id", 102)
    unk = tokens[meta.field("tokenizer.ggml.unknown_token_id", 100)]
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tokens[cls]} $A {tokens[sep]}", pair=f"{tokens[cls]} $A {tokens[sep]} $B:1 {tokens[sep]}:1",
        special_tokens=[(tokens[cls], cls), (tokens[sep], sep)])
    return tok
