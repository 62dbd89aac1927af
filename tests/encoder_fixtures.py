"""Tiny random BERT-family models in Hugging Face / sentence-transformers layout, as the
references for the encoder graph (seconds to make, no download)."""
from __future__ import annotations

from pathlib import Path

WORDS = ("the a of to and in is it that was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will "
         "up other about out many then them these so some her would make like him into time has look two more "
         "paris france capital city river cat dog sat mat").split()


def wordpiece_tokenizer(path: Path, lowercase: bool = True, roberta_pairs: bool = False):
    """A BERT WordPiece tokenizer over a small vocabulary, saved as tokenizer.json (+ the
    transformers files) under `path`; returns the transformers tokenizer. Pairs as BERT's
    ([CLS] a [SEP] b [SEP], b of token type 1) or RoBERTa's ([CLS] a [SEP] [SEP] b [SEP], type 0)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,!?'0123456789")
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + letters + [f"##{c}" for c in letters] + list(WORDS)))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] [SEP] $B [SEP]" if roberta_pairs else "[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    fast.save_pretrained(path)
    return fast


def tiny_config(model_type: str, vocab_size: int, **overrides):
    from transformers import AutoConfig

    base = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=96, max_position_embeddings=80, type_vocab_size=2, pad_token_id=0,
                initializer_range=0.2)  # wide enough that random texts score apart
    if model_type == "xlm-roberta":
        base.update(pad_token_id=1, max_position_embeddings=82, type_vocab_size=1)
    return AutoConfig.for_model(model_type, **{**base, **overrides})


def save_embedder(path: Path, model_type: str = "bert", pooling: str = "mean", normalize: bool = True,
                  max_seq_length: int = 64, seed: int = 0, **overrides) -> Path:
    """A sentence-transformers directory: random encoder, Pooling(pooling), Normalize if asked."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoModel

    torch.manual_seed(seed)
    hf = path / "hf"
    tokenizer = wordpiece_tokenizer(hf)
    AutoModel.from_config(tiny_config(model_type, len(tokenizer), **overrides)).save_pretrained(hf)
    transformer = models.Transformer(str(hf), max_seq_length=max_seq_length)
    modules = [transformer, models.Pooling(64, pooling_mode=pooling)] + ([models.Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu").save(str(path / "st"))
    return path / "st"


def save_cross_encoder(path: Path, model_type: str = "bert", seed: int = 0, num_labels: int = 1) -> Path:
    """A transformers *ForSequenceClassification directory with one logit (a reranker)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    tokenizer = wordpiece_tokenizer(path, roberta_pairs=model_type != "bert")
    config = tiny_config(model_type, len(tokenizer), num_labels=num_labels)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return path


def write_nomic_gguf(path: Path, seed: int = 0, hidden: int = 64, heads: int = 4, layers: int = 2,
                     ffn: int = 96) -> Path:
    """A tiny random nomic-bert GGUF in llama.cpp's layout (fused q/k/v, gated FFN, rotary
    positions, no projection biases), with the WordPiece vocabulary of `wordpiece_tokenizer`."""
    import gguf
    import numpy as np

    from vinoserve.bench.bert_gguf import phantom_space

    tok = wordpiece_tokenizer(path.parent / f"{path.stem}-tokenizer")
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    rng = np.random.default_rng(seed)

    def rand(*shape: int, centre: float = 0.0) -> np.ndarray:
        return (centre + 0.2 * rng.standard_normal(shape)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "nomic-bert")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_rope_freq_base(1000.0)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_tokenizer_model("bert")
    w.add_token_list([phantom_space(t) for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("[") else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_type_count(2)
    w.add_bos_token_id(tok.cls_token_id)
    w.add_sep_token_id(tok.sep_token_id)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_tensor("token_embd.weight", rand(len(vocab), hidden))
    w.add_tensor("token_types.weight", rand(2, hidden))
    w.add_tensor("token_embd_norm.weight", rand(hidden, centre=1.0))
    w.add_tensor("token_embd_norm.bias", rand(hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_qkv.weight", rand(3 * hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_output_norm.weight", rand(hidden, centre=1.0))
        w.add_tensor(f"blk.{i}.attn_output_norm.bias", rand(hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, ffn))
        w.add_tensor(f"blk.{i}.layer_output_norm.weight", rand(hidden, centre=1.0))
        w.add_tensor(f"blk.{i}.layer_output_norm.bias", rand(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
